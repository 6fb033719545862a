"""Launches and their futures over the guest's command channel to its engine.

No background thread reads the channel: whoever waits for a result pumps
replies until its own arrives (under a lock, so one thread reads at a time).
That keeps a launch round trip to two socket hops and no thread hand-off. The
reader polls the channel briefly before it blocks (gpuvirt/poll.py): on a VM a
blocked reader's wake-up costs more than the launch itself.
The guest rings no doorbell: the host watches the engine's end of this channel
(host/sched/entry.py), so a message queued in it is how the scheduler learns
that this VF has work, at no cost to the launch.

When the VF is reset, the mailbox thread calls `fail_all`: every pending
future gets VFResetError and the channel is shut down, which also wakes a
thread blocked reading it. The host tells the guest of a reset before it kills
the engine, but it waits for READY_TO_RESET only ready_to_reset_wait (10 ms), so
on a loaded machine the engine's end can reach this channel before the mailbox
thread has read that notice: a queue of an attached guest (`told_by_mailbox`)
therefore takes the channel's end as "ask the mailbox" and waits for its verdict
(VFResetError for a reset, DetachedError when the host or the guest went)
instead of answering DetachedError itself.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import select
import socket
import struct
import sys
import sysconfig
import threading
import time
import types
from typing import Any

import cloudpickle

from gpuvirt.defaults import DEFAULT_POLL_US
from gpuvirt.errors import DetachedError, GpuvirtError, KernelError, VFResetError
from gpuvirt.poll import PollWindow
from gpuvirt.protocol.command import MAX_MESSAGE, Copy, Kind, Message, Status, pack

_kernel_ids = itertools.count(1)
# A blocked read re-checks its deadline this often. The wait is the kernel's own
# (SO_RCVTIMEO on a blocking socket), not Python's socket timeout: that one polls
# before every send and receive and flips O_NONBLOCK on every change, three
# syscalls more per launch than the plain send and receive the launch needs.
RECV_TICK_S = 0.1
_TIMEVAL = struct.Struct("@ll")
# Enum members through module globals: each lookup of one costs ~0.2 µs (a 2-vCPU VM),
# and the launch round trip is the figure DESIGN.md holds to the socket's.
_LAUNCH, _OK = Kind.LAUNCH, Status.OK


class Kernel:
    """A tenant function to run in the VF's engine: fn(xp, *args, **kwargs)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.kid = next(_kernel_ids)
        self.name = getattr(fn, "__qualname__", repr(fn))
        self._pickled: bytes | None = None

    def pickled(self) -> bytes:
        if self._pickled is None:
            # cloudpickle ships functions of importable modules by reference, but the
            # engine cannot import the tenant's own modules: ship those by value.
            mod = sys.modules.get(getattr(self.fn, "__module__", "") or "")
            by_value = mod is not None and _tenant_module(mod)
            if by_value:
                cloudpickle.register_pickle_by_value(mod)
            try:
                self._pickled = cloudpickle.dumps(self.fn)
            finally:
                if by_value:
                    cloudpickle.unregister_pickle_by_value(mod)
        return self._pickled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<gpuvirt.kernel {self.name}>"


def _tenant_module(mod: types.ModuleType) -> bool:
    """True for the tenant's own code: not gpuvirt, not installed, not the stdlib."""
    name = mod.__name__
    if name == "__main__" or name.split(".")[0] == "gpuvirt":
        return False
    path = getattr(mod, "__file__", None)
    if path is None:
        return False
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return not any(os.path.abspath(path).startswith(r) for r in roots)


def kernel(fn: Any) -> Kernel:
    """Mark a function as a kernel: `fn(xp, *args, **kwargs)`, xp being numpy or cupy."""
    return fn if isinstance(fn, Kernel) else Kernel(fn)


