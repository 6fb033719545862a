"""World-switch scheduler thread: time-slices the device between VFs.

Runs in its own thread with the monotonic clock, so mailbox or admin traffic
on the asyncio loop never delays a switch. The loop talks to it only through
`Scheduler` methods, which queue an op and ring the scheduler's wake eventfd;
results come back as concurrent futures. What to run and when a slice ends is
decided by host/policy.py from numbers this thread reads for it.

A switch is IDLE(A) SAVE(A) LOAD(B) RUN(B) (device/base.py checks the order);
on emu A's stop is posted and confirmed at the next wake-up (host/sched_post.py).
The thread runs beside the device's CPU, not on it, where there is another.
Between switches the thread sleeps in epoll (host/watch.py) on its wake fd,
every engine's exit fd, the running engine's idle fd and, for the
work-conserving policies, the doorbells of waiting VFs with no work yet.

Guests and engines are untrusted (host/sched_entry.py bounds what they write):
a VF's doorbell wakes the thread at most once between two of its slices, its
engine's idle fd at most IDLE_WAKES_MAX times a slice. An exception on this
thread faults the VF it was handling, or with none to blame resets the device.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from gpuvirt.defaults import ESCALATE_EVERY_NS, IDLE_WAKES_MAX
from gpuvirt.device.base import Engine, WSCommand, command_limit
from gpuvirt.device.status import Word
from gpuvirt.errors import DeviceError
from gpuvirt.host.policy import Policy, Rules
from gpuvirt.host.priority import raise_priority
from gpuvirt.host.sched_entry import Entry, SchedStats
from gpuvirt.host.sched_exclusive import FullAccess
from gpuvirt.host.sched_post import PostedStops
from gpuvirt.host.watch import Watches, drain

# (vf or None for the whole device, reason, detail); called on the scheduler thread
FaultHandler = Callable[[int | None, str, str], None]


class Scheduler:
    def __init__(
        self,
        policy: Policy,
        time_slice_ms: float,
        cmd_timeout_ms: float,
        job_timeout_s: float,
        on_fault: FaultHandler,
        cpus: set[int] | None = None,
        coop_idle_timeout_ms: float | None = None,
    ) -> None:
        """coop_idle_timeout_ms: a cooperative engine's limit on IDLE (None: cmd_timeout)."""
        self.policy = Policy(policy)
        self.slice_ns = int(time_slice_ms * 1e6)
        self.rules = Rules(self.policy, self.slice_ns)
        self.cmd_timeout = cmd_timeout_ms / 1000
        self.coop_idle_timeout = (
            self.cmd_timeout if coop_idle_timeout_ms is None else coop_idle_timeout_ms / 1000
        )
        self.job_timeout_ns = int(job_timeout_s * 1e9)
        self.on_fault = on_fault
        self.cpus = cpus
        self.entries: dict[int, Entry] = {}
        self.current: Entry | None = None
        self.full = FullAccess()
        self.stats = SchedStats()
        self._ops: deque[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = deque()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._w = Watches(self.rules.work_conserving)
        self._w.add(self._wake, "wake", None)
        self._posts = PostedStops(self.cmd_timeout, self.stats)
        self._stopping = False
        self._repick = True
        self._slice_end = 0
        self._culprit: Entry | None = None  # the VF being handled, blamed if this raises
        self._escalated_at = -ESCALATE_EVERY_NS
        self._idle_since: int | None = time.monotonic_ns()
        self.priority = "not started"
        self._thread = threading.Thread(target=self._main, name="gpuvirt-sched", daemon=True)

    # ---- called from other threads ---------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._call(self._op_stop).result(timeout=10)
        self._thread.join(timeout=10)

    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def native_id(self) -> int | None:
        return self._thread.native_id

    def add(self, vf: int, engine: Engine, weight: float) -> Future[None]:
        return self._call(self._op_add, vf, engine, weight)

    def remove(self, vf: int) -> Future[None]:
        """Take a VF off the schedule; done once its engine is idle (or dead)."""
        return self._call(self._op_remove, vf)

    def set_weight(self, vf: int, weight: float) -> Future[None]:
        """`weighted`: the VF's share from its next slice on (the running one keeps its own)."""
        return self._call(self._op_set_weight, vf, weight)

    def set_guest(self, vf: int, doorbell: int | None) -> Future[None]:
        return self._call(self._op_set_guest, vf, doorbell)

    def set_exclusive(self, vf: int | None) -> Future[None]:
        """FULLACCESS: run only this VF; done once it runs alone. None ends it."""
        return self._call(self._op_set_exclusive, vf)

    def snapshot(self) -> dict[str, Any]:
        """Counters for status and metrics, safe from any thread."""
        with self._w.lock:
            now = time.monotonic_ns()
            cur = self.current
            vfs = {e.vf: e.row(now, e is cur) for e in self.entries.values()}
            watching = self._w.describe()
        disagreement(vfs.values())
        return {
            "policy": str(self.policy), **self.stats.counters(now),
            "current": cur.vf if cur else None, "vfs": vfs, "watching": watching,
        }  # fmt: skip

    def _call(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self._ops.append((fn, args, fut))
        os.eventfd_write(self._wake, 1)
        return fut

    # ---- the scheduler thread ----------------------------------------------------------

    def _main(self) -> None:
        self.priority = raise_priority()
        if self.cpus:
            # Beside the engines' CPU, not on it: this thread's work (two wake-ups a
            # switch once, now one) is then not device time, and a posted stop
            # (host/sched_post.py) needs no wake-up of its own there.
            self._posts.one_cpu = len(self.cpus) == 1
            others = os.sched_getaffinity(0) - self.cpus
            os.sched_setaffinity(0, others or self.cpus)
        while not self._stopping:
            try:
                self._step()
            except Exception as exc:  # any bug or bad fd: contained, never the thread's end
                with contextlib.suppress(Exception):  # only when the host's loop is gone
                    self._contain(exc)

    def _step(self) -> None:
        if self._posts:
            self._posts.settle_landed(self._idle_failed)
        now = time.monotonic_ns()
        cur = self.current
        if cur is not None:
            self._culprit = cur
            self._check_kernel(cur, now)
            # Its doorbell is not watched (it would wake us per launch): read it before
            # its pending count is judged, or the launches completed since it was last
            # read make a VF with work read 0 at its slice's end, leave the candidates
            # and lose the device (docs/architecture.md, "A world switch").
            self._take_doorbell(cur)
            cur.read_pending()
        ends = (
            cur is None
            or now >= self._slice_end
            or self._yields(cur)
            or self.rules.should_preempt(cur, list(self.entries.values()), self.full.vf, now)
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
                self._slice_end = self.current.run_start + self.current.slice_ns
            if self.current is not None:
                self.full.running(self.current.vf)
        self._arm_idle_notify()
        self._culprit = None
        timeout = None
        if self.current is not None:
            timeout = max(0.0, (self._slice_end - time.monotonic_ns()) / 1e9)
        ready = self._w.select(timeout)
        if ready:
            self.stats.wakeups += 1
        for kind, entry in ready:
            self._culprit = entry
            self._event(kind, entry)
        self._culprit = None
        self._run_ops()

    def _contain(self, exc: Exception) -> None:
        """Blame the VF being handled (the host resets it) or, with none, the device."""
        self.stats.errors += 1
        e, self._culprit = self._culprit, None
        self._repick = True
        detail = f"{type(exc).__name__}: {exc}"
        # A switch cut short may have left an engine running that is not `current`.
        for other in list(self.entries.values()):
            if other is not self.current and other.engine.running and other.engine.alive():
                with contextlib.suppress(Exception):
                    self._cmd(other, WSCommand.IDLE_GPU)
                    self._cmd(other, WSCommand.SAVE_GPU_STATE)
        if e is not None and not e.faulted:
            self._fault(e, "sched_error", detail)
            return
        now = time.monotonic_ns()
        if now - self._escalated_at >= ESCALATE_EVERY_NS:
            self._escalated_at = now
            self.on_fault(None, "sched_error", detail)

    def _event(self, kind: str, entry: Entry | None) -> None:
        if kind == "wake":
            drain(self._wake)
        elif kind == "idle":
            assert entry is not None
            drain(entry.engine.idle_fd())
            entry.idle_wakes += 1
            if entry.idle_wakes >= IDLE_WAKES_MAX:  # a storm: not heard again this slice
                self._w.unidle(entry)
        elif kind == "doorbell":
            assert entry is not None and entry.doorbell is not None
            entry.submitted += drain(entry.doorbell)
            if entry.read_pending() > 0:
                # It has work: more rings change nothing until it has run.
                self._w.undoorbell(entry)
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
                    self.full.wait(args[0], fut)

    def _pick(self, keep: Entry | None) -> Entry | None:
        conserving = self.rules.work_conserving
        for e in self.entries.values():
            self._culprit = e
            # Only a VF with nothing queued needs its new rings counted to be picked.
            if e.read_pending() == 0 and conserving and e.has_guest and e is not self.current:
                self._take_doorbell(e)
                e.read_pending()
        self._culprit = None
        nxt = self.rules.pick(self.entries, self.current, self.full.vf, time.monotonic_ns(), keep)
        assert nxt is None or isinstance(nxt, Entry)
        return nxt

    def _yields(self, cur: Entry) -> bool:
        """Whether the running VF drained while others wait (its pending count was read,
        doorbell first, at this wake-up)."""
        if not self.rules.work_conserving or not cur.engine.status[Word.NOTIFY_IDLE]:
            return False
        return self.rules.should_yield(cur, self.full.vf)

    def _take_doorbell(self, e: Entry) -> None:
        if e.doorbell is not None:
            e.submitted += drain(e.doorbell)

    def _arm_idle_notify(self) -> None:
        """Ask the running engine to signal when it drains, only while someone waits."""
        cur = self.current
        if cur is None or not self.rules.work_conserving:
            return
        self._culprit = cur
        others = self.rules.others_waiting(cur, list(self.entries.values()), self.full.vf)
        cur.engine.status[Word.NOTIFY_IDLE] = 1 if others else 0
        if others:
            self._take_doorbell(cur)
            if cur.read_pending() == 0:
                os.eventfd_write(self._wake, 1)  # drained before the flag was up

    def _idle_failed(self, e: Entry, detail: str) -> None:
        if not e.faulted:
            self._fault(e, "idle_failed", detail)

    def _cmd(self, e: Entry, cmd: WSCommand) -> None:
        limit = command_limit(cmd, e.engine.cooperative, self.cmd_timeout, self.coop_idle_timeout)
        took = e.engine.command(cmd, limit)
        self.stats.commands_ns[cmd.name].append(int(took * 1e9))

    def _switch(self, nxt: Entry | None) -> None:
        """IDLE(cur) SAVE(cur) LOAD(nxt) RUN(nxt); bookkeeping only once nxt runs."""
        t0 = time.monotonic_ns()
        cur = self.current
        idle_error = run_error = None
        if cur is not None and (not cur.faulted or cur.engine.running):
            self._culprit = cur
            try:
                if nxt is not None and self._posts.may_post(cur):
                    self._posts.post(cur)
                else:
                    self._cmd(cur, WSCommand.IDLE_GPU)
                    if cur.engine.cooperative:
                        t0 = time.monotonic_ns()
                    self._cmd(cur, WSCommand.SAVE_GPU_STATE)
            except DeviceError as e:
                idle_error = e
        if nxt is not None:
            self._culprit = nxt
            try:
                if nxt.engine.last == WSCommand.SAVE_GPU_STATE:
                    self._cmd(nxt, WSCommand.LOAD_GPU_STATE)
                self._cmd(nxt, WSCommand.RUN_GPU)
            except DeviceError as e:
                run_error = e
        t1 = time.monotonic_ns()

        if cur is not None:
            self._culprit = cur
            self.current = None
            self._w.unidle(cur)
            self._end_slice(cur, t0)
            if idle_error is not None:
                self._fault(cur, "idle_failed", str(idle_error))
            else:
                self._w.doorbell(cur)
        elif self._idle_since is not None:
            self.stats.idle_ns += t0 - self._idle_since
        if nxt is None or run_error is not None:
            if nxt is not None:
                self._fault(nxt, "run_failed", str(run_error))
            self._idle_since = time.monotonic_ns()
            return
        self._culprit = nxt
        self._idle_since = None
        if cur is not None:
            self.stats.latencies_ns.append(t1 - t0)
            self.stats.switches += 1
        self.stats.lost_ns += t1 - t0
        self.current = nxt
        nxt.switches_in += 1
        self._unwatch_doorbell(nxt)
        self._begin_slice(nxt, t1)

    def _begin_slice(self, e: Entry, now: int) -> None:
        e.ref_mono, e.ref_dev = now, e.device_ns
        e.busy_ref = e.engine.busy_ns()
        self.rules.begin_slice(e, now)
        e.idle_wakes = 0
        self._w.idle(e)

    def _end_slice(self, e: Entry, now: int) -> None:
        busy = e.engine.busy_ns()
        ran = None if busy is None or e.busy_ref is None else busy - e.busy_ref
        self.rules.end_slice(e, now, ran)
        self._check_kernel(e, now, running=False)

    def _check_kernel(self, e: Entry, now: int, running: bool = True) -> None:
        if e.faulted:
            return
        overran = e.kernel_overrun(now, running, self.job_timeout_ns)
        if overran is not None:
            self._fault(e, "job_timeout", overran)

    def _fault(self, e: Entry, reason: str, detail: str) -> None:
        """Stop scheduling a VF that hung, died or broke this thread; ask for its reset.
        Each step is best effort: the fault may be in the very fd or engine it touches."""
        e.faulted = True
        with contextlib.suppress(Exception):
            self._w.discard(e.engine.exit_fd())  # level-triggered: would fire forever
        self._w.undoorbell(e)
        if e is self.current:
            with contextlib.suppress(Exception):
                self._w.unidle(e)
            with contextlib.suppress(Exception):
                if e.engine.running and e.engine.alive():
                    self._cmd(e, WSCommand.IDLE_GPU)
            self.current = None
            self._idle_since = time.monotonic_ns()
        self.on_fault(e.vf, reason, detail)

    def _unwatch_doorbell(self, e: Entry) -> None:
        self._w.undoorbell(e)
        self._take_doorbell(e)

    # ---- ops (run on the scheduler thread) ---------------------------------------------

    def _op_add(self, vf: int, engine: Engine, weight: float) -> None:
        live = [e.vtime for e in self.entries.values()]
        e = Entry(vf, weight, engine=engine, vtime=min(live, default=0.0))
        with self._w.lock:
            self.entries[vf] = e
        self._w.add(engine.exit_fd(), "exit", e)

    def _op_remove(self, vf: int) -> None:
        e = self.entries.get(vf)
        if e is None:
            return
        try:
            if e is self.current:
                self._switch(None)
            elif e.engine.running and e.engine.alive():
                with contextlib.suppress(DeviceError):
                    self._cmd(e, WSCommand.IDLE_GPU)
            self._posts.settle(e)
        finally:  # whatever failed above, the VF leaves the schedule
            with self._w.lock:
                self.entries.pop(vf, None)
            if self.current is e:
                self.current = None
            self._w.undoorbell(e)
            self._w.discard(e.engine.exit_fd())
            self._w.discard(e.engine.idle_fd())
            self.full.left(vf)

    def _op_set_weight(self, vf: int, weight: float) -> None:
        e = self.entries.get(vf)
        if e is None:
            return  # off the schedule: it comes back with the VF's plan weight
        if e is self.current:
            e.next_weight = weight
        else:
            e.weight = weight

    def _op_set_guest(self, vf: int, doorbell: int | None) -> None:
        e = self.entries.get(vf)
        if e is None:
            return  # reset while the guest was initializing: the VF left the schedule
        self._unwatch_doorbell(e)
        e.doorbell = doorbell
        e.has_guest = doorbell is not None
        e.submitted = e.engine.status[Word.COMPLETED]
        if e is not self.current:
            self._w.doorbell(e)

    def _op_set_exclusive(self, vf: int | None) -> object:
        self.full.vf = vf
        if vf is None:
            return None
        return _DEFERRED

    def _op_stop(self) -> None:
        self._stopping = True
        if self.current is not None:
            self._switch(None)
        self._posts.settle_all()


_DEFERRED = object()


def disagreement(rows: Iterable[dict[str, Any]]) -> None:
    """Each row's `disagree_pp`: its share of the device time charged minus its share of
    the wall-clock view, in percentage points; None for a VF whose engine has no clock of
    its own (emu: the device's time is the wall's, there is nothing to disagree)."""
    rows = list(rows)
    dev = sum(r["device_ns"] for r in rows) or 1
    wall = sum(r["wall_ns"] for r in rows) or 1
    for r in rows:
        gap = 100 * (r["device_ns"] / dev - r["wall_ns"] / wall)
        r["disagree_pp"] = round(gap, 3) if r["device_clock"] else None
