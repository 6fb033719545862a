"""The host end of the PF/VF mailbox: one Session per guest connection.

Guest input reaches the host only here, as the 48-byte ATTACH frame and then
16-byte frames, each decoded by protocol/mailbox.py and checked against the
VF's state before anything acts on it. Nothing a guest sends is unpickled or
executed. A bad ATTACH gets FAIL and a closed connection; an unknown id gets
FAIL with DW1 = the id and the connection stays up; a known id in the wrong
state gets FAIL(BAD_STATE, DW3 = the id). A closed connection is a fini.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import hmac
import itertools
import os
import secrets
import socket
import struct
from typing import TYPE_CHECKING

from gpuvirt.host.events import Category
from gpuvirt.host.vfmgr import VF, VFState
from gpuvirt.protocol.errors import ProtocolError
from gpuvirt.protocol.mailbox import (
    ATTACH_SIZE,
    FRAME_SIZE,
    Attach,
    FailReason,
    Frame,
    GuestMsg,
    HostMsg,
    classify_guest,
    fail,
    is_alive_reply,
    query_alive,
)

if TYPE_CHECKING:
    from gpuvirt.host.daemon import Host

S = VFState
ATTACH_TIMEOUT_S = 5.0
_nonces = itertools.count(1)


async def recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    """Exactly n bytes, or fewer if the peer closed first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