class LaunchFuture:
    """A launch's or copy's outcome: its result, or the error it raised.

    Not a concurrent.futures.Future, which a thread of its own settles while others
    wait on its condition variable: here no thread settles anything on its own, whoever
    waits reads the channel (CommandQueue.wait), so result() pumps replies until this
    one's is in. The condition variable was a third of the guest's part of a launch.
    One thread settles a future, the one that took it out of `pending`.
    """

    __slots__ = ("_done", "_exc", "_queue", "_result", "seq", "what")

    def __init__(self, queue: CommandQueue, seq: int, what: str) -> None:
        self._queue = queue
        self.seq = seq
        self.what = what
        self._done = False
        self._result: Any = None
        self._exc: BaseException | None = None

    def done(self) -> bool:
        return self._done

    def result(self, timeout: float | None = None) -> Any:
        if not self._done:
            self._queue.wait(self, timeout)
        if self._exc is not None:
            raise self._exc
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._done:
            self._queue.wait(self, timeout)
        return self._exc

    def _settle(self, result: Any, exc: BaseException | None) -> None:
        self._result, self._exc = result, exc
        self._done = True  # last: a thread that sees it done sees the outcome

    def __repr__(self) -> str:
        state = "pending" if not self._done else "failed" if self._exc else "done"
        return f"<LaunchFuture {self.what} seq={self.seq} {state}>"


