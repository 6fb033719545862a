"""The scheduler thread's epoll set: which fds wake it, and for which VF.

Only the scheduler thread changes it, under `lock`; the lock also guards the
scheduler's entry table, so a reader on another thread (a status snapshot)
holding it sees both whole, never a map that changes while it iterates.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import threading
from typing import Any

from gpuvirt.device.status import Word
from gpuvirt.host.sched_entry import Entry


class Watches:
    def __init__(self, work_conserving: bool) -> None:
        self.sel = selectors.EpollSelector()
        self.lock = threading.Lock()
        # Only the work-conserving policies act on a drained queue or a new launch.
        self.work_conserving = work_conserving

    def add(self, fd: int, kind: str, e: Entry | None) -> None:
        with self.lock:
            self.sel.register(fd, selectors.EVENT_READ, (kind, e))

    def discard(self, fd: int) -> None:
        with self.lock, contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(fd)

    def select(self, timeout: float | None) -> list[tuple[selectors.SelectorKey, int]]:
        return self.sel.select(timeout)

    def describe(self) -> dict[str, list[Any]]:
        """fd -> [kind, vf]; the caller holds `lock`."""
        return {
            str(k.fd): [k.data[0], k.data[1].vf if k.data[1] else None]
            for k in self.sel.get_map().values()
        }

    def idle(self, e: Entry) -> None:
        if self.work_conserving:
            with contextlib.suppress(KeyError):  # still watched: a slice kept
                self.add(e.engine.idle_fd(), "idle", e)

    def unidle(self, e: Entry) -> None:
        if self.work_conserving:
            self.discard(e.engine.idle_fd())
            e.engine.status[Word.NOTIFY_IDLE] = 0

    def doorbell(self, e: Entry) -> None:
        if self.work_conserving and e.doorbell is not None and not e.faulted:
            self.add(e.doorbell, "doorbell", e)
            e.doorbell_watched = True

    def undoorbell(self, e: Entry) -> None:
        if e.doorbell is not None and e.doorbell_watched:
            self.discard(e.doorbell)
            e.doorbell_watched = False


def drain(fd: int) -> int:
    """An eventfd's count (0 if nothing was written since the last drain)."""
    try:
        return os.eventfd_read(fd)
    except BlockingIOError:
        return 0
