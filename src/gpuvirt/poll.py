"""Poll before sleeping: both ends of a launch poll their channel for a while first.

On a VM, waking a CPU that has gone to sleep costs tens of µs: an IPI through
the hypervisor, the vCPU's exit from halt, cold caches after it. A launch
round trip has two such wake-ups, so a plain blocking wait spends more there
than on the launch's own work (docs/benchmarks.md, `bench launch`). So the
guest waiting for a result, and the engine waiting for the next launch, each
poll their channel for a short window before they block. CUDA does the same
by default (cudaDeviceScheduleAuto spins while it has a CPU to spare), and so
does a Linux guest before it halts (cpuidle-haltpoll).

The window adapts by haltpoll's rule (Documentation/virt/guest-halt-polling.rst):
a wait that polling missed but that ended within the limit grows it, a longer
one shrinks it, so a tenant whose kernels run for milliseconds stops polling
within a few launches and the CPU goes back to sleeping. Each turn of the poll
yields the CPU, so a peer on the same CPU (the reply's sender) runs at once
instead of waiting out the window. Polling there gains nothing, though (the
peer could only run because we yielded), and costs a yield per turn: a poll
that spent more than half its time inside its yields (another thread ran
meanwhile) shared the CPU. Two such polls in a row mean a peer on the same CPU,
and polling then stops for the next 2, 4, ... SHARED_BACKOFF waits, doubling
while that keeps happening, so a peer on the same CPU soon stops the polling for
long. One alone is a thread that woke there once (the host's scheduler thread
at a slice's end, beside a guest on a CPU of its own) and changes nothing:
stopping for it made 2-6 % of a launch loop's waits block, each paying the
cross-CPU wake-up that polling is there to save (docs/benchmarks-log.md).

The time inside the yields is read from the monotonic clock (the vDSO, no
system call), beyond what a bare yield costs (the quickest one seen). The
thread's CPU clock would say the same, but reading it is a system call, and
the read after the message came was on the round trip at both of its ends
(~1.5 µs each on a VM whose system calls trap to the hypervisor; docs/benchmarks.md).
"""

from __future__ import annotations

import fcntl
import os
import struct
import termios
import time
from collections.abc import Callable
from typing import TypeVar

from gpuvirt.defaults import DEFAULT_POLL_US
from gpuvirt.errors import GpuvirtError

T = TypeVar("T")

POLL_ENV = "GPUVIRT_POLL_US"  # the guest's limit; 0 turns polling off
GROW_FROM = 4  # a window that grows from nothing starts at limit / GROW_FROM
SHARED_STREAK = 2  # shared polls in a row that stop polling
SHARED_BACKOFF = 256  # at most this many waits without polling after shared polls in a row
BARE_YIELD_NS = 1_000_000  # a bare yield's cost until one is seen (any real one is less)


class PollWindow:
    """How long to poll before blocking, learnt from how the last waits ended."""

    def __init__(self, limit_ns: int) -> None:
        self.limit_ns = 0
        self.window_ns = 0
        self.backoff = 0  # waits left before polling may resume
        self.shared = 0  # polls in a row that found the CPU shared
        self.bare_yield_ns = BARE_YIELD_NS  # the quickest yield seen: nothing else ran
        self.set_limit(limit_ns)

    def set_limit(self, limit_ns: int) -> None:
        self.limit_ns = max(0, limit_ns)
        self.window_ns = self.limit_ns

    def poll(self, attempt: Callable[[], T | None]) -> T | None:
        """attempt() until it returns something or the window passes (then None)."""
        if self.window_ns <= 0:
            return None
        start = time.monotonic_ns()
        end = start + self.window_ns
        yielded = False
        away = 0  # ns inside yields beyond a bare yield's cost: others ran meanwhile
        while True:
            got = attempt()
            if got is not None:
                if yielded:  # bare yields (away 0) judge the CPU too: they end a streak
                    self._yielded(away, time.monotonic_ns() - start)
                return got
            now = time.monotonic_ns()
            if now >= end:
                return None
            os.sched_yield()
            yielded = True
            took = time.monotonic_ns() - now
            if took < self.bare_yield_ns:
                self.bare_yield_ns = took
            away += took - self.bare_yield_ns

    def wait(self, attempt: Callable[[], T | None], block: Callable[[], T]) -> T:
        """What attempt() gets within the window, else what block() waits for; either
        way the window learns from how long the wait took."""
        start = time.monotonic_ns()
        got = self.poll(attempt)
        if got is not None:
            return got
        try:
            return block()
        finally:
            self.slept(time.monotonic_ns() - start)

    def _yielded(self, away_ns: int, wall_ns: int) -> None:
        """A poll that yielded got its message: was the CPU shared meanwhile? Polling
        stops from the second shared poll in a row: a peer on the same CPU runs in every
        poll's yields, another thread that woke there once (a host thread's timer) in one."""
        if away_ns * 2 <= wall_ns:
            self.shared = 0
            return
        self.shared += 1
        if self.shared < SHARED_STREAK:
            return
        self.window_ns = 0
        self.backoff = min(SHARED_BACKOFF, 1 << (self.shared - SHARED_STREAK + 1))

    def slept(self, waited_ns: int) -> None:
        """A wait that polling did not end has ended, `waited_ns` after polling began."""
        if self.backoff:
            self.backoff -= 1
        elif waited_ns <= self.limit_ns:
            grown = max(self.window_ns * 2, self.limit_ns // GROW_FROM)
            self.window_ns = min(self.limit_ns, grown)
        else:
            self.window_ns //= 2
            if self.window_ns < self.limit_ns // GROW_FROM:
                self.window_ns = 0


_INQ = struct.Struct("i")


def queued_bytes(sock_fd: int) -> int:
    """Bytes waiting in a socket's receive queue (FIONREAD: SIOCINQ), without reading
    them; OSError if the descriptor is bad."""
    return _INQ.unpack(fcntl.ioctl(sock_fd, termios.FIONREAD, bytes(_INQ.size)))[0]


def poll_limit_ns(value: str | None) -> int:
    """The guest's limit from GPUVIRT_POLL_US (µs; unset: the default)."""
    if value is None or value == "":
        return DEFAULT_POLL_US * 1000
    try:
        us = int(value)
    except ValueError:
        raise GpuvirtError(f"{POLL_ENV}={value!r}: not a whole number of microseconds") from None
    if not 0 <= us <= 1_000_000:
        raise GpuvirtError(f"{POLL_ENV}={value!r}: must be 0 (off) to 1000000 µs")
    return us * 1000
