"""Scheduling policies as pure code: who may run, who runs next, when a slice ends.

No threads, clocks, fds or engines here: the scheduler thread (host/sched/scheduler.py)
reads the engines' status words and the doorbells into each VF's `Account`
and passes the time in; everything here decides from those numbers alone.

Policies (GIM's names):
  fairness     every enabled VF gets its slice, guest or not, work or not
  round_robin  VFs with a guest, full slices
  liquid       VFs with pending work; a VF with nothing pending yields at once
  weighted     liquid, picking the VF with the least device time per weight

A VF that overran its slice has the excess taken off its next slice, never
below half a slice (GIM's overrun rule).

A work-conserving policy keeps a drained VF on the device when nobody else wants it
(its next launch then runs without a switch). Such a VF is parked: it holds no slice
and is charged nothing until that launch, so idling there costs it no share later.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from gpuvirt.defaults import DEVICE_CHARGE_SLACK, REJOIN_NS


class Policy(StrEnum):
    FAIRNESS = "fairness"
    ROUND_ROBIN = "round_robin"
    LIQUID = "liquid"
    WEIGHTED = "weighted"


WORK_CONSERVING = frozenset({Policy.LIQUID, Policy.WEIGHTED})


@dataclass(eq=False)
class Account:
    """One VF as the policies see it. `pending` and `has_guest` are set by the
    scheduler thread; the rest is the policies' own bookkeeping."""

    vf: int
    weight: float
    has_guest: bool = False
    faulted: bool = False
    pending: int = 0  # launches queued and not completed, as last read
    device_ns: int = 0  # charged: the device's own figure where it has one (end_slice)
    wall_ns: int = 0  # the host's wall-clock view of the same slices
    vtime: float = 0.0
    debt_ns: int = 0
    run_start: int = 0
    slice_ns: int = 0
    candidate: bool = False
    left_at: int = 0  # when it last stopped being a candidate (weighted)
    next_weight: float | None = None  # set while a slice runs: takes effect when it ends
    parked: bool = False  # on the device, drained, holding no slice (module docstring)


@dataclass(frozen=True)
class Rules:
    policy: Policy
    slice_ns: int

    @property
    def work_conserving(self) -> bool:
        return self.policy in WORK_CONSERVING

    def candidates(self, accounts: Mapping[int, Account], exclusive: int | None) -> list[Account]:
        if exclusive is not None:
            a = accounts.get(exclusive)
            return [a] if a is not None and not a.faulted else []
        live = [a for a in accounts.values() if not a.faulted]
        if self.policy is Policy.FAIRNESS:
            return live
        with_guest = [a for a in live if a.has_guest]
        if self.policy is Policy.ROUND_ROBIN:
            return with_guest
        return [a for a in with_guest if a.pending > 0]

    def pick(
        self,
        accounts: Mapping[int, Account],
        cur: Account | None,
        exclusive: int | None,
        now: int,
        keep: Account | None = None,
    ) -> Account | None:
        """The VF to run next; `keep` (the running one, its slice not over) stays if it
        may still run."""
        cands = self.candidates(accounts, exclusive)
        if not cands:
            # Work-conserving policies keep an idle VF on the device when nobody else wants
            # it: its next launch runs without waiting for a switch.
            if (
                self.work_conserving
                and cur is not None
                and not cur.faulted
                and cur.has_guest
                and exclusive is None
            ):
                return cur
            return None
        if self.policy is Policy.WEIGHTED:
            self._track_candidates(accounts.values(), cands, now)
        if keep is not None and keep in cands:
            return keep
        if self.policy is Policy.WEIGHTED:
            return min(cands, key=lambda a: (a.vtime, a.vf))
        order = sorted(cands, key=lambda a: a.vf)
        if cur is None:
            return order[0]
        after = [a for a in order if a.vf > cur.vf]
        return after[0] if after else order[0]

    def _track_candidates(
        self, accounts: Iterable[Account], cands: list[Account], now: int
    ) -> None:
        floor = min((a.vtime for a in cands if a.candidate), default=None)
        for a in accounts:
            if a in cands and not a.candidate and floor is not None:
                a.vtime = returning_vtime(a, floor, now)
            if a.candidate and a not in cands:
                a.left_at = now
            a.candidate = a in cands

    def should_yield(self, cur: Account, exclusive: int | None) -> bool:
        """Work-conserving: a running VF with nothing pending gives the device up, or,
        kept there because nobody else wants it, parks."""
        return self.work_conserving and exclusive is None and cur.pending == 0

    def others_waiting(
        self, cur: Account, accounts: Iterable[Account], exclusive: int | None
    ) -> bool:
        """Whether any other VF has work the running one should make way for when it drains
        (then it should say so). Under FULLACCESS none does: the running VF keeps the
        device drained or not, and a drained one would wake the scheduler for nothing."""
        if exclusive is not None:
            return False
        return any(
            a is not cur and a.has_guest and not a.faulted and a.pending > 0 for a in accounts
        )

    def should_preempt(
        self, cur: Account, accounts: Iterable[Account], exclusive: int | None, now: int
    ) -> bool:
        """weighted: a VF with work that is behind the running one by more than half a
        slice of its own takes the device now (CFS-style wakeup preemption). Otherwise a
        busy VF whose next launch lands just after a pick waits out a whole slice of a
        VF ahead of it, and loses share at every gap between its kernels."""
        if self.policy is not Policy.WEIGHTED or exclusive is not None:
            return False
        cur_v = cur.vtime + (now - cur.run_start) / cur.weight
        for a in accounts:
            if a is cur or not a.has_guest or a.faulted or a.pending == 0:
                continue
            v = a.vtime if a.candidate else returning_vtime(a, cur.vtime, now)
            if v + self.slice_ns / (2 * a.weight) < cur_v:
                return True
        return False

    def begin_slice(self, a: Account, now: int) -> None:
        a.run_start = now
        # GIM's overrun rule: the excess comes off this slice, never below half a slice.
        a.slice_ns = max(self.slice_ns - a.debt_ns, self.slice_ns // 2)
        a.debt_ns = 0

    def end_slice(self, a: Account, now: int, device_ran: int | None = None) -> None:
        """Charge the slice: `device_ran` is the device's own figure for it (None: the
        device's time is the wall clock), bounded since the engine writes it: never more
        than the slice's wall time, never less than DEVICE_CHARGE_SLACK below it, so an
        engine that under-reports gains its VF next to nothing from its neighbours.
        `wall_ns` beside it (and the snapshot's `disagree_pp`) shows the gap. Overruns
        are judged on wall time."""
        wall = max(0, now - a.run_start)
        floor = wall - int(wall * DEVICE_CHARGE_SLACK)
        ran = wall if device_ran is None else min(max(floor, device_ran), wall)
        a.device_ns += ran
        a.wall_ns += wall
        a.vtime += ran / a.weight
        a.debt_ns = max(0, wall - a.slice_ns)
        if a.next_weight is not None:
            a.weight, a.next_weight = a.next_weight, None


def returning_vtime(a: Account, floor: float, now: int) -> float:
    """A VF back with work after a short gap (between two launches, even on a busy
    host) keeps all its lag; after a real idle period it banks no credit."""
    if now - a.left_at < REJOIN_NS:
        return a.vtime
    return max(a.vtime, floor)
