"""World-switch scheduler thread: time-slices the device between VFs.

Runs in its own thread with the monotonic clock, so mailbox or admin traffic
on the asyncio loop never delays a switch. The loop talks to it only through
`Scheduler` methods, which queue an op and wake the thread (host/sched/ops.py);
results come back as concurrent futures. What to run and when a slice ends is
decided by host/sched/policy.py from numbers this thread reads for it.

A switch is IDLE(A) SAVE(A) LOAD(B) RUN(B) (device/base.py checks the order);
how A comes off the device is the backend's business (Engine.switch_out: on emu
its stop is posted and confirmed at the next wake-up; host/sched/switch.py).
The thread runs beside the device's CPU, not on it, where there is another.
Between switches the thread sleeps in epoll (host/sched/watch.py) on its wake fd,
every engine's exit fd, the running engine's idle fd and, for the
work-conserving policies, the doorbells of waiting VFs with no work yet and of
the running one while it is parked (host/sched/policy.py).

Guests and engines are untrusted (host/sched/entry.py bounds what they write):
a VF's doorbell wakes the thread at most once between two of its slices, its
engine's idle fd at most IDLE_WAKES_MAX times a slice. An exception on this
thread faults the VF it was handling, or with none to blame resets the device.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from gpuvirt.defaults import ESCALATE_EVERY_NS, IDLE_WAKES_MAX
from gpuvirt.device.base import Engine, SwitchLimits
from gpuvirt.errors import DeviceError
from gpuvirt.host.priority import raise_priority
from gpuvirt.host.sched.entry import Entry, SchedStats, disagreement, drain
from gpuvirt.host.sched.fullaccess import Exclusive
from gpuvirt.host.sched.ops import Ops
from gpuvirt.host.sched.policy import Policy, Rules
from gpuvirt.host.sched.switch import Switcher
from gpuvirt.host.sched.watch import Watches

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
        """cpus: where this thread runs (None: anywhere): beside the device's own CPUs
        (emu), so that its work is no VF's device time. coop_idle_timeout_ms: a
        cooperative engine's limit on IDLE (None: cmd_timeout)."""
        self.policy = Policy(policy)
        self.slice_ns = int(time_slice_ms * 1e6)
        self.rules = Rules(self.policy, self.slice_ns)
        cmd_s = cmd_timeout_ms / 1000
        coop_s = cmd_s if coop_idle_timeout_ms is None else coop_idle_timeout_ms / 1000
        self.job_timeout_ns = int(job_timeout_s * 1e9)
        self.on_fault = on_fault
        self.cpus = cpus
        self.entries: dict[int, Entry] = {}
        self.current: Entry | None = None
        self.exclusive = Exclusive()
        self.stats = SchedStats()
        self._ops = Ops()
        self._w = Watches(self.rules.work_conserving)
        self._w.add(self._ops.fd, "wake", None)
        self._sw = Switcher(SwitchLimits(cmd_s, coop_s), self.stats)
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
        """Take every VF off the device and end the thread; then its own descriptors
        close (ops.py), unless the thread is still running past the timeout."""
        if self._thread.is_alive():
            self._ops.call(self._op_stop).result(timeout=10)
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._ops.close()
            self._w.close()

    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def native_id(self) -> int | None:
        return self._thread.native_id

    def add(self, vf: int, engine: Engine, weight: float) -> Future[None]:
        return self._ops.call(self._op_add, vf, engine, weight)

    def remove(self, vf: int) -> Future[None]:
        """Take a VF off the schedule; done once its engine is idle (or dead)."""
        return self._ops.call(self._op_remove, vf)

    def set_weight(self, vf: int, weight: float) -> Future[None]:
        """`weighted`: the VF's share from its next slice on (a running slice keeps its own)."""
        return self._ops.call(self._op_set_weight, vf, weight)

    def set_guest(self, vf: int, doorbell: int | None) -> Future[None]:
        return self._ops.call(self._op_set_guest, vf, doorbell)

    def set_exclusive(self, vf: int | None) -> Future[None]:
        """FULLACCESS: run only this VF; done once it runs alone. None ends it."""
        return self._ops.post(lambda fut: self.exclusive.grant(vf, fut))

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

    # ---- the scheduler thread ----------------------------------------------------------

    def _main(self) -> None:
        self.priority = raise_priority()
        if self.cpus:
            # Beside the engines' CPU, not on it: this thread's work (two wake-ups a
            # switch once, now one) is then not device time, and a posted stop
            # (host/sched/switch.py) needs no wake-up of its own there.
            os.sched_setaffinity(0, self.cpus)
        while not self._stopping:
            try:
                self._step()
            except Exception as exc:  # any bug or bad fd: contained, never the thread's end
                with contextlib.suppress(Exception):  # only when the host's loop is gone
                    self._contain(exc)

    def _step(self) -> None:
        if self._sw:
            self._sw.settle_landed(self._idle_failed)
        now = time.monotonic_ns()
        cur = self.current
        if cur is not None:
            self._culprit = cur
            self._check_kernel(cur, now)
            # Its doorbell is not watched (it would wake us per launch): its pending count
            # is read afresh at every wake-up, or one read at its slice's start, with the
            # launches completed since, makes a VF with work read 0 at its slice's end,
            # leave the candidates and lose the device (docs/architecture.md).
            cur.read_pending()
        ends = (
            cur is None
            or cur.parked  # it holds no slice: whoever has work may take the device
            or now >= self._slice_end
            or self._yields(cur)
            or self.rules.should_preempt(cur, list(self.entries.values()), self.exclusive.vf, now)
        )
        if self._repick or ends:
            # An op (a VF added, removed, given a guest) changes who may run, but does
            # not end the running VF's slice while it may still run.
            self._repick = False
            nxt = self._pick(keep=None if ends else cur)
            if nxt is not cur:
                self._switch(nxt)
            elif cur is not None:
                self._keep(cur, ends)
            if self.current is not None:
                self._slice_end = self.current.run_start + self.current.slice_ns
                self.exclusive.running(self.current.vf)
        self._arm_idle_notify()
        self._culprit = None
        timeout = None
        if self.current is not None:
            # Parked, it is still looked at once a slice: a launch it never rang for runs
            # uncharged and unwatched by job_timeout until then.
            left = self._slice_end - time.monotonic_ns()
            timeout = self.slice_ns / 1e9 if self.current.parked else max(0.0, left / 1e9)
        ready = self._w.select(timeout)
        if ready:
            self.stats.wakeups += 1
        for kind, entry in ready:
            self._culprit = entry
            self._event(kind, entry)
        self._culprit = None
        if self._ops.run():
            self._repick = True

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
                    self._sw.out(other)
        if e is not None and not e.faulted:
            self._fault(e, "sched_error", detail)
            return
        now = time.monotonic_ns()
        if now - self._escalated_at >= ESCALATE_EVERY_NS:
            self._escalated_at = now
            self.on_fault(None, "sched_error", detail)

    def _event(self, kind: str, entry: Entry | None) -> None:
        if kind == "wake":
            self._ops.woken()
        elif kind == "idle":
            assert entry is not None
            drain(entry.engine.idle_fd())
            entry.idle_wakes += 1
            if entry.idle_wakes >= IDLE_WAKES_MAX:  # a storm: not heard again this slice
                self._w.unidle(entry)
        elif kind == "doorbell":
            assert entry is not None and entry.doorbell is not None
            if entry.read_pending() > 0:
                # It has work: more messages change nothing until it has run. (None: its
                # engine took them, or its guest closed the channel; neither wakes us again.)
                self._w.undoorbell(entry)
        elif kind == "exit" and entry is not None and not entry.faulted:
            self._fault(entry, "engine_died", f"engine pid {entry.engine.pid} exited")

    def _pick(self, keep: Entry | None) -> Entry | None:
        for e in self.entries.values():
            self._culprit = e
            e.read_pending()
        self._culprit = None
        nxt = self.rules.pick(
            self.entries, self.current, self.exclusive.vf, time.monotonic_ns(), keep
        )
        assert nxt is None or isinstance(nxt, Entry)
        return nxt

    def _keep(self, cur: Entry, ends: bool) -> None:
        """The running VF stays on the device. Drained (nobody else wants the device, or
        it would have gone), it parks: its slice is charged up to now and no other begins
        until its doorbell rings or its engine shows work, so the time it idles there is
        no share it used."""
        t = time.monotonic_ns()
        drained = self.rules.should_yield(cur, self.exclusive.vf) and cur.engine_idle()
        if cur.parked and not drained:  # its next launch (or FULLACCESS): a slice again
            cur.parked = False
            self._w.undoorbell(cur)
            self._begin_slice(cur, t)
        elif not cur.parked and ends:
            self._end_slice(cur, t)
            if drained:
                cur.parked = True
                self._w.unidle(cur)
                self._w.doorbell(cur)
            else:
                self._begin_slice(cur, t)

    def _yields(self, cur: Entry) -> bool:
        """Whether the running VF drained while others wait (its pending count was read,
        doorbell first, at this wake-up)."""
        if not self.rules.work_conserving or not cur.engine.notifies_idle:
            return False
        return self.rules.should_yield(cur, self.exclusive.vf)

    def _arm_idle_notify(self) -> None:
        """Ask the running engine to signal when it drains, only while someone waits."""
        cur = self.current
        if cur is None or not self.rules.work_conserving:
            return
        self._culprit = cur
        others = self.rules.others_waiting(cur, list(self.entries.values()), self.exclusive.vf)
        cur.engine.notify_idle(others)
        if others and cur.read_pending() == 0:
            self._ops.wake()  # drained before the flag was up

    def _idle_failed(self, e: Entry, detail: str) -> None:
        if not e.faulted:
            self._fault(e, "idle_failed", detail)

    def _switch(self, nxt: Entry | None) -> None:
        """IDLE(cur) SAVE(cur) LOAD(nxt) RUN(nxt); bookkeeping only once nxt runs."""
        t0 = time.monotonic_ns()  # until cur's stop says otherwise, when it left
        busy = None
        cur = self.current
        idle_error = run_error = None
        if cur is not None and (not cur.faulted or cur.engine.running):
            self._culprit = cur
            try:
                out = self._sw.out(cur, post=nxt is not None)
                t0, busy = out.until_ns, out.busy_ns
            except DeviceError as e:
                idle_error = e
        if nxt is not None:
            self._culprit = nxt
            try:
                self._sw.into(nxt)
            except DeviceError as e:
                run_error = e
        t1 = time.monotonic_ns()

        if cur is not None:
            self._culprit = cur
            self.current = None
            self._w.unidle(cur)
            if cur.parked:  # its slice was charged when it parked
                cur.parked = False
                self._w.undoorbell(cur)
            else:
                self._end_slice(cur, t0, busy)
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
        self._w.undoorbell(nxt)
        self._begin_slice(nxt, t1)

    def _begin_slice(self, e: Entry, now: int) -> None:
        e.ref_mono, e.ref_dev = now, e.device_ns
        e.busy_ref = e.engine.busy_ns()
        self.rules.begin_slice(e, now)
        e.idle_wakes = 0
        self._w.idle(e)

    def _end_slice(self, e: Entry, now: int, busy: int | None = None) -> None:
        """busy: the engine's device-time counter when it stopped (None: read it now)."""
        busy = e.engine.busy_ns() if busy is None else busy
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
        e.faulted, e.parked = True, False
        with contextlib.suppress(Exception):
            self._w.discard(e.engine.exit_fd())  # level-triggered: would fire forever
        self._w.undoorbell(e)
        if e is self.current:
            with contextlib.suppress(Exception):
                self._w.unidle(e)
            with contextlib.suppress(Exception):
                if e.engine.running and e.engine.alive():
                    self._sw.out(e)
            self.current = None
            self._idle_since = time.monotonic_ns()
        self.on_fault(e.vf, reason, detail)

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
                    self._sw.out(e)
            self._sw.settle(e)
        finally:  # whatever failed above, the VF leaves the schedule
            with self._w.lock:
                self.entries.pop(vf, None)
            if self.current is e:
                self.current = None
            self._w.undoorbell(e)
            self._w.discard(e.engine.exit_fd())
            self._w.discard(e.engine.idle_fd())
            self.exclusive.left(vf)

    def _op_set_weight(self, vf: int, weight: float) -> None:
        e = self.entries.get(vf)
        if e is None:
            return  # off the schedule: it comes back with the VF's plan weight
        if e is self.current and not e.parked:  # its slice keeps the weight it started at
            e.next_weight = weight
        else:  # a parked VF's slice was charged when it parked
            e.weight, e.next_weight = weight, None

    def _op_set_guest(self, vf: int, doorbell: int | None) -> None:
        e = self.entries.get(vf)
        if e is None:
            return  # reset while the guest was initializing: the VF left the schedule
        self._w.undoorbell(e)
        e.doorbell = doorbell
        e.has_guest = doorbell is not None
        if e is not self.current or e.parked:
            self._w.doorbell(e)

    def _op_stop(self) -> None:
        self._stopping = True
        if self.current is not None:
            self._switch(None)
        self._sw.settle_all()
