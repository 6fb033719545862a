"""The PF/VF mailbox: the ATTACH frame and the 16-byte message frames (pure, no I/O).

Theory of operation
-------------------
A guest connects to the host's Unix socket and sends one :class:`Attach`
(48 bytes). After that both sides exchange :class:`Frame` s: four little-endian
u32 words, DW0 the message id and DW1..DW3 data, like the hardware mailbox's
TRN/RCV_DW0..3 registers. Message ids are amdgpu's ``IDH_*`` numbers; the
guest→host and host→guest id spaces overlap, so a frame means nothing without
knowing its direction (:class:`GuestMsg` vs :class:`HostMsg`).

Decoding checks only the framing (length, word ranges). It deliberately does
not reject unknown message ids: the host must answer those with FAIL
(``fail(id, unknown=True)``) and keep the connection up, so it needs the id.

Liveness: the host's QUERY_ALIVE and the guest's REQ_GPU_INIT_DATA are both
id 6, and the guest "answers QUERY_ALIVE with the same id". To keep the two
apart, QUERY_ALIVE carries a nonzero nonce in DW1 and the answer is id 6 with
DW1 = that nonce and DW2 = :data:`ALIVE_MARK`; a real REQ_GPU_INIT_DATA has
DW2 = 0. A host reading guest frames therefore checks :func:`is_alive_reply`
before :func:`classify_guest`, which classifies alive replies as ``None``.

Everything that is refused raises :class:`ProtocolError` and nothing else.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from .errors import ProtocolError, as_view, check_uint

__all__ = [
    "ALIVE_MARK",
    "ATTACH_MAGIC",
    "ATTACH_SIZE",
    "FRAME_SIZE",
    "MAILBOX_VERSION",
    "MAX_VFS",
    "TOKEN_SIZE",
    "Attach",
    "FailReason",
    "Frame",
    "GuestMsg",
    "HostMsg",
    "alive_reply",
    "classify_guest",
    "classify_host",
    "fail",
    "is_alive_reply",
    "query_alive",
    "ready_to_access",
]

ATTACH_MAGIC = b"GVMB"
MAILBOX_VERSION = 1
ATTACH_SIZE = 48
FRAME_SIZE = 16
MAX_VFS = 31
TOKEN_SIZE = 32
ALIVE_MARK = 0x56494C41  # b"ALIV" read as a little-endian u32

_ATTACH = struct.Struct("<4sHH32sQ")
_FRAME = struct.Struct("<4I")
assert _ATTACH.size == ATTACH_SIZE and _FRAME.size == FRAME_SIZE


class GuestMsg(IntEnum):
    """Guest → host message ids (amdgpu's ``IDH_*`` request ids)."""

    REQ_GPU_INIT_ACCESS = 1
    REL_GPU_INIT_ACCESS = 2
    REQ_GPU_FINI_ACCESS = 3
    REL_GPU_FINI_ACCESS = 4
    REQ_GPU_RESET_ACCESS = 5
    REQ_GPU_INIT_DATA = 6
    LOG_VF_ERROR = 200
    READY_TO_RESET = 201


class HostMsg(IntEnum):
    """Host → guest message ids (amdgpu's ``IDH_*`` response ids)."""

    READY_TO_ACCESS_GPU = 1
    FLR_NOTIFICATION = 2
    FLR_NOTIFICATION_COMPLETION = 3
    SUCCESS = 4
    FAIL = 5
    QUERY_ALIVE = 6
    GPU_INIT_DATA_READY = 7


class FailReason(IntEnum):
    """DW1 of a FAIL frame whose DW2 is 0.

    Kept at 0x1000 and above so that a log reader can tell them from message
    ids at a glance; DW2 is what actually disambiguates (see :func:`fail`).
    """

    BAD_TOKEN = 0x1001
    BAD_VF = 0x1002
    BAD_UID = 0x1003
    VF_BUSY = 0x1004
    VF_DISABLED = 0x1005
    QUARANTINED = 0x1006
    BAD_STATE = 0x1007
    BAD_ATTACH = 0x1008
    TOO_MANY = 0x1009  # too many connections waiting to attach; try again later
    TOO_MANY_UID = 0x100A  # too many of this uid's connections waiting to attach


@dataclass(frozen=True)
class Attach:
    """The first thing a guest sends: which VF it wants and the token that proves it may.

    Layout (48 bytes, little-endian): magic ``b"GVMB"`` (4s), version u16,
    vf u16, token (32s), reserved u64 (must be 0).
    """

    vf: int
    token: bytes
    version: int = MAILBOX_VERSION

    def encode(self) -> bytes:
        # Encoding refuses exactly what decoding refuses, so whatever this
        # side sends, the other side's decoder accepts.
        _check_version(check_uint("ATTACH version", self.version, 16))
        _check_vf(check_uint("ATTACH vf", self.vf, 16))
        token = self.token
        if not isinstance(token, bytes | bytearray | memoryview):
            raise ProtocolError.bad(
                "ATTACH token", None, "expected 32 bytes", shown=f"<{type(token).__name__}>"
            )
        token = bytes(token)
        if len(token) != TOKEN_SIZE:
            # The token is a credential: say how long it is, never what it is.
            raise ProtocolError.bad(
                "ATTACH token",
                None,
                f"must be exactly {TOKEN_SIZE} bytes",
                shown=f"<{len(token)} bytes>",
            )
        return _ATTACH.pack(ATTACH_MAGIC, self.version, self.vf, token, 0)

    @classmethod
    def decode(cls, data: bytes) -> Attach:
        view = as_view(data, "ATTACH")
        if view.nbytes != ATTACH_SIZE:
            raise ProtocolError.bad(
                "ATTACH length", view.nbytes, f"must be exactly {ATTACH_SIZE} bytes"
            )
        magic, version, vf, token, reserved = _ATTACH.unpack(view)
        if magic != ATTACH_MAGIC:
            raise ProtocolError.bad("ATTACH magic", magic, f"expected {ATTACH_MAGIC!r}")
        _check_version(version)
        _check_vf(vf)
        if reserved != 0:
            raise ProtocolError.bad("ATTACH reserved", reserved, "must be 0")
        return cls(vf=vf, token=token, version=version)

    def __repr__(self) -> str:
        # The token is a credential: keep it out of logs and tracebacks. And a
        # repr must not raise, even for an Attach that encode() would refuse.
        token = self.token
        if isinstance(token, bytes | bytearray):
            shown = f"<{len(token)} bytes>"
        else:
            shown = f"<{type(token).__name__}>"
        return f"Attach(vf={self.vf!r}, token={shown}, version={self.version!r})"


def _check_version(version: int) -> None:
    if version != MAILBOX_VERSION:
        raise ProtocolError.bad(
            "ATTACH version", version, f"unsupported, this side speaks {MAILBOX_VERSION}"
        )


def _check_vf(vf: int) -> None:
    if vf >= MAX_VFS:
        raise ProtocolError.bad("ATTACH vf", vf, f"must be below {MAX_VFS}")


@dataclass(frozen=True)
class Frame:
    """One mailbox message: DW0 = message id, DW1..DW3 = data; four u32 words."""

    msg: int
    dw1: int = 0
    dw2: int = 0
    dw3: int = 0

    def encode(self) -> bytes:
        return _FRAME.pack(
            check_uint("frame msg (DW0)", self.msg, 32),
            check_uint("frame DW1", self.dw1, 32),
            check_uint("frame DW2", self.dw2, 32),
            check_uint("frame DW3", self.dw3, 32),
        )

    @classmethod
    def decode(cls, data: bytes) -> Frame:
        view = as_view(data, "frame")
        if view.nbytes != FRAME_SIZE:
            raise ProtocolError.bad(
                "frame length", view.nbytes, f"must be exactly {FRAME_SIZE} bytes"
            )
        return cls(*_FRAME.unpack(view))


def query_alive(nonce: int) -> Frame:
    """The host's liveness probe; *nonce* (nonzero u32) lets it match the answer."""
    if check_uint("QUERY_ALIVE nonce", nonce, 32) == 0:
        raise ProtocolError.bad(
            "QUERY_ALIVE nonce", nonce, "must be nonzero (0 cannot be told from no nonce)"
        )
    return Frame(HostMsg.QUERY_ALIVE, nonce)


def alive_reply(nonce: int) -> Frame:
    """The guest's answer to ``query_alive(nonce)``: id 6, DW1 = nonce, DW2 = ALIVE_MARK."""
    if check_uint("alive reply nonce", nonce, 32) == 0:
        raise ProtocolError.bad("alive reply nonce", nonce, "must be nonzero")
    return Frame(GuestMsg.REQ_GPU_INIT_DATA, nonce, ALIVE_MARK)


def is_alive_reply(frame: Frame, nonce: int | None = None) -> bool:
    """True if a guest *frame* answers QUERY_ALIVE (and, given *nonce*, that very query).

    Check this before :func:`classify_guest`: alive replies share id 6 with
    REQ_GPU_INIT_DATA.
    """
    # Any id-6 frame with the mark is an answer, even with a stale or zero
    # nonce: it must never be mistaken for REQ_GPU_INIT_DATA.
    if frame.msg != GuestMsg.REQ_GPU_INIT_DATA or frame.dw2 != ALIVE_MARK:
        return False
    return nonce is None or frame.dw1 == nonce


def classify_guest(frame: Frame) -> GuestMsg | None:
    """The guest message a frame carries, or None for an unknown id or an alive reply.

    None means "not a request": the caller answers an unknown id with
    ``fail(frame.msg, unknown=True)`` and should have tested
    :func:`is_alive_reply` first.
    """
    if is_alive_reply(frame):
        return None
    try:
        return GuestMsg(frame.msg)
    except ValueError:
        return None


def classify_host(frame: Frame) -> HostMsg | None:
    """The host message a frame carries (guest side), or None for an unknown id."""
    try:
        return HostMsg(frame.msg)
    except ValueError:
        return None


def ready_to_access(fb_mib: int, key: int, nfds: int) -> Frame:
    """READY_TO_ACCESS_GPU: DW1 = FB size in MiB, DW2 = checksum key, DW3 = fds attached."""
    return Frame(HostMsg.READY_TO_ACCESS_GPU, fb_mib, key, nfds)


def fail(reason_or_id: int, unknown: bool = False) -> Frame:
    """A FAIL frame: DW1 = a :class:`FailReason` (DW2 = 0) or an unknown message id (DW2 = 1).

    DW2 is what tells the two apart: a guest may send any u32 as an id,
    including one that collides with a reason code.
    """
    return Frame(HostMsg.FAIL, reason_or_id, 1 if unknown else 0)
