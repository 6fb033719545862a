"""World-switch scheduler: time-slices the device between VFs.

Runs in its own thread with the monotonic clock, so mailbox or admin traffic
on the asyncio loop never delays a switch. The loop talks to it only through
`Scheduler` methods, which queue an op and ring the scheduler's wake eventfd;
results come back as concurrent futures.

A switch is IDLE(A) SAVE(A) LOAD(B) RUN(B) (device/base.py checks the order).
Between switches the thread sleeps in epoll on: its wake fd, every engine's
exit fd (an engine that dies is noticed at once), the running engine's idle
fd (it drained its queue: liquid/weighted yield at once) and, for the
work-conserving policies, the doorbells of the VFs not running (they have
work now). It never polls an engine for anything but its status words.

Policies (GIM's names):
  fairness     every enabled VF gets its slice, guest or not, work or not
  round_robin  VFs with a guest, full slices
  liquid       VFs with pending work; a VF with nothing pending yields at once
  weighted     liquid, picking the VF with the least device time per weight

A VF that overran its slice has the excess taken off its next slice, never
below half a slice.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from gpuvirt.device.base import Engine, WSCommand
from gpuvirt.device.status import Word
from gpuvirt.errors import DeviceError


class Policy(StrEnum):
    FAIRNESS = "fairness"
    ROUND_ROBIN = "round_robin"
    LIQUID = "liquid"
    WEIGHTED = "weighted"


WORK_CONSERVING = frozenset({Policy.LIQUID, Policy.WEIGHTED})
# weighted: a VF without work for less than this keeps the device time it is owed
REJOIN_NS = 100_000_000


@dataclass
class Entry:
    vf: int
    engine: Engine
    weight: float
    doorbell: int | None = None  # eventfd the guest rings per submitted command
    submitted: int = 0
    device_ns: int = 0
    vtime: float = 0.0
    debt_ns: int = 0
    run_start: int = 0
    slice_ns: int = 0
    # device time at ref_mono: maps a wall instant inside the last run to device time
    ref_mono: int = 0
    ref_dev: int = 0
    kernel_seq: int = 0
    kernel_base: int = 0
    faulted: bool = False
    switches_in: int = 0
    candidate: bool = False
    left_at: int = 0  # when it last stopped being a candidate (weighted)

    @property
    def has_guest(self) -> bool:
        return self.doorbell is not None

    def pending(self) -> int:
        return max(0, self.submitted - self.engine.status[Word.COMPLETED])

    def device_now(self, now: int, running: bool) -> int:
        return self.device_ns + (now - self.run_start if running else 0)


@dataclass
class SchedStats:
    started_ns: int = field(default_factory=time.monotonic_ns)
    lost_ns: int = 0  # device time spent inside world switches
    idle_ns: int = 0  # no VF on the device
    switches: int = 0
    latencies_ns: deque[int] = field(default_factory=lambda: deque(maxlen=100_000))
    # per world-switch command: durations in ns, for finding where a slow switch went
    commands_ns: dict[str, deque[int]] = field(
        default_factory=lambda: defaultdict(lambda: deque(maxlen=10_000))
    )


FaultHandler = Callable[[int, str, str], None]


class Scheduler:
    def __init__(
        self,
        policy: Policy,
        time_slice_ms: float,
        cmd_timeout_ms: float,
        job_timeout_s: float,
        on_fault: FaultHandler,
        cpus: set[int] | None = None,
    ) -> None:
        self.policy = Policy(policy)
        self.slice_ns = int(time_slice_ms * 1e6)
        self.cmd_timeout = cmd_timeout_ms / 1000
        self.job_timeout_ns = int(job_timeout_s * 1e9)
        self.on_fault = on_fault
        self.cpus = cpus
        self.entries: dict[int, Entry] = {}
        self.current: Entry | None = None
        self.exclusive: int | None = None
        self.stats = SchedStats()
        self._ops: deque[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = deque()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._sel = selectors.EpollSelector()
        self._sel.register(self._wake, selectors.EVENT_READ, ("wake", None))
        self._exclusive_waiters: list[tuple[int, Future[None]]] = []
        self._stopping = False
        self._repick = True
        self._idle_since: int | None = time.monotonic_ns()
        self.priority = "not started"
        self._thread = threading.Thread(target=self._main, name="gpuvirt-sched", daemon=True)

    # ---- called from other threads ---------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._call(self._op_stop).result(timeout=10)
        self._thread.join(timeout=10)

    def add(self, vf: int, engine: Engine, weight: float) -> Future[None]:
        return self._call(self._op_add, vf, engine, weight)

    def remove(self, vf: int) -> Future[None]:
        """Take a VF off the schedule; done once its engine is idle (or dead)."""
        return self._call(self._op_remove, vf)

    def set_guest(self, vf: int, doorbell: int | None) -> Future[None]:
        return self._call(self._op_set_guest, vf, doorbell)

    def set_exclusive(self, vf: int | None) -> Future[None]:
        """FULLACCESS: run only this VF; done once it runs alone. None ends it."""
        return self._call(self._op_set_exclusive, vf)

    def snapshot(self) -> dict[str, Any]:
        """Counters for status and metrics; reads ints only, safe from any thread."""
        now = time.monotonic_ns()
        cur = self.current
        vfs = {
            e.vf: {
                "device_ns": e.device_now(now, e is cur),
                "switches_in": e.switches_in,
                "running": e is cur,
                "weight": e.weight,
                "pending": e.pending() if e.has_guest else 0,
                "submitted": e.submitted,
                "received": e.engine.status[Word.RECEIVED],
                "completed": e.engine.status[Word.COMPLETED],
                "faulted": e.faulted,
                "has_guest": e.has_guest,
                "doorbell_fd": e.doorbell,
            }
            for e in list(self.entries.values())
        }
        return {
            "policy": str(self.policy),
            "elapsed_ns": now - self.stats.started_ns,
            "monotonic_ns": now,  # lines the scheduler's figures up with the engines' own
            "lost_ns": self.stats.lost_ns,
            "idle_ns": self.stats.idle_ns,
            "switches": self.stats.switches,
            "current": cur.vf if cur else None,
            "vfs": vfs,
            "watching": {
                str(k.fd): [k.data[0], k.data[1].vf if k.data[1] else None]
                for k in list(self._sel.get_map().values())
            },
        }

    def _call(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self._ops.append((fn, args, fut))
        os.eventfd_write(self._wake, 1)
        return fut

    # ---- the scheduler thread ----------------------------------------------------------

    def _main(self) -> None:
        self.priority = raise_priority()
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)  # this thread only: beside the engines
        slice_end = 0
        while not self._stopping:
            now = time.monotonic_ns()
            if self.current is not None:
                self._check_kernel(self.current, now)
            cur = self.current
            ends = (
                cur is None
                or now >= slice_end
                or self._should_yield(cur)
                or self._should_preempt(cur, now)
            )
            if self._repick or ends:
                # An op (a VF added, removed, given a guest) changes who may run, but does
                # not end the running VF's slice while it may still run.
                self._repick = False
                nxt = self._pick(keep=None if ends else cur)
                if nxt is not cur:
                    self._switch(nxt)
                elif cur is not None and ends:
                    t = time.monotonic_ns()
                    self._end_slice(cur, t)
                    self._begin_slice(cur, t)
                if self.current is not None:
                    slice_end = self.current.run_start + self.current.slice_ns
                self._resolve_exclusive()
            self._arm_idle_notify()
            timeout = None
            if self.current is not None:
                timeout = max(0.0, (slice_end - time.monotonic_ns()) / 1e9)
            for key, _ in self._sel.select(timeout):
                self._event(*key.data)
            self._run_ops()

    def _event(self, kind: str, entry: Entry | None) -> None:
        if kind == "wake":
            _drain(self._wake)
        elif kind == "idle":
            assert entry is not None
            _drain(entry.engine.idle_fd())
        elif kind == "doorbell":
            assert entry is not None and entry.doorbell is not None
            entry.submitted += _drain(entry.doorbell)
        elif kind == "exit" and entry is not None and not entry.faulted:
            self._fault(entry, "engine_died", f"engine pid {entry.engine.pid} exited")

    def _run_ops(self) -> None:
        while self._ops:
            fn, args, fut = self._ops.popleft()
            self._repick = True
            try:
                result = fn(*args)
            except Exception as e:  # a bug; hand it to the caller rather than kill the thread
                fut.set_exception(e)
            else:
                if result is not _DEFERRED:
                    fut.set_result(result)
                else:
                    self._exclusive_waiters.append((args[0], fut))

    def _candidates(self) -> list[Entry]:
        if self.exclusive is not None:
            e = self.entries.get(self.exclusive)
            return [e] if e is not None and not e.faulted else []
        live = [e for e in self.entries.values() if not e.faulted]
        if self.policy is Policy.FAIRNESS:
            return live
        with_guest = [e for e in live if e.has_guest]
        if self.policy is Policy.ROUND_ROBIN:
            return with_guest
        for e in with_guest:
            if e.doorbell is not None and e is not self.current:
                e.submitted += _drain(e.doorbell)
        return [e for e in with_guest if e.pending() > 0]

    def _pick(self, keep: Entry | None = None) -> Entry | None:
        cands = self._candidates()
        cur = self.current
        if not cands:
            # Work-conserving policies keep an idle VF on the device when nobody else wants
            # it: its next launch runs without waiting for a switch.
            if (
                self.policy in WORK_CONSERVING
                and cur is not None
                and not cur.faulted
                and cur.has_guest
                and self.exclusive is None
            ):
                return cur
            return None
        if self.policy is Policy.WEIGHTED:
            floor = min((e.vtime for e in cands if e.candidate), default=None)
            now = time.monotonic_ns()
            for e in self.entries.values():
                if e in cands and not e.candidate and floor is not None:
                    e.vtime = self._returning_vtime(e, floor, now)
                if e.candidate and e not in cands:
                    e.left_at = now
                e.candidate = e in cands
        if keep is not None and keep in cands:
            return keep
        if self.policy is Policy.WEIGHTED:
            return min(cands, key=lambda e: (e.vtime, e.vf))
        order = sorted(cands, key=lambda e: e.vf)
        if cur is None:
            return order[0]
        after = [e for e in order if e.vf > cur.vf]
        return after[0] if after else order[0]

    def _should_yield(self, cur: Entry) -> bool:
        if self.policy not in WORK_CONSERVING or self.exclusive is not None:
            return False
        if not cur.engine.status[Word.NOTIFY_IDLE]:
            return False
        return self._current_pending(cur) == 0

    def _returning_vtime(self, e: Entry, floor: float, now: int) -> float:
        """A VF back with work after a short gap (between two launches, even on a busy
        host) keeps all its lag; after a real idle period it banks no credit."""
        if now - e.left_at < REJOIN_NS:
            return e.vtime
        return max(e.vtime, floor)

    def _current_pending(self, cur: Entry) -> int:
        """The running VF's doorbell is not watched (it would wake us per launch); read it
        before judging it idle, or a launch already queued behind the drained one is
        missed and the VF yields with work waiting."""
        if cur.doorbell is not None:
            cur.submitted += _drain(cur.doorbell)
        return cur.pending()

    def _should_preempt(self, cur: Entry, now: int) -> bool:
        """weighted: a VF with work that is behind the running one by more than half a
        slice of its own takes the device now (CFS-style wakeup preemption). Otherwise a
        busy VF whose next launch lands just after a pick waits out a whole slice of a
        VF ahead of it, and loses share at every gap between its kernels."""
        if self.policy is not Policy.WEIGHTED or self.exclusive is not None:
            return False
        cur_v = cur.vtime + (now - cur.run_start) / cur.weight
        for e in self.entries.values():
            if e is cur or not e.has_guest or e.faulted or e.pending() == 0:
                continue
            v = e.vtime if e.candidate else self._returning_vtime(e, cur.vtime, now)
            if v + self.slice_ns / (2 * e.weight) < cur_v:
                return True
        return False

    def _arm_idle_notify(self) -> None:
        """Ask the running engine to signal when it drains, only while someone waits."""
        cur = self.current
        if cur is None or self.policy not in WORK_CONSERVING:
            return
        others = any(
            e is not cur and e.has_guest and not e.faulted and e.pending() > 0
            for e in self.entries.values()
        )
        cur.engine.status[Word.NOTIFY_IDLE] = 1 if others else 0
        if others and self._current_pending(cur) == 0:
            os.eventfd_write(self._wake, 1)  # drained before the flag was up

    def _cmd(self, e: Entry, cmd: WSCommand) -> None:
        took = e.engine.command(cmd, self.cmd_timeout)
        self.stats.commands_ns[cmd.name].append(int(took * 1e9))

    def _switch(self, nxt: Entry | None) -> None:
        """IDLE(cur) SAVE(cur) LOAD(nxt) RUN(nxt); bookkeeping only once nxt runs."""
        t0 = time.monotonic_ns()
        cur = self.current
        idle_error = run_error = None
        if cur is not None and (not cur.faulted or cur.engine.running):
            try:
                self._cmd(cur, WSCommand.IDLE_GPU)
                if cur.engine.cooperative:
                    t0 = time.monotonic_ns()
                self._cmd(cur, WSCommand.SAVE_GPU_STATE)
            except DeviceError as e:
                idle_error = e
        if nxt is not None:
            try:
                if nxt.engine.last == WSCommand.SAVE_GPU_STATE:
                    self._cmd(nxt, WSCommand.LOAD_GPU_STATE)
                self._cmd(nxt, WSCommand.RUN_GPU)
            except DeviceError as e:
                run_error = e
        t1 = time.monotonic_ns()

        if cur is not None:
            self.current = None
            self._unwatch_idle(cur)
            self._end_slice(cur, t0)
            if idle_error is not None:
                self._fault(cur, "idle_failed", str(idle_error))
            else:
                self._watch_doorbell(cur)
        elif self._idle_since is not None:
            self.stats.idle_ns += t0 - self._idle_since
        if nxt is None or run_error is not None:
            if nxt is not None:
                self._fault(nxt, "run_failed", str(run_error))
            self._idle_since = time.monotonic_ns()
            return
        self._idle_since = None
        if cur is not None:
            self.stats.latencies_ns.append(t1 - t0)
            self.stats.switches += 1
        self.stats.lost_ns += t1 - t0
        self.current = nxt
        nxt.switches_in += 1
        self._unwatch_doorbell(nxt)
        self._watch_idle(nxt)
        self._begin_slice(nxt, t1)

    def _begin_slice(self, e: Entry, now: int) -> None:
        e.run_start = now
        e.ref_mono, e.ref_dev = now, e.device_ns
        # GIM's overrun rule: the excess comes off this slice, never below half a slice.
        e.slice_ns = max(self.slice_ns - e.debt_ns, self.slice_ns // 2)
        e.debt_ns = 0

    def _end_slice(self, e: Entry, now: int) -> None:
        ran = max(0, now - e.run_start)
        e.device_ns += ran
        e.vtime += ran / e.weight
        e.debt_ns = max(0, ran - e.slice_ns)
        self._check_kernel(e, now, running=False)

    def _check_kernel(self, e: Entry, now: int, running: bool = True) -> None:
        """job_timeout counts a kernel's own device time, not wall time."""
        if e.faulted:
            return
        st = e.engine.status
        seq = st[Word.CURRENT_SEQ]
        if seq == 0:
            e.kernel_seq = 0
            return
        if seq != e.kernel_seq:
            e.kernel_seq = seq
            e.kernel_base = e.ref_dev + max(0, st[Word.CURRENT_START_NS] - e.ref_mono)
        own = (e.device_ns + (now - e.run_start if running else 0)) - e.kernel_base
        if own > self.job_timeout_ns:
            self._fault(
                e, "job_timeout",
                f"kernel {seq} ran {own / 1e9:.2f} s of its own device time "
                f"(job_timeout {self.job_timeout_ns / 1e9:g} s)",
            )  # fmt: skip

    def _fault(self, e: Entry, reason: str, detail: str) -> None:
        """Stop scheduling a VF that hung or died and ask the host to reset it."""
        e.faulted = True
        _unregister(self._sel, e.engine.exit_fd())  # level-triggered: would fire forever
        self._unwatch_doorbell(e)
        if e is self.current:
            self._unwatch_idle(e)
            if e.engine.running and e.engine.alive():
                with contextlib.suppress(DeviceError):
                    e.engine.command(WSCommand.IDLE_GPU, self.cmd_timeout)
            self.current = None
            self._idle_since = time.monotonic_ns()
        self.on_fault(e.vf, reason, detail)

    def _resolve_exclusive(self) -> None:
        cur = self.current
        if not self._exclusive_waiters or cur is None or cur.vf != self.exclusive:
            return
        for vf, fut in self._exclusive_waiters:
            if vf == cur.vf:
                fut.set_result(None)
        self._exclusive_waiters = [(v, f) for v, f in self._exclusive_waiters if v != cur.vf]

    # ---- fd registration ---------------------------------------------------------------

    def _watch_idle(self, e: Entry) -> None:
        if self.policy in WORK_CONSERVING:
            self._sel.register(e.engine.idle_fd(), selectors.EVENT_READ, ("idle", e))

    def _unwatch_idle(self, e: Entry) -> None:
        if self.policy in WORK_CONSERVING:
            _unregister(self._sel, e.engine.idle_fd())
            e.engine.status[Word.NOTIFY_IDLE] = 0

    def _watch_doorbell(self, e: Entry) -> None:
        if self.policy in WORK_CONSERVING and e.doorbell is not None and not e.faulted:
            self._sel.register(e.doorbell, selectors.EVENT_READ, ("doorbell", e))

    def _unwatch_doorbell(self, e: Entry) -> None:
        if e.doorbell is not None:
            _unregister(self._sel, e.doorbell)
            e.submitted += _drain(e.doorbell)

    # ---- ops (run on the scheduler thread) ---------------------------------------------

    def _op_add(self, vf: int, engine: Engine, weight: float) -> None:
        live = [e.vtime for e in self.entries.values()]
        e = Entry(vf, engine, weight, vtime=min(live, default=0.0))
        self.entries[vf] = e
        self._sel.register(engine.exit_fd(), selectors.EVENT_READ, ("exit", e))

    def _op_remove(self, vf: int) -> None:
        e = self.entries.pop(vf, None)
        if e is None:
            return
        if e is self.current:
            self._switch(None)
        elif e.engine.running and e.engine.alive():
            with contextlib.suppress(DeviceError):
                e.engine.command(WSCommand.IDLE_GPU, self.cmd_timeout)
        self._unwatch_doorbell(e)
        _unregister(self._sel, e.engine.exit_fd())
        if self.exclusive == vf:
            self.exclusive = None
        for v, fut in self._exclusive_waiters:
            if v == vf:
                fut.set_exception(DeviceError(f"VF{vf} left the schedule before it got the device"))
        self._exclusive_waiters = [(v, f) for v, f in self._exclusive_waiters if v != vf]

    def _op_set_guest(self, vf: int, doorbell: int | None) -> None:
        e = self.entries[vf]
        self._unwatch_doorbell(e)
        e.doorbell = doorbell
        e.submitted = e.engine.status[Word.COMPLETED]
        if e is not self.current:
            self._watch_doorbell(e)

    def _op_set_exclusive(self, vf: int | None) -> object:
        self.exclusive = vf
        if vf is None:
            return None
        return _DEFERRED

    def _op_stop(self) -> None:
        self._stopping = True
        if self.current is not None:
            self._switch(None)


_DEFERRED = object()
RT_PRIORITY = 10


def raise_priority(priority: int = RT_PRIORITY) -> str:
    """Put the calling thread ahead of the engines and guests it must preempt.

    Engines are CPU-bound; at normal priority the thread that must stop one can
    itself be preempted by the one it just continued and lose milliseconds. A
    SCHED_FIFO thread is never preempted by them. RESET_ON_FORK keeps the
    processes the host spawns (engines) at normal priority. Without the
    privilege, a lower nice value; without that, say so (latency will show it).
    """
    try:
        policy = os.SCHED_FIFO | os.SCHED_RESET_ON_FORK
        os.sched_setscheduler(0, policy, os.sched_param(priority))
        return f"SCHED_FIFO {priority}"
    except (PermissionError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
        return "nice -10"
    except (PermissionError, OSError):
        return "normal priority (no CAP_SYS_NICE): world-switch latency will suffer"


def _drain(fd: int) -> int:
    try:
        return os.eventfd_read(fd)
    except BlockingIOError:
        return 0


def _unregister(sel: selectors.BaseSelector, fd: int) -> None:
    with contextlib.suppress(KeyError, ValueError):
        sel.unregister(fd)
