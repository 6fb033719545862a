"""Posted stops: a world switch's IDLE issued without waiting for it to land.

A switch is IDLE(A) SAVE(A) LOAD(B) RUN(B). Waited for, A's stop costs the
scheduler thread a second wake-up per switch and leaves the device idle
between A's stop and B's continue. Posted, the thread sends A's stop and
B's continue back to back and confirms the stop at its next wake-up.

That keeps the world switch's promise, that B executes nothing until A has
executed its last instruction, because on emu every engine runs on one CPU and
cannot leave it (device/emu.py; seccomp denies sched_setaffinity). B runs there
only once A has left it, and A leaves it only through the kernel, which takes
the stop already pending before A's own code runs again. Raised above every
engine for its stop (SCHED_FIFO), A takes it at once, before B's turn. An
engine that cannot be raised, or has threads of the tenant's besides its own
(only the one raised would stop before B runs), has its stop waited for as
before (device/emu.py). Any later command to A (its next RUN, an FLR, a
removal) first waits for the stop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from gpuvirt.device.base import WSCommand
from gpuvirt.errors import DeviceError
from gpuvirt.host.sched_entry import Entry, SchedStats


class PostedStops:
    def __init__(self, cmd_timeout: float, stats: SchedStats) -> None:
        self.cmd_timeout = cmd_timeout
        self.stats = stats
        self.one_cpu = False  # every engine runs on one CPU (set by the scheduler thread)
        self._posted: list[Entry] = []

    def __bool__(self) -> bool:
        return bool(self._posted)

    def may_post(self, e: Entry) -> bool:
        return self.one_cpu and not e.faulted and e.engine.can_post

    def post(self, e: Entry) -> None:
        took = e.engine.post_idle(self.cmd_timeout)
        self.stats.commands_ns[WSCommand.IDLE_GPU.name].append(int(took * 1e9))
        self._posted.append(e)

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
