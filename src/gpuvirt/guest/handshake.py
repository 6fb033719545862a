"""The guest's ATTACH exchange: where to, as whom; connect, send ATTACH, read the answer.

The host may refuse a connection before it reads a byte (too many connections
waiting to attach, of all peers or of this uid): it sends FAIL(reason) and
closes, so the ATTACH may meet a closed socket. The answer is read whatever
the send did, and a refusal for load is tried again, backing off, within
attach()'s own timeout (DESIGN.md, "Untrusted inputs"); any other refusal, or
load past the timeout, is a GpuvirtError that names the reason.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time

from gpuvirt.defaults import ATTACH_RETRY_FIRST_S, ATTACH_RETRY_MAX_S
from gpuvirt.errors import AuthRefusedError, GpuvirtError, HostBusyError, HostUnreachableError
from gpuvirt.paths import mailbox_socket
from gpuvirt.protocol.mailbox import FRAME_SIZE, Attach, FailReason, Frame, HostMsg
from gpuvirt.tokens import parse_token

REFUSALS = {
    FailReason.BAD_TOKEN: "the token is wrong for this VF",
    FailReason.BAD_VF: "no such VF on this host",
    FailReason.BAD_UID: "your uid is not allowed to use this VF",
    FailReason.VF_BUSY: "another guest holds this VF",
    FailReason.VF_DISABLED: "the VF is disabled or failed",
    FailReason.QUARANTINED: "the VF is quarantined after repeated resets; an admin must run "
    "`gpuvirt vf clear-guard N`",
    FailReason.BAD_ATTACH: "the host did not understand the ATTACH frame",
    FailReason.BAD_STATE: "the VF is not in a state that allows this now (being reset or "
    "re-initialized?); retry once it is ready",
    FailReason.TOO_MANY: "the host has too many connections waiting to attach (TOO_MANY)",
    FailReason.TOO_MANY_UID: "too many connections of your uid are waiting to attach "
    "(TOO_MANY_UID): this uid's other processes hold the host's pre-attach slots",
}
LOAD = (FailReason.TOO_MANY, FailReason.TOO_MANY_UID)  # refusals worth trying again


def reason_text(frame: Frame) -> str:
    try:
        reason = FailReason(frame.dw1)
    except ValueError:
        return f"refused (code 0x{frame.dw1:x})"
    return REFUSALS.get(reason, f"refused ({reason.name})")


def attach_socket(
    path: str | os.PathLike[str], vf: int, token: bytes, timeout: float
) -> socket.socket:
    """A connection whose ATTACH the host accepted (SUCCESS read), blocking again."""
    deadline = time.monotonic() + timeout
    delay, tries = ATTACH_RETRY_FIRST_S, 0
    while True:
        tries += 1
        sock, reply = _try(path, vf, token, deadline)
        if reply.msg == HostMsg.SUCCESS:
            sock.settimeout(None)
            return sock
        sock.close()
        why = reason_text(reply)
        if reply.dw1 not in LOAD:
            raise AuthRefusedError(f"attach to VF{vf} refused: {why}")
        left = deadline - time.monotonic()
        if left <= delay:
            raise HostBusyError(
                f"attach to VF{vf} refused: {why}; still refused after {tries} tries "
                f"in {timeout:g} s"
            )
        time.sleep(delay * random.uniform(0.5, 1.0))  # the backoff itself, jittered
        delay = min(2 * delay, ATTACH_RETRY_MAX_S)


def _try(
    path: str | os.PathLike[str], vf: int, token: bytes, deadline: float
) -> tuple[socket.socket, Frame]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(os.fspath(path))
    except OSError as e:
        sock.close()
        raise HostUnreachableError(
            f"cannot reach the gpuvirt host at {path}: {e.strerror}; is `gpuvirt host` running "
            "and is this the socket it printed?"
        ) from None
    # refused before it read a byte (EPIPE), its answer is still there to be read
    with contextlib.suppress(OSError):
        sock.sendall(Attach(vf=vf, token=token).encode())
    data = b""
    try:
        while len(data) < FRAME_SIZE:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            chunk = sock.recv(FRAME_SIZE - len(data))
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        sock.close()
        raise HostUnreachableError(f"host at {path} did not answer ATTACH in time") from None
    except OSError as e:
        data = b""
        why = e.strerror
    else:
        why = "closed without an answer"
    if len(data) < FRAME_SIZE:
        sock.close()
        raise HostUnreachableError(f"host at {path} answered no ATTACH: {why}")
    return sock, Frame.decode(data)


def attach_target(
    vf: int | None, path: str | os.PathLike[str] | None, token: str | bytes | None
) -> tuple[str | os.PathLike[str], int, bytes]:
    """Where to attach, to which VF, with which token: the arguments, else GPUVIRT_SOCKET,
    GPUVIRT_VF, and GPUVIRT_TOKEN or else GPUVIRT_TOKEN_FILE (a file holding the token, as
    a Kubernetes device plugin mounts it)."""
    path = path or os.environ.get("GPUVIRT_SOCKET") or mailbox_socket()
    if vf is None:
        env = os.environ.get("GPUVIRT_VF")
        if env is None:
            raise GpuvirtError("no VF given: pass vf= or set GPUVIRT_VF")
        try:
            vf = int(env)
        except ValueError:
            raise GpuvirtError(f"GPUVIRT_VF={env!r}: not a VF index") from None
    if token is None:
        token = os.environ.get("GPUVIRT_TOKEN") or _token_from_file()
    return path, vf, parse_token(token)


def _token_from_file() -> bytes:
    path = os.environ.get("GPUVIRT_TOKEN_FILE")
    if not path:
        raise GpuvirtError(
            "no token given: pass token=, or set GPUVIRT_TOKEN or GPUVIRT_TOKEN_FILE"
        )
    try:
        with open(path, "rb") as f:
            data = f.read(4096)
    except OSError as e:
        raise GpuvirtError(
            f"GPUVIRT_TOKEN_FILE={path!r}: cannot read it: {e.strerror or e}"
        ) from None
    try:
        return parse_token(data)
    except GpuvirtError as e:
        raise GpuvirtError(f"GPUVIRT_TOKEN_FILE={path!r}: {e}") from None
