"""The engine's loop: serves one VF's guest on the FB, between world switches.

`EngineLoop` (emu, `--switch stop`) never knows whether it is scheduled: the
host stops and continues the whole process. `CoopEngineLoop` (cuda, `--switch
coop`) follows the host's commands between kernels and acknowledges them
(device/engine.py has both protocols).

Between messages the loop polls its guest channel for a while before it
sleeps (gpuvirt/poll.py; the host sets the limit in POLL_NS), but only while no
other VF waits for the device: then it sleeps at once, and the host switches.

Work arrives from the guest on the command channel (see protocol/command.py)
and from the host on the control socket: a new guest's channel (with the fd
attached), or exit. Kernels are the tenant's own code and run only here.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import socket
import time
import traceback
from typing import Any, Protocol

import cloudpickle

from gpuvirt.device.base import WSCommand
from gpuvirt.device.ctl import CTL_ACK, CTL_EXIT, CTL_GUEST, CTL_WAKE, recv_fd
from gpuvirt.device.status import StatusArea, Word
from gpuvirt.poll import PollWindow
from gpuvirt.protocol.command import MAX_MESSAGE, BufDesc, Copy, Kind, Message, Status, pack
from gpuvirt.protocol.errors import ProtocolError

MAX_RESULT = MAX_MESSAGE - 1024  # a DONE message must fit one datagram

# The per-launch path reads status words by plain int and names enum members through
# module globals: an enum member's lookup costs ~0.2 µs (a 2-vCPU VM), and a launch
# made a dozen of them.
_RECEIVED, _COMPLETED, _SEQ, _START, _TAKING = (
    int(w)
    for w in (Word.RECEIVED, Word.COMPLETED, Word.CURRENT_SEQ, Word.CURRENT_START_NS, Word.TAKING)
)
_NOTIFY_IDLE, _POLL_NS = int(Word.NOTIFY_IDLE), int(Word.POLL_NS)
_LAUNCH, _DONE, _OK = Kind.LAUNCH, Kind.DONE, Status.OK


class Executor(Protocol):
    """What differs between backends inside an engine: memory views and copies."""

    xp: Any

    def view(self, desc: BufDesc) -> Any: ...

    def copy_in(self, copy: Copy) -> None: ...

    def copy_out(self, copy: Copy) -> None: ...

    def synchronize(self) -> None: ...


class EngineLoop:
    def __init__(
        self, executor: Executor, status: StatusArea, ctl: socket.socket, idle_fd: int
    ) -> None:
        self.executor = executor
        self.status = status
        self._words = status.words
        self.ctl = ctl
        self.idle_fd = idle_fd
        self.guest: socket.socket | None = None
        self.kernels: dict[int, Any] = {}
        # recv(n) allocates n bytes per call; one preallocated buffer avoids a big
        # malloc/free (an mmap/munmap pair at this size) on every launch.
        self._rxbuf = bytearray(MAX_MESSAGE)
        self._rxview = memoryview(self._rxbuf)
        # A bare epoll, not selectors: its select() builds keys and lists per call, a few
        # µs on every launch of the round trip this loop is the far end of.
        self._ep = select.epoll()
        self._ep.register(ctl.fileno(), select.EPOLLIN)
        self._poll = PollWindow(0)
        # Device arrays in a kernel's result must travel as host arrays: the guest has no
        # device library to unpickle them with. Executors without device memory have none.
        self._to_host = getattr(executor, "to_host", None)
        # The device's own measure of how long each launch and copy kept it (cuda's
        # BusyClock, published in BUSY_NS); None where the device's time is the host's
        # wall clock (emu).
        self._busy = getattr(executor, "busy", None)

    def serve(self) -> None:
        ctl = self.ctl.fileno()
        while True:
            for fd, _ in self._wait():
                if fd == ctl:
                    if not self._control():
                        return
                elif self.guest is not None:
                    self._guest_message()

    def _wait(self) -> list[tuple[int, int]]:
        """The descriptors ready now: polled for while this VF has the device to itself."""
        words = self._words
        if words[_POLL_NS] != self._poll.limit_ns:
            self._poll.set_limit(words[_POLL_NS])
        if self.guest is None or words[_NOTIFY_IDLE]:
            return self._ep.poll()
        return self._poll.wait(self._ready_now, self._ep.poll)

    def _ready_now(self) -> list[tuple[int, int]] | None:
        return self._ep.poll(0) or None

    def _ready_fds(self) -> set[int]:
        return {fd for fd, _ in self._ep.poll()}

    def _watch(self, sock: socket.socket) -> None:
        self._ep.register(sock.fileno(), select.EPOLLIN)

    def _unwatch(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            self._ep.unregister(sock.fileno())

    def _control(self) -> bool:
        msg, fd = recv_fd(self.ctl)
        if not msg or msg == CTL_EXIT:
            return False
        if msg == CTL_GUEST and fd is not None:
            self._drop_guest()
            self.guest = socket.socket(fileno=fd)
            if self._watching_guest():
                self._watch(self.guest)
            self.status.bump(Word.GUEST_EPOCH)
        else:
            self._on_control(msg)
        return True

    def _watching_guest(self) -> bool:
        """Whether guest messages are read now (always, for an engine stopped by signals)."""
        return True

    def _on_control(self, msg: bytes) -> None:
        """Control messages beyond guest and exit (the cooperative world switch)."""

    def _drop_guest(self) -> None:
        if self.guest is not None:
            self._unwatch(self.guest)
            self.guest.close()
            self.guest = None
        self.kernels.clear()

    def _guest_message(self) -> None:
        words = self._words
        words[_TAKING] = 1  # until done with it: once read, the channel no longer shows it
        try:
            self._take_message()
        finally:
            words[_TAKING] = 0

    def _take_message(self) -> None:
        assert self.guest is not None
        try:
            n = self.guest.recv_into(self._rxbuf)
        except OSError:
            n = 0
        if not n:
            self._drop_guest()
            return
        try:
            msg = Message.decode(self._rxview[:n])
        except ProtocolError as e:
            self._reply(0, Status.BAD_REQUEST, str(e).encode())
            return
        if msg.kind is _LAUNCH:
            self._launch(msg)
        elif msg.kind == Kind.DEFINE:
            try:
                self.kernels[msg.kid] = cloudpickle.loads(msg.payload)
            except Exception:
                self.kernels[msg.kid] = _LoadFailure(traceback.format_exc())
        elif msg.kind in (Kind.COPY_IN, Kind.COPY_OUT):
            self._copy(msg)
        else:
            self._reply(msg.seq, Status.BAD_REQUEST, f"unexpected {msg.kind.name}".encode())

    def _launch(self, msg: Message) -> None:
        words = self._words
        words[_RECEIVED] += 1
        fn = self.kernels.get(msg.kid)
        status, payload = _OK, b""
        lost: str | None = None
        if fn is None:
            status, payload = Status.BAD_REQUEST, f"kernel {msg.kid} was never defined".encode()
        elif isinstance(fn, _LoadFailure):
            status, payload = Status.KERNEL_ERROR, fn.text.encode()
        else:
            words[_START] = time.monotonic_ns()
            words[_SEQ] = msg.seq
            try:
                self._busy_start()
                result = self._call(fn, msg.payload)
                self.executor.synchronize()
                if self._to_host is not None and result is not None:
                    result = self._to_host(result)  # its copies are the launch's work too
                self._busy_stop(drain=False)
                if result is not None:
                    payload = pickle.dumps(result)
                if len(payload) > MAX_RESULT:
                    status = Status.KERNEL_ERROR
                    payload = (
                        f"the kernel returned {len(payload)} bytes; at most {MAX_RESULT} travel "
                        "back as a result: write large results into a buffer"
                    ).encode()
            except Exception:
                status, payload = Status.KERNEL_ERROR, traceback.format_exc().encode()
                self.status.bump(Word.FAILED)
                self._busy_stop(drain=True)
                lost = self._context_lost()
                if lost is not None:
                    payload += f"\n{lost}\n".encode()
            words[_SEQ] = 0
        self._reply(msg.seq, status, payload, completes=True)
        if lost is not None:
            raise ContextLost(lost)

    def _call(self, fn: Any, payload: bytes) -> Any:
        """fn(xp, *args, **kwargs), buffers as device views; an empty payload: no arguments."""
        xp = self.executor.xp
        if not payload:
            return fn(xp)
        args, kwargs = pickle.loads(payload)
        return fn(
            xp, *self._views(args), **dict(zip(kwargs, self._views(kwargs.values()), strict=True))
        )

    def _context_lost(self) -> str | None:
        """After a failed launch: why the device context can run nothing more (a fault
        such as an illegal address poisons a CUDA context for good), or None."""
        check = getattr(self.executor, "context_lost", None)
        why = check() if check is not None else None
        if why is None:
            return None
        return f"the VF's device context is lost ({why}); the host resets the VF"

    def _busy_start(self) -> None:
        if self._busy is not None:
            self.status.bump(Word.BUSY_NS, self._busy.start())  # the launch before this one

    def _busy_stop(self, drain: bool) -> None:
        """End the device's measure of a launch or copy, after its synchronize. A failed
        one is drained here: what it left running on the device is its time too, and a
        tenant must not hide device time by raising once its work is queued."""
        if self._busy is None:
            return
        if not drain:
            self._busy.stop()
            return
        with contextlib.suppress(Exception):  # a broken context fails the next launch
            self.executor.synchronize()
            self._busy.stop()

    def _views(self, values: Any) -> list[Any]:
        return [self.executor.view(v) if isinstance(v, BufDesc) else v for v in values]

    def _copy(self, msg: Message) -> None:
        self.status.bump(Word.RECEIVED)
        try:
            copies = Copy.decode_many(msg.payload)  # one or more, one synchronize for all
            self._busy_start()
            for copy in copies:
                if msg.kind == Kind.COPY_IN:
                    self.executor.copy_in(copy)
                else:
                    self.executor.copy_out(copy)
            self.executor.synchronize()
            self._busy_stop(drain=False)
            status, payload = Status.OK, b""
        except Exception as e:
            status, payload = Status.BAD_REQUEST, str(e).encode()
            self._busy_stop(drain=True)
        self._reply(msg.seq, status, payload, completes=True)

    def _reply(self, seq: int, status: Status, payload: bytes, completes: bool = False) -> None:
        try:
            if self.guest is None:
                return
            try:
                self.guest.send(pack(_DONE, seq, 0, status, payload[:MAX_RESULT]))
            except OSError:
                self._drop_guest()
                return
        finally:
            # COMPLETED is published after the reply is on its way (a guest may act on the
            # count), and before the idle signal, so the scheduler woken by it sees the count.
            if completes:
                self._words[_COMPLETED] += 1
        if self._words[_NOTIFY_IDLE] and not self._more_queued():
            os.eventfd_write(self.idle_fd, 1)

    def _more_queued(self) -> bool:
        return self.guest is not None and bool(select_readable(self.guest))


class CoopEngineLoop(EngineLoop):
    """An engine that world-switches by agreement, at kernel boundaries.

    Guest messages are read only while the host has it running; while idled its
    guest socket is not even watched, so queued launches wait in the socket.
    Control messages are always read, and before guest work, so an IDLE that
    arrives together with a launch wins.
    """

    def __init__(
        self, executor: Executor, status: StatusArea, ctl: socket.socket, idle_fd: int
    ) -> None:
        super().__init__(executor, status, ctl, idle_fd)
        self.running = False

    def serve(self) -> None:
        ctl = self.ctl.fileno()
        while True:
            if ctl in self._ready_fds():
                if not self._control():
                    return
                continue  # the command may have idled us or replaced the guest: look again
            if self.running and self.guest is not None:
                self._guest_message()

    def _ready_fds(self) -> set[int]:
        # While running, poll before sleeping as the emu loop does (gpuvirt/poll.py): a
        # blocking wait costs a context switch and a wake-up per launch (measured on an
        # H200: 1.0 switch per launch). Idled, nothing of the guest's can arrive: sleep.
        return {fd for fd, _ in (self._wait() if self.running else self._ep.poll())}

    def _watching_guest(self) -> bool:
        return self.running

    def _on_control(self, msg: bytes) -> None:
        if msg == CTL_WAKE:
            self.follow()

    def follow(self) -> None:
        """Carry out the host's latest command and acknowledge it.

        Only the latest command counts: if the host issued several before we looked,
        the earlier ones are superseded, and acknowledging the latest serial covers them.
        """
        st = self.status
        serial = st[Word.CMD_SERIAL]
        if serial <= st[Word.ACK_SERIAL]:
            return  # a wake for a command already acknowledged
        code = st[Word.CMD_CODE]
        if code == WSCommand.IDLE_GPU:
            # Launches synchronize already; this drains anything else queued (copies).
            self.executor.synchronize()
            if self._busy is not None:  # the slice's device time is all in BUSY_NS now
                st.bump(Word.BUSY_NS, self._busy.take())
            self._set_running(False)
        elif code == WSCommand.RUN_GPU:
            self._set_running(True)
        st[Word.ACK_SERIAL] = serial
        # Full only if the host left acks unread; ACK_SERIAL is the record it checks.
        with contextlib.suppress(BlockingIOError):
            self.ctl.send(CTL_ACK, socket.MSG_DONTWAIT)

    def _set_running(self, running: bool) -> None:
        if running == self.running:
            return
        self.running = running
        if self.guest is None:
            return
        if running:
            self._watch(self.guest)
        else:
            self._unwatch(self.guest)

    def _drop_guest(self) -> None:
        if self.guest is not None and not self.running:
            # Not watched while idle; the base class would unregister it.
            self.guest.close()
            self.guest = None
            self.kernels.clear()
            return
        super()._drop_guest()


class ContextLost(Exception):
    """The engine's device context cannot run anything more: the engine exits (saying
    why on its control socket) and the host resets the VF as for any engine that dies.
    Its neighbours' contexts are their own and go on."""


def select_readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


class _LoadFailure:
    def __init__(self, text: str) -> None:
        self.text = text
