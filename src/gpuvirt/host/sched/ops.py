"""The scheduler thread's inbox: work other threads hand it, and the eventfd that
wakes it for that work (host/sched/scheduler.py watches `fd`).

Everything the scheduler's state is touched by runs on its own thread, so other
threads never take a lock on it: they post an op here and wait on its future.
Once the thread is gone, `close` refuses what is still queued and every later
post: nobody would answer it, and its wake-up would go to a closed descriptor
or, worse, to whatever file reused the number.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from gpuvirt.errors import StateConflictError
from gpuvirt.host.sched.entry import drain

Op = Callable[[Future[Any]], None]  # answers its future, now or later
STOPPED = "the scheduler has stopped (the host is shutting down)"


class Ops:
    def __init__(self) -> None:
        self._queue: deque[tuple[Op, Future[Any]]] = deque()
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()  # a post or wake-up never meets a closing fd
        self._closed = False

    def call(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run fn(*args) on the scheduler thread; its result answers the future."""
        return self.post(lambda fut: fut.set_result(fn(*args)))

    def post(self, op: Op) -> Future[Any]:
        """Run op(fut) on the scheduler thread; op answers fut, now or later."""
        fut: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise StateConflictError(STOPPED)
            self._queue.append((op, fut))
            os.eventfd_write(self.fd, 1)
        return fut

    def wake(self) -> None:
        """Wake the scheduler thread (also for reasons of its own: no op queued)."""
        with self._lock:
            if not self._closed:
                os.eventfd_write(self.fd, 1)

    def woken(self) -> None:
        """On the scheduler thread, when `fd` is readable: the wake-up is heard."""
        drain(self.fd)

    def run(self) -> int:
        """On the scheduler thread: every op queued, in order; how many ran."""
        n = 0
        while self._queue:
            op, fut = self._queue.popleft()
            n += 1
            try:
                op(fut)
            except Exception as e:  # a bug; hand it to the caller rather than kill the thread
                if not fut.done():
                    fut.set_exception(e)
        return n

    def close(self) -> None:
        """Once the scheduler thread has ended: refuse the ops still queued and any
        posted later, and close the eventfd."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self.fd)
            left = list(self._queue)
            self._queue.clear()
        for _, fut in left:
            if not fut.done():
                fut.set_exception(StateConflictError(STOPPED))
