"""The world switch's commands, timed, and the stops posted and not yet confirmed.

A switch is IDLE(A) SAVE(A) LOAD(B) RUN(B). How a VF comes off the device is the
backend's business, behind one device-interface method (Engine.switch_out): a
preemptive engine (emu) is stopped where it stands, a cooperative one (cuda)
at its next kernel boundary, which is the outgoing VF's own time. The
scheduler learns only when the VF stopped holding the device, what its device
counted, and whether the stop is still to be confirmed.

Posted stops: waited for, A's stop costs the scheduler thread a second wake-up
per switch and leaves the device idle between A's stop and B's continue.
Posted, the thread sends A's stop and B's continue back to back and confirms
the stop at its next wake-up. That keeps the world switch's promise, that B
executes nothing until A has executed its last instruction, only on a backend
whose engines cannot run past a pending stop (emu: every engine runs on the
device's one CPU and cannot leave it; the stop is taken at once, raised above
every engine; device/emu.py). Such an engine says so (Engine.can_post); any
other is waited for. Any later command to A (its next RUN, an FLR, a removal)
first waits for the stop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from gpuvirt.device.base import SwitchedOut, SwitchLimits
from gpuvirt.errors import DeviceError
from gpuvirt.host.sched.entry import Entry, SchedStats


class Switcher:
    def __init__(self, limits: SwitchLimits, stats: SchedStats) -> None:
        self.limits = limits
        self.stats = stats
        self._posted: list[Entry] = []

    def __bool__(self) -> bool:
        """Whether a posted stop is still to be confirmed."""
        return bool(self._posted)

    def out(self, e: Entry, post: bool = False) -> SwitchedOut:
        """Take e off the device; post: another VF goes on at once (its stop may be
        confirmed later, where the backend can post it)."""
        done = e.engine.switch_out(self.limits, post and not e.faulted)
        self._record(done.took_ns)
        if done.posted:
            self._posted.append(e)
        return done

    def into(self, e: Entry) -> None:
        self._record(e.engine.switch_in(self.limits))

    def _record(self, took_ns: dict[str, int]) -> None:
        for name, ns in took_ns.items():
            self.stats.commands_ns[name].append(ns)

    def settle_landed(self, fault: Callable[[Entry, str], None]) -> None:
        """Confirm the stops that have landed; one that failed (the engine died, or the
        watchdog killed it for overrunning cmd_timeout) is handed to `fault`."""
        for e in list(self._posted):
            try:
                if not e.engine.settle(block=False):
                    continue
            except DeviceError as err:
                self._posted.remove(e)
                fault(e, str(err))
                continue
            self._posted.remove(e)

    def settle(self, e: Entry) -> None:
        """Wait for e's posted stop, if any: it leaves the schedule stopped or dead."""
        if e in self._posted:
            self._posted.remove(e)
            with contextlib.suppress(DeviceError):
                e.engine.settle()

    def settle_all(self) -> None:
        for e in list(self._posted):
            self.settle(e)
