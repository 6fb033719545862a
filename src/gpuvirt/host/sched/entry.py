"""The scheduler's record of one VF and its counters, and the engine's status words
read into them. Those words are written by the tenant's own engine, so every read
here is bounded: a liar can only hurt itself.

A VF's doorbell is the engine's end of its guest's command channel: a duplicate the
host keeps to watch (epoll, edge-triggered: one wake-up per message that arrives)
and to ask how many bytes wait in it (FIONREAD), and never reads. Work the guest
queued and the engine has not taken is there, in the kernel's socket queue, whether
the engine is stopped, idled or running, so nothing the tenant writes can make it
say more or less than what was sent, and the guest rings nothing: virtio's
ioeventfd without the write, as a NIC's doorbell is the ring's tail.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gpuvirt.defaults import MAX_TAKEN
from gpuvirt.device.base import Engine
from gpuvirt.device.status import Word
from gpuvirt.host.sched.policy import Account
from gpuvirt.poll import queued_bytes


@dataclass(eq=False)
class Entry(Account):
    engine: Engine = field(default=None)  # type: ignore[assignment]
    doorbell: int | None = None  # the engine's end of the guest's channel (a dup)
    doorbell_watched: bool = False
    queued: bool = False  # the channel held messages when it was last looked at
    # device time at ref_mono: maps a wall instant inside the last run to device time
    ref_mono: int = 0
    ref_dev: int = 0
    kernel_seq: int = 0
    kernel_base: int = 0
    kernel_done: int = -1  # COMPLETED when the running kernel was first seen
    switches_in: int = 0
    idle_wakes: int = 0
    busy_ref: int | None = None  # the engine's busy_ns() when its slice began

    def read_pending(self) -> int:
        """The work the VF has: what its engine took, or is taking, and has not completed
        (its words, bounded: they are untrusted), and one more while its channel holds
        messages. A faulted VF has none: it waits for its reset, and its channel may be
        gone.

        Read in the order the engine moves a message on (channel, TAKING, RECEIVED,
        COMPLETED), so that a running engine's message is seen at one step or a later
        one, never missed between two reads."""
        if self.faulted:
            self.pending = 0
            return 0
        self.queued = self.doorbell is not None and queued_bytes(self.doorbell) > 0
        st = self.engine.status
        taking = st[Word.TAKING] != 0
        taken = max(0, st[Word.RECEIVED] - st[Word.COMPLETED]) + taking
        self.pending = min(taken, MAX_TAKEN) + self.queued
        return self.pending

    def engine_idle(self) -> bool:
        """Nothing running, nothing received and not completed, by the engine's words:
        a kernel the engine runs with nothing sent for it (a tenant thread's) shows
        here, and a parked VF's unpark does not wait for a message that may never come."""
        st = self.engine.status
        return (
            st[Word.CURRENT_SEQ] == 0
            and st[Word.TAKING] == 0
            and st[Word.RECEIVED] <= st[Word.COMPLETED]
        )

    def slice_so_far(self, now: int, running: bool) -> int:
        """The running slice's time up to now, not yet charged (0 off the device or parked)."""
        return now - self.run_start if running and not self.parked else 0

    def device_now(self, now: int, running: bool) -> int:
        return self.device_ns + self.slice_so_far(now, running)

    def kernel_overrun(self, now: int, running: bool, limit_ns: int) -> str | None:
        """Why the running kernel is past job_timeout, or None. job_timeout counts a
        kernel's own device time, not wall time. The words are the engine's (untrusted):
        a new kernel needs a completion since the last one began, and its start time is
        clamped into the run it was seen in."""
        st = self.engine.status
        seq = st[Word.CURRENT_SEQ]
        if seq == 0:
            self.kernel_seq = 0
            return None
        done = st[Word.COMPLETED]
        if seq != self.kernel_seq and done != self.kernel_done:
            self.kernel_seq, self.kernel_done = seq, done
            since = max(0, now - self.ref_mono)
            start = min(max(0, st[Word.CURRENT_START_NS] - self.ref_mono), since)
            self.kernel_base = self.ref_dev + start
        own = self.device_now(now, running) - self.kernel_base
        if own <= limit_ns:
            return None
        return (
            f"kernel {seq} ran {own / 1e9:.2f} s of its own device time "
            f"(job_timeout {limit_ns / 1e9:g} s)"
        )

    def row(self, now: int, running: bool) -> dict[str, Any]:
        """This VF in a scheduler snapshot."""
        st = self.engine.status
        return {
            "device_ns": self.device_now(now, running),
            "wall_ns": self.wall_ns + self.slice_so_far(now, running),
            "device_clock": self.engine.busy_ns() is not None,
            "switches_in": self.switches_in,
            "running": running,
            "parked": self.parked,
            "weight": self.weight,
            "next_weight": self.next_weight,
            # As the scheduler thread last read them: a snapshot asks no descriptor.
            "pending": self.pending if self.has_guest else 0,
            "queued": self.queued,
            "received": st[Word.RECEIVED],
            "completed": st[Word.COMPLETED],
            "faulted": self.faulted,
            "has_guest": self.has_guest,
            "doorbell_fd": self.doorbell,
        }


@dataclass
class SchedStats:
    started_ns: int = field(default_factory=time.monotonic_ns)
    lost_ns: int = 0  # device time spent inside world switches
    idle_ns: int = 0  # no VF on the device
    switches: int = 0
    wakeups: int = 0  # returns from epoll with something to handle
    errors: int = 0  # exceptions contained on the scheduler thread
    latencies_ns: deque[int] = field(default_factory=lambda: deque(maxlen=100_000))
    # per world-switch command: durations in ns, for finding where a slow switch went
    commands_ns: dict[str, deque[int]] = field(
        default_factory=lambda: defaultdict(lambda: deque(maxlen=10_000))
    )

    def counters(self, now: int) -> dict[str, int]:
        return {
            "elapsed_ns": now - self.started_ns,
            "monotonic_ns": now,  # lines the scheduler's figures up with the engines' own
            "lost_ns": self.lost_ns,
            "idle_ns": self.idle_ns,
            "switches": self.switches,
            "wakeups": self.wakeups,
            "errors": self.errors,
        }


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


def drain(fd: int) -> int:
    """An eventfd's count (0 if nothing was written since the last drain)."""
    try:
        return os.eventfd_read(fd)
    except BlockingIOError:
        return 0
