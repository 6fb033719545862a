"""The scheduler thread's epoll set: which fds wake it, and for which VF.

Only the scheduler thread changes it, under `lock`; the lock also guards the
scheduler's entry table, so a reader on another thread (a status snapshot)
holding it sees both whole, never a map that changes while it iterates.
"""

from __future__ import annotations

import contextlib
import select
import threading
from typing import Any

from gpuvirt.host.sched.entry import Entry

Data = tuple[str, Entry | None]  # what an fd wakes the thread for: (kind, VF)


class Watches:
    """A bare epoll and a dict, not `selectors`: this runs on the device's CPU at every
    switch, where all it does is device time lost, and a selector's per-call bookkeeping
    buys it nothing (measured: no change to be seen beside the wake-ups' own cost)."""

    def __init__(self, work_conserving: bool) -> None:
        self._ep = select.epoll()
        self._data: dict[int, Data] = {}
        self.lock = threading.Lock()
        # Only the work-conserving policies act on a drained queue or a new launch.
        self.work_conserving = work_conserving

    def add(self, fd: int, kind: str, e: Entry | None, events: int = select.EPOLLIN) -> None:
        """Watch fd; KeyError if it is watched already."""
        with self.lock:
            if fd in self._data:
                raise KeyError(fd)
            self._ep.register(fd, events)
            self._data[fd] = (kind, e)

    def discard(self, fd: int) -> None:
        with self.lock:
            if self._data.pop(fd, None) is not None:
                with contextlib.suppress(OSError):  # closed already: epoll forgot it
                    self._ep.unregister(fd)

    def select(self, timeout: float | None) -> list[Data]:
        events = self._ep.poll(-1 if timeout is None else timeout)
        return [self._data[fd] for fd, _ in events if fd in self._data]

    def close(self) -> None:
        """Once the scheduler thread has ended: the epoll goes; the fds it watched are
        their owners' (engines, guests) to close."""
        with self.lock:
            self._ep.close()
            self._data.clear()

    def describe(self) -> dict[str, list[Any]]:
        """fd -> [kind, vf]; the caller holds `lock`."""
        return {str(fd): [k, e.vf if e else None] for fd, (k, e) in self._data.items()}

    def idle(self, e: Entry) -> None:
        if self.work_conserving:
            with contextlib.suppress(KeyError):  # still watched: a slice kept
                self.add(e.engine.idle_fd(), "idle", e)

    def unidle(self, e: Entry) -> None:
        if self.work_conserving:
            self.discard(e.engine.idle_fd())
            e.engine.notify_idle(False)

    def doorbell(self, e: Entry) -> None:
        """Watch the VF's channel: a wake-up per message that arrives (edge-triggered: the
        socket stays readable while they wait, and at its guest's end of file for good),
        and one at once if messages wait already."""
        if self.work_conserving and e.doorbell is not None and not e.faulted:
            self.add(e.doorbell, "doorbell", e, select.EPOLLIN | select.EPOLLET)
            e.doorbell_watched = True

    def undoorbell(self, e: Entry) -> None:
        if e.doorbell is not None and e.doorbell_watched:
            self.discard(e.doorbell)
            e.doorbell_watched = False