class CommandQueue:
    def __init__(
        self,
        channel: socket.socket,
        poll_ns: int = DEFAULT_POLL_US * 1000,
        told_by_mailbox: bool = False,
    ) -> None:
        self.channel = channel
        # Set once fail_all has settled every pending future: with told_by_mailbox, the
        # mailbox thread's call (every end of an attached guest's VF passes through it).
        self._told_by_mailbox = told_by_mailbox
        self._failed = threading.Event()
        channel.setblocking(True)  # see RECV_TICK_S; the fd may come non-blocking
        self.pending: dict[int, LaunchFuture] = {}
        self.completed = 0
        self._defined: set[int] = set()
        self._seq = itertools.count(1)
        self._send_lock = threading.Lock()
        self._pump_lock = threading.Lock()
        self._broken: GpuvirtError | None = None
        self._rcvtimeo = 0.0  # SO_RCVTIMEO now; 0 = none (the socket's default)
        self._rxbuf = bytearray(MAX_MESSAGE)  # see device/engine_loop.py: no big alloc per recv
        self._rxview = memoryview(self._rxbuf)
        self._poll = PollWindow(poll_ns)
        # Whether a reply is in, for the poll: poll(0) costs a third of a receive that
        # finds nothing (that one raises BlockingIOError, caught per turn of the poll).
        self._readable = select.poll()
        self._readable.register(channel.fileno(), select.POLLIN)

    def launch(self, k: Kernel, args: tuple[Any, ...], kwargs: dict[str, Any]) -> LaunchFuture:
        payload = (
            pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
            if args or kwargs
            else b""
        )
        with self._send_lock:
            self._check()
            if k.kid not in self._defined:
                self._send(pack(Kind.DEFINE, kid=k.kid, payload=k.pickled()))
                self._defined.add(k.kid)
            return self._submit(_LAUNCH, k.kid, payload, k.name)

    def copy(self, kind: Kind, *copies: Copy) -> LaunchFuture:
        """COPY_IN or COPY_OUT of one or more ranges, done in order; one future for all."""
        payload = copies[0].encode() if len(copies) == 1 else Copy.encode_many(list(copies))
        return self.copy_packed(kind, payload)

    def copy_packed(self, kind: Kind, payload: bytes) -> LaunchFuture:
        """`copy` of descriptors already packed back to back (Copy.pack): the engine
        checks each, as it checks every message."""
        with self._send_lock:
            self._check()
            return self._submit(kind, 0, payload, kind.name)

    def _submit(self, kind: Kind, kid: int, payload: bytes, what: str) -> LaunchFuture:
        seq = next(self._seq)
        fut = LaunchFuture(self, seq, what)
        self.pending[seq] = fut
        try:
            self._send(pack(kind, seq, kid, 0, payload))
        except BaseException:
            self.pending.pop(seq, None)
            raise
        return fut

    def _send(self, data: bytes) -> None:
        try:
            self.channel.send(data)
        except OSError as e:
            if self._told_by_mailbox:
                self._failed.wait()  # as in _pump_one: the mailbox says why it is gone
            self._check()
            raise DetachedError(f"command channel to the engine is gone: {e}") from None

    def _check(self) -> None:
        if self._broken is not None:
            raise self._broken

    def wait(self, fut: LaunchFuture, timeout: float | None, poll: bool = True) -> None:
        """Pump replies until `fut` is done. poll=False blocks at once: for a wait known
        to outlast the poll window (a receiver that caught up with its staged copies),
        where polling would only spend the CPU the caller is measured by."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not fut.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"{fut.what} (launch {fut.seq}) not done after {timeout} s")
            if not self._pump_lock.acquire(timeout=-1 if left is None else left):
                continue
            try:
                if not fut.done():
                    self._pump_one(left, poll)
            finally:
                self._pump_lock.release()

    def _pump_one(self, timeout: float | None, poll: bool = True) -> None:
        try:
            n = self._recv(timeout) if poll else self._recv_blocking(timeout)
        except BlockingIOError:
            return  # the tick passed; wait() checks its deadline
        except OSError as e:
            n = 0
            if self._broken is None and not self._told_by_mailbox:
                self._broken = DetachedError(f"command channel to the engine failed: {e}")
        if not n:
            if self._told_by_mailbox:
                # The engine is gone; why (a reset, the host's end) is the mailbox's to say.
                # Its fail_all settles the futures; wait() keeps the caller's deadline.
                self._failed.wait(timeout)
                return
            self.fail_all(self._broken or DetachedError("the VF's engine closed the channel"))
            return
        self._take(n)

    def reap(self) -> None:
        """Take every reply that has already arrived, without waiting: for a caller that
        keeps many commands in flight and asks their futures' done() (guest/staging.py)."""
        if not self._pump_lock.acquire(blocking=False):
            return  # another thread is reading replies: they reach the futures through it
        try:
            while self.pending:
                try:
                    n = self._recv_now()
                except OSError:
                    return  # a broken channel: the next wait() finds it and fails everything
                if not n:
                    return  # None: nothing more yet; 0: closed, which wait() handles too
                self._take(n)
        finally:
            self._pump_lock.release()

    def _take(self, n: int) -> None:
        """The reply of n bytes in the receive buffer settles its future."""
        msg = Message.decode(self._rxview[:n])
        fut = self.pending.pop(msg.seq, None)
        if fut is None:
            return
        self.completed += 1
        if msg.flags == _OK:
            try:
                result = pickle.loads(msg.payload) if msg.payload else None
            except Exception as e:  # a class only the engine has, a reduce that raises
                why = f"{fut.what} returned a result this process cannot unpickle: {e!r}"
                fut._settle(None, KernelError(why))
                return
            fut._settle(result, None)
        elif msg.flags == Status.KERNEL_ERROR:
            text = msg.payload.decode()
            fut._settle(None, KernelError(f"{fut.what} raised in the engine:\n{text}"))
        else:
            text = msg.payload.decode()
            fut._settle(None, GpuvirtError(f"{fut.what} refused by the engine: {text}"))

    def _recv(self, timeout: float | None) -> int:
        """One message into the receive buffer: polled for first, then waited for."""
        return self._poll.wait(self._recv_now, lambda: self._recv_blocking(timeout))

    def _recv_blocking(self, timeout: float | None) -> int:
        # Most waits are long or unbounded and reuse the setting already there: no
        # syscall; only the last tick before a deadline is set to the time left.
        tick = 0.0 if timeout is None else max(min(timeout, RECV_TICK_S), 1e-3)
        if tick != self._rcvtimeo:
            sec = int(tick)
            self.channel.setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.pack(sec, int((tick - sec) * 1e6))
            )
            self._rcvtimeo = tick
        return self.channel.recv_into(self._rxbuf)

    def _recv_now(self) -> int | None:
        if not self._readable.poll(0):
            return None
        try:
            return self.channel.recv_into(self._rxbuf, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait until every launch so far has finished (errors stay on their futures)."""
        for fut in list(self.pending.values()):
            fut.exception(timeout)

    def fail_all(self, exc: GpuvirtError) -> None:
        """Fail every pending launch and close the channel (wakes a blocked reader)."""
        if self._broken is None or isinstance(exc, VFResetError):
            self._broken = exc
        for seq in list(self.pending):
            fut = self.pending.pop(seq, None)
            if fut is not None and not fut.done():
                fut._settle(None, exc)
        self._failed.set()
        with contextlib.suppress(OSError):
            self.channel.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.channel.close()
