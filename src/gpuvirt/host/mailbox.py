"""The host end of the PF/VF mailbox: the listening socket and one Session per guest.

Guest input reaches the host only here, as the 48-byte ATTACH frame and then
16-byte frames, each decoded by protocol/mailbox.py and checked against the
VF's state before anything acts on it. Nothing a guest sends is unpickled or
executed. A bad ATTACH gets FAIL and a closed connection; an unknown id gets
FAIL with DW1 = the id and the connection stays up; a known id in the wrong
state gets FAIL(BAD_STATE, DW3 = the id). A closed connection is a fini. Which
request each state answers is `MAILBOX` in host/vfmgr.py, beside the VF table.

Limits per peer (DESIGN.md, "Untrusted inputs"): how many connections may wait
to attach, in all and per uid, is host/admission.py's, as are the refusals'
events; here, each waits at most `attach_timeout` for its ATTACH; an attached
guest's frames are read at most `max_frames_per_s` (beyond that the host stops
reading, so the flood backs up in the peer's own socket); one guest-requested
FLR at a time per VF; LOG_VF_ERROR reaches the event log through a throttle.
Requests that may wait (on FULLACCESS, on a reset) run one at a time in a
worker per session while the reader goes on, so QUERY_ALIVE answers and
READY_TO_RESET are seen however long a request waits.
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
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol

from gpuvirt.defaults import GUEST_EVENT_BURST as EVENT_BURST
from gpuvirt.defaults import GUEST_EVENTS_PER_S as EVENTS_PER_S
from gpuvirt.defaults import MAILBOX_QUEUED_REQUESTS as QUEUED_REQUESTS
from gpuvirt.defaults import MAILBOX_READ_FRAMES
from gpuvirt.host.admission import Admission, Limits, peer_cred
from gpuvirt.host.events import Category, EventLog
from gpuvirt.host.ratelimit import EventThrottle, TokenBucket
from gpuvirt.host.vfmgr import ATTACH, VF, mailbox_refusal
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

_nonces = itertools.count(1)
READ_CHUNK = MAILBOX_READ_FRAMES * FRAME_SIZE


class MailboxHost(Protocol):
    """Everything the mailbox may touch on the host."""

    events: EventLog
    liveness: tuple[float, float]  # QUERY_ALIVE period and timeout, seconds

    def find_vf(self, index: int) -> VF | None: ...
    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]: ...
    async def reset_vf(self, vf: VF, reason: str) -> None: ...
    def write_pf2vf(self, vf: VF) -> None: ...
    async def grant_fullaccess(self, vf: VF) -> bool: ...
    def guest_fds(self, vf: VF) -> list[int]: ...
    async def activate(self, vf: VF, doorbell: int) -> None: ...
    async def suspend(self, vf: VF, reason: str) -> None: ...
    async def guest_gone(self, vf: VF) -> None: ...


class MailboxServer:
    """The mailbox socket: accepts connections within the limits and runs a Session each."""

    def __init__(
        self, host: MailboxHost, path: Path, limits: Limits, secure: Callable[[Path], None]
    ) -> None:
        """secure: gives the bound socket its group and mode (host/confinement.py)."""
        self.host = host
        self.path = path
        self.limits = limits
        self._secure = secure
        self.admission = Admission(limits, host.events)
        self._sock: socket.socket | None = None

    def listen(self) -> None:
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a stale socket of a host that is gone (the host checked)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(path))
        self._secure(path)
        srv.listen(128)
        srv.setblocking(False)
        self._sock = srv
        self.host.spawn(self._accept(srv))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _accept(self, srv: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(srv)
            conn.setblocking(False)
            peer = peer_cred(conn)
            refusal = self.admission.admit(peer[1])
            if refusal is None:
                self.host.spawn(Session(self, conn, peer).run())
            else:  # no slot: FAIL with the reason at once, and closed
                reason, why = refusal
                with contextlib.suppress(OSError):
                    conn.send(fail(reason).encode())
                conn.close()
                self.admission.refused(reason, why, None, peer)


async def recv_some(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    """Up to n bytes; b"" once the peer closed, however it closed (a reset included)."""
    try:
        return await loop.sock_recv(sock, n)
    except OSError:
        return b""


async def recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    """Exactly n bytes, or fewer if the peer closed first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = await recv_some(loop, sock, n - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


class Session:
    def __init__(self, server: MailboxServer, sock: socket.socket, peer: tuple[int, int]) -> None:
        self.server = server
        self.host = server.host
        self.sock = sock
        self.vf: VF | None = None
        self.ready_to_reset = asyncio.Event()
        self.doorbell: int | None = None
        self.peer_pid, self.peer_uid = peer
        self._alive_nonce = 0
        self._alive = asyncio.Event()
        self._closed = False
        self._tasks: list[asyncio.Task[None]] = []
        self._flr: asyncio.Task[Any] | None = None
        self._vf_errors = EventThrottle(EVENTS_PER_S, EVENT_BURST)
        self._throttled = EventThrottle(1.0, 1.0)

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
        except OSError as e:
            if isinstance(e, BlockingIOError) and self.vf is not None:  # once: closed now
                self.host.events.emit(
                    Category.MAILBOX, "guest.dropped",
                    f"guest pid {self.peer_pid} dropped: a reply could not be sent "
                    f"({e.strerror or e}; a guest must read what the host sends)",
                    self.vf.index,
                )  # fmt: skip
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
            try:
                attached = await self._attach(loop)
            finally:
                self.server.admission.done(self.peer_uid)
            if attached:
                await self._serve(loop)
        finally:
            self._closed = True
            for t in self._tasks:
                t.cancel()
            if self.vf is not None and self.vf.conn is self:
                await self.host.guest_gone(self.vf)
                self._detach(self.vf)
            self._close_doorbell()
            self.sock.close()

    async def _attach(self, loop: asyncio.AbstractEventLoop) -> bool:
        host = self.host
        try:
            data = await asyncio.wait_for(
                recv_exact(loop, self.sock, ATTACH_SIZE), self.server.limits.attach_timeout_s
            )
        except TimeoutError:
            return self._refuse(
                FailReason.BAD_ATTACH,
                f"no ATTACH within {self.server.limits.attach_timeout_s:g} s "
                "(host.attach_timeout_ms)", None,
            )  # fmt: skip
        try:
            att = Attach.decode(data)
        except ProtocolError as e:
            return self._refuse(FailReason.BAD_ATTACH, f"malformed ATTACH: {e}", None)
        vf = host.find_vf(att.vf)
        if vf is None:
            return self._refuse(FailReason.BAD_VF, f"VF{att.vf} does not exist", att.vf)
        if not hmac.compare_digest(att.token, vf.token):
            return self._refuse(FailReason.BAD_TOKEN, "wrong token", att.vf)
        uids = vf.plan.allowed_uids
        if uids is not None and self.peer_uid not in uids:
            return self._refuse(FailReason.BAD_UID, f"uid {self.peer_uid} not allowed", att.vf)
        if (refusal := mailbox_refusal(ATTACH, vf)) is not None:
            return self._refuse(refusal.reason, refusal.why, att.vf)
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

    @staticmethod
    def _detach(vf: VF) -> None:
        """The VF has no guest any more: neither this session nor its pid and uid."""
        vf.conn = None
        vf.guest_pid = vf.guest_uid = None

    def _refuse(self, reason: FailReason, why: str, vf: int | None) -> bool:
        self.server.admission.refused(reason, why, vf, (self.peer_pid, self.peer_uid))
        self.send(fail(reason))
        return False

    async def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        requests: asyncio.Queue[tuple[GuestMsg, Frame] | None] = asyncio.Queue(QUEUED_REQUESTS)
        worker = asyncio.create_task(self._work(requests))
        self._tasks.append(worker)  # cancelled with the session if the host stops
        bucket = TokenBucket(self.server.limits.max_frames_per_s)
        buf = bytearray()
        try:
            while not self._closed:
                if (wait := bucket.wait_s()) > 0:
                    self._note_throttled()
                    await asyncio.sleep(wait)  # the frame-rate limit itself
                room = int(bucket.available()) * FRAME_SIZE - len(buf)
                chunk = await recv_some(loop, self.sock, max(FRAME_SIZE, min(READ_CHUNK, room)))
                if not chunk:
                    return  # closed, possibly mid-frame: either way a fini
                buf += chunk
                whole = len(buf) - len(buf) % FRAME_SIZE
                bucket.spend(whole // FRAME_SIZE)
                for at in range(0, whole, FRAME_SIZE):
                    await self._frame(Frame.decode(bytes(buf[at : at + FRAME_SIZE])), requests)
                del buf[:whole]
        finally:
            while not requests.empty():
                requests.get_nowait()  # a closed connection's queued requests are void
            requests.put_nowait(None)
            await worker

    async def _frame(
        self, frame: Frame, requests: asyncio.Queue[tuple[GuestMsg, Frame] | None]
    ) -> None:
        """Answers that cannot wait are handled here; requests go to the worker in order."""
        if is_alive_reply(frame):
            if frame.dw1 == self._alive_nonce:
                self._alive.set()
            return
        msg = classify_guest(frame)
        vf = self.vf
        assert vf is not None
        if msg is None:
            self.send(fail(frame.msg, unknown=True))
        elif msg == GuestMsg.READY_TO_RESET:
            self.ready_to_reset.set()
        elif msg == GuestMsg.LOG_VF_ERROR:
            if (dropped := self._vf_errors.admit()) is not None:
                self.host.events.emit(
                    Category.MAILBOX, "vf_error", f"guest reports error 0x{frame.dw1:x}",
                    vf.index, code=frame.dw1, data=[frame.dw2, frame.dw3], suppressed=dropped,
                )  # fmt: skip
        elif msg == GuestMsg.REQ_GPU_RESET_ACCESS:
            if self._flr is None or self._flr.done():  # one pending FLR per VF; more join it
                self._flr = self.host.spawn(self.host.reset_vf(vf, "guest_request"))
        else:
            await requests.put((msg, frame))

    async def _work(self, requests: asyncio.Queue[tuple[GuestMsg, Frame] | None]) -> None:
        while (item := await requests.get()) is not None:
            if not self._closed:
                await self._handle(*item)

    def _note_throttled(self) -> None:
        if (dropped := self._throttled.admit()) is not None and self.vf is not None:
            self.host.events.emit(
                Category.MAILBOX, "throttled",
                f"guest pid {self.peer_pid} sends more than "
                f"{self.server.limits.max_frames_per_s} frames/s (host.max_frames_per_s); "
                "reading slowed", self.vf.index, suppressed=dropped,
            )  # fmt: skip

    async def _handle(self, msg: GuestMsg, frame: Frame) -> None:
        host, vf = self.host, self.vf
        assert vf is not None
        G = GuestMsg
        if (refusal := mailbox_refusal(msg, vf)) is not None:  # the state's rule (vfmgr)
            self.send(Frame(HostMsg.FAIL, refusal.reason, 0, frame.msg))
        elif msg == G.REQ_GPU_INIT_DATA:
            host.write_pf2vf(vf)
            self.send(Frame(HostMsg.GPU_INIT_DATA_READY))
        elif msg == G.REQ_GPU_INIT_ACCESS:
            await self._init_access(vf)
        elif msg == G.REL_GPU_INIT_ACCESS:
            assert self.doorbell is not None
            await host.activate(vf, self.doorbell)
            self.send(Frame(HostMsg.SUCCESS, GuestMsg.REL_GPU_INIT_ACCESS))
        elif msg == G.REQ_GPU_FINI_ACCESS:
            await host.suspend(vf, "guest fini")
            self.send(Frame(HostMsg.READY_TO_ACCESS_GPU))
        elif msg == G.REL_GPU_FINI_ACCESS:
            await host.guest_gone(vf)
            self._detach(vf)
            self.send(Frame(HostMsg.SUCCESS, GuestMsg.REL_GPU_FINI_ACCESS))
            self.close()

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
            # The VF's doorbell: the engine's end of the channel, which the scheduler
            # watches and never reads (host/sched/entry.py). The guest rings nothing.
            self.doorbell = os.dup(cmd_engine.fileno())
            fds = [*host.guest_fds(vf), cmd_guest.fileno()]
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