class Session:
    def __init__(self, host: Host, sock: socket.socket) -> None:
        self.host = host
        self.sock = sock
        self.vf: VF | None = None
        self.ready_to_reset = asyncio.Event()
        self.doorbell: int | None = None
        self.peer_pid, self.peer_uid, _gid = struct.unpack(
            "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        )
        self._alive_nonce = 0
        self._alive = asyncio.Event()
        self._closed = False
        self._tasks: list[asyncio.Task[None]] = []

    # ---- sending ---------------------------------------------------------------------

    def send(self, frame: Frame, fds: list[int] | None = None) -> bool:
        """Send one frame (with descriptors). A guest too slow to read is dropped."""
        if self._closed:
            return False
        anc = []
        if fds:
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        try:
            self.sock.sendmsg([frame.encode()], anc)
        except (BlockingIOError, OSError):
            self.close()
            return False
        return True

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    # ---- the connection --------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            if await self._attach(loop):
                await self._serve(loop)
        finally:
            self._closed = True
            for t in self._tasks:
                t.cancel()
            if self.vf is not None and self.vf.conn is self:
                await self.host.guest_gone(self.vf)
                self.vf.conn = None
                self.vf.guest_pid = self.vf.guest_uid = None
            self._close_doorbell()
            self.sock.close()

    async def _attach(self, loop: asyncio.AbstractEventLoop) -> bool:
        host = self.host
        try:
            data = await asyncio.wait_for(
                recv_exact(loop, self.sock, ATTACH_SIZE), ATTACH_TIMEOUT_S
            )
        except TimeoutError:
            data = b""
        try:
            att = Attach.decode(data)
        except ProtocolError as e:
            return self._refuse(FailReason.BAD_ATTACH, f"malformed ATTACH: {e}", None)
        if att.vf >= len(host.vfm):
            return self._refuse(FailReason.BAD_VF, f"VF{att.vf} does not exist", att.vf)
        vf = host.vfm[att.vf]
        if not hmac.compare_digest(att.token, vf.token):
            return self._refuse(FailReason.BAD_TOKEN, "wrong token", att.vf)
        uids = vf.plan.allowed_uids
        if uids is not None and self.peer_uid not in uids:
            return self._refuse(FailReason.BAD_UID, f"uid {self.peer_uid} not allowed", att.vf)
        if vf.state == S.QUARANTINED:
            return self._refuse(FailReason.QUARANTINED, "VF is quarantined", att.vf)
        if vf.state in (S.UNAVAIL, S.FAILED):
            return self._refuse(FailReason.VF_DISABLED, f"VF is {vf.state}", att.vf)
        if vf.conn is not None or vf.state != S.AVAIL:
            return self._refuse(FailReason.VF_BUSY, f"VF is taken ({vf.state})", att.vf)
        self.vf = vf
        vf.conn = self
        vf.guest_pid, vf.guest_uid = self.peer_pid, self.peer_uid
        vf.checksum_key = secrets.randbits(32)
        host.events.emit(
            Category.MAILBOX, "attach", f"guest pid {self.peer_pid} attached", vf.index,
            pid=self.peer_pid, uid=self.peer_uid,
        )  # fmt: skip
        self.send(Frame(HostMsg.SUCCESS, 0, vf.index))  # ATTACH accepted: DW2 = the VF
        self._tasks.append(asyncio.create_task(self._liveness()))
        return True

    def _refuse(self, reason: FailReason, why: str, vf: int | None) -> bool:
        self.host.events.emit(
            Category.MAILBOX, "attach.refused",
            f"ATTACH from pid {self.peer_pid} uid {self.peer_uid} refused: {why}", vf,
            reason=reason.name, pid=self.peer_pid, uid=self.peer_uid,
        )  # fmt: skip
        self.send(fail(reason))
        return False

    async def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._closed:
            data = await recv_exact(loop, self.sock, FRAME_SIZE)
            if len(data) < FRAME_SIZE:
                return  # closed, possibly mid-frame: either way a fini
            frame = Frame.decode(data)
            if is_alive_reply(frame):
                if frame.dw1 == self._alive_nonce:
                    self._alive.set()
                continue
            msg = classify_guest(frame)
            if msg is None:
                self.send(fail(frame.msg, unknown=True))
                continue
            await self._handle(msg, frame)

    async def _handle(self, msg: GuestMsg, frame: Frame) -> None:
        host, vf = self.host, self.vf
        assert vf is not None
        G = GuestMsg
        if msg == G.READY_TO_RESET:
            self.ready_to_reset.set()
        elif msg == G.LOG_VF_ERROR:
            host.events.emit(
                Category.MAILBOX, "vf_error", f"guest reports error 0x{frame.dw1:x}", vf.index,
                code=frame.dw1, data=[frame.dw2, frame.dw3],
            )  # fmt: skip
        elif msg == G.REQ_GPU_RESET_ACCESS:
            host.spawn(host.resetter.flr(vf, "guest_request"))
        elif msg == G.REQ_GPU_INIT_DATA and vf.state == S.AVAIL:
            host.write_pf2vf(vf)
            self.send(Frame(HostMsg.GPU_INIT_DATA_READY))
        elif msg == G.REQ_GPU_INIT_ACCESS and vf.state == S.AVAIL:
            await self._init_access(vf)
        elif msg == G.REL_GPU_INIT_ACCESS and vf.state == S.FULLACCESS:
            assert self.doorbell is not None
            await host.activate(vf, self.doorbell)
            self.send(Frame(HostMsg.SUCCESS, GuestMsg.REL_GPU_INIT_ACCESS))
        elif msg == G.REQ_GPU_FINI_ACCESS and vf.state == S.ACTIVE:
            await host.suspend(vf, "guest fini")
            self.send(Frame(HostMsg.READY_TO_ACCESS_GPU))
        elif msg == G.REL_GPU_FINI_ACCESS and vf.state == S.SUSPEND:
            await host.guest_gone(vf)
            vf.conn = None
            self.send(Frame(HostMsg.SUCCESS, GuestMsg.REL_GPU_FINI_ACCESS))
            self.close()
        else:
            self.send(Frame(HostMsg.FAIL, FailReason.BAD_STATE, 0, frame.msg))

    async def _init_access(self, vf: VF) -> None:
        host = self.host
        if vf.checksum_key == 0:
            vf.checksum_key = secrets.randbits(32) or 1
        cmd_guest, cmd_engine = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            if not await host.grant_fullaccess(vf):
                self.send(
                    Frame(HostMsg.FAIL, FailReason.BAD_STATE, 0, GuestMsg.REQ_GPU_INIT_ACCESS)
                )
                return
            assert vf.engine is not None
            vf.engine.attach_guest(cmd_engine.fileno())
            self._close_doorbell()
            self.doorbell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            fds = [*host.device.guest_fds(vf.index), cmd_guest.fileno(), self.doorbell]
            self.send(
                Frame(HostMsg.READY_TO_ACCESS_GPU, vf.fb >> 20, vf.checksum_key, len(fds)), fds
            )
        finally:
            cmd_guest.close()
            cmd_engine.close()

    async def _liveness(self) -> None:
        interval, timeout = self.host.liveness
        while not self._closed:
            await asyncio.sleep(interval)  # the probe's period, not a stand-in for an event
            self._alive_nonce = next(_nonces) & 0xFFFFFFFF or 1
            self._alive.clear()
            if not self.send(query_alive(self._alive_nonce)):
                return
            try:
                await asyncio.wait_for(self._alive.wait(), timeout)
            except TimeoutError:
                vf = self.vf
                self.host.events.emit(
                    Category.MAILBOX, "guest.gone",
                    f"guest pid {self.peer_pid} did not answer QUERY_ALIVE within {timeout:g} s",
                    vf.index if vf else None,
                )  # fmt: skip
                self.close()
                return

    def _close_doorbell(self) -> None:
        if self.doorbell is not None:
            os.close(self.doorbell)
            self.doorbell = None
