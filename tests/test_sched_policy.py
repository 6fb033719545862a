"""The scheduling policies as pure code: no threads, no processes, no clock."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvirt.defaults import DEVICE_CHARGE_SLACK, REJOIN_NS
from gpuvirt.errors import StateConflictError
from gpuvirt.host.sched.entry import disagreement
from gpuvirt.host.sched.fullaccess import Exclusive
from gpuvirt.host.sched.policy import WORK_CONSERVING, Account, Policy, Rules

SLICE = 1_000_000

accounts = st.lists(
    st.builds(
        Account,
        vf=st.integers(0, 0),  # replaced by position below
        weight=st.floats(0.1, 10),
        has_guest=st.booleans(),
        faulted=st.booleans(),
        pending=st.integers(0, 3),
    ),
    min_size=0,
    max_size=8,
)


def _table(accts: list[Account]) -> dict[int, Account]:
    for i, a in enumerate(accts):
        a.vf = i
    return {a.vf: a for a in accts}


def _runnable(rules: Rules, a: Account, exclusive: int | None) -> bool:
    if a.faulted or (exclusive is not None and a.vf != exclusive):
        return False
    if rules.policy is Policy.FAIRNESS or exclusive is not None:
        return True
    if rules.policy is Policy.ROUND_ROBIN:
        return a.has_guest
    return a.has_guest and a.pending > 0


@given(
    accts=accounts,
    policy=st.sampled_from(list(Policy)),
    cur_i=st.integers(-1, 7),
    excl_i=st.integers(-1, 7),
    keep=st.booleans(),
)
def test_never_picks_a_vf_that_may_not_run(accts, policy, cur_i, excl_i, keep) -> None:
    table = _table(accts)
    rules = Rules(policy, SLICE)
    cur = table.get(cur_i)
    exclusive = excl_i if excl_i >= 0 else None
    got = rules.pick(table, cur, exclusive, now=10**12, keep=cur if keep else None)
    runnable = [a for a in table.values() if _runnable(rules, a, exclusive)]
    if got is None:
        assert not runnable
    elif not _runnable(rules, got, exclusive):
        # the one exception: a work-conserving policy keeps its idle guest on the device
        # when nobody else wants it (its next launch then needs no switch)
        assert not runnable and got is cur and policy in WORK_CONSERVING
        assert cur.has_guest and not cur.faulted and exclusive is None


@given(weights=st.lists(st.integers(1, 8), min_size=2, max_size=6), rounds=st.integers(50, 400))
@settings(deadline=None)
def test_weighted_picks_converge_to_the_weights(weights: list[int], rounds: int) -> None:
    rules = Rules(Policy.WEIGHTED, SLICE)
    table = _table([Account(0, float(w), has_guest=True, pending=1) for w in weights])
    now, cur = 0, None
    for _ in range(rounds):
        cur = rules.pick(table, cur, None, now)
        assert cur is not None
        rules.begin_slice(cur, now)
        now += cur.slice_ns
        rules.end_slice(cur, now)
    # Device time per weight of any two busy VFs differs by at most one slice per weight:
    # so each share converges to weight / total as the run grows.
    v = [a.device_ns / a.weight for a in table.values()]
    assert max(v) - min(v) <= SLICE / min(weights) + 1e-6
    total = sum(a.device_ns for a in table.values())
    for a in table.values():
        assert abs(a.device_ns - total * a.weight / sum(weights)) <= SLICE * len(weights)


def test_round_robin_goes_round_in_vf_order_skipping_who_may_not_run() -> None:
    rules = Rules(Policy.ROUND_ROBIN, SLICE)
    table = _table([Account(0, 1.0, has_guest=g) for g in (True, False, True, True)])
    table[3].faulted = True
    order, cur = [], None
    for _ in range(5):
        cur = rules.pick(table, cur, None, 0)
        order.append(cur.vf)
    assert order == [0, 2, 0, 2, 0]


def test_exclusive_runs_only_that_vf_even_without_work() -> None:
    for policy in Policy:
        rules = Rules(policy, SLICE)
        table = _table([Account(0, 1.0, has_guest=True, pending=5), Account(0, 1.0)])
        assert rules.pick(table, table[0], 1, 0) is table[1]
        assert not rules.should_yield(table[1], 1)
        assert not rules.should_preempt(table[0], table.values(), 1, 0)


@pytest.mark.parametrize("policy", list(Policy))
def test_only_work_conserving_policies_yield_an_idle_vf(policy: Policy) -> None:
    rules = Rules(policy, SLICE)
    idle = Account(0, 1.0, has_guest=True, pending=0)
    busy = Account(1, 1.0, has_guest=True, pending=2)
    assert rules.should_yield(idle, None) is (policy in WORK_CONSERVING)
    assert not rules.should_yield(busy, None)


@given(debt=st.integers(0, 3 * SLICE), ran=st.integers(0, 3 * SLICE))
def test_overrun_comes_off_the_next_slice_never_below_half(debt: int, ran: int) -> None:
    rules = Rules(Policy.ROUND_ROBIN, SLICE)
    a = Account(0, 1.0, debt_ns=debt)
    rules.begin_slice(a, 100)
    assert a.slice_ns == max(SLICE - debt, SLICE // 2) and a.debt_ns == 0
    rules.end_slice(a, 100 + ran)
    assert a.device_ns == ran and a.debt_ns == max(0, ran - a.slice_ns)


def test_weighted_preempts_for_a_vf_behind_by_more_than_half_its_slice() -> None:
    rules = Rules(Policy.WEIGHTED, SLICE)
    cur = Account(0, 1.0, has_guest=True, pending=1, vtime=0.0, run_start=0, candidate=True)
    other = Account(1, 1.0, has_guest=True, pending=1, vtime=0.0, candidate=True)
    assert not rules.should_preempt(cur, [cur, other], None, SLICE // 2)
    assert rules.should_preempt(cur, [cur, other], None, SLICE // 2 + 1)
    other.pending = 0
    assert not rules.should_preempt(cur, [cur, other], None, 10 * SLICE)


def test_a_vf_back_after_a_long_idle_banks_no_credit_but_a_short_gap_keeps_its_lag() -> None:
    rules = Rules(Policy.WEIGHTED, SLICE)
    ahead = Account(0, 1.0, has_guest=True, pending=1, vtime=50.0 * SLICE, candidate=True)
    back = Account(1, 1.0, has_guest=True, pending=1, vtime=0.0, left_at=0)
    table = {0: ahead, 1: back}
    rules.pick(table, ahead, None, now=REJOIN_NS // 2)
    assert back.vtime == 0.0  # a short gap: all of its lag kept
    back.candidate, back.left_at, back.vtime = False, 0, 0.0
    rules.pick(table, ahead, None, now=REJOIN_NS * 2)
    assert back.vtime == ahead.vtime  # a real idle period: starts level with the others


def test_fullaccess_is_answered_only_once_its_vf_runs_and_fails_if_the_vf_leaves() -> None:
    full = Exclusive()
    granted: Future[None] = Future()
    other: Future[None] = Future()
    full.grant(1, other)
    full.grant(0, granted)  # supersedes VF1's grant, whose waiter is left waiting
    full.running(1)  # another VF running says nothing to VF0's waiter (nor VF1's: not granted)
    assert not granted.done() and not other.done()
    full.running(0)
    assert granted.done() and granted.result() is None
    assert not other.done()
    full.left(1)
    with pytest.raises(StateConflictError, match="VF1 left the schedule before it got the device"):
        other.result(0)
    assert full.vf == 0  # VF1 leaving does not end VF0's grant
    full.left(0)
    assert full.vf is None
    ended: Future[None] = Future()
    full.grant(None, ended)  # the end of a grant is answered at once
    assert ended.done() and full.vf is None


def test_a_slice_is_charged_the_devices_figure_bounded_by_its_wall_time() -> None:
    rules = Rules(Policy.WEIGHTED, SLICE)
    a = Account(0, 2.0, has_guest=True)
    near = SLICE - SLICE // 50  # the device was busy 98 % of the slice: within the slack
    rules.begin_slice(a, 1_000)
    rules.end_slice(a, 1_000 + SLICE, device_ran=near)
    assert (a.device_ns, a.wall_ns) == (near, SLICE)
    assert a.vtime == near / 2.0
    rules.begin_slice(a, 10 * SLICE)
    rules.end_slice(a, 11 * SLICE, device_ran=5 * SLICE)  # never above the wall
    assert (a.device_ns, a.wall_ns) == (near + SLICE, 2 * SLICE)
    floor = SLICE - int(SLICE * DEVICE_CHARGE_SLACK)
    for low in (SLICE // 4, 0, -7):  # never further below it than the slack
        rules.begin_slice(a, 20 * SLICE)
        rules.end_slice(a, 21 * SLICE, device_ran=low)
        assert a.device_ns == near + SLICE + floor
        a.device_ns -= floor
    rules.begin_slice(a, 30 * SLICE)
    rules.end_slice(a, 31 * SLICE)  # no device figure (emu): the wall clock is charged
    assert a.device_ns == near + 2 * SLICE


def test_an_engine_that_reports_no_device_time_gains_its_vf_no_more_than_the_slack() -> None:
    """The engine writes its own busy figure (it runs the tenant's code). One that says
    its device did nothing must not take the device from an honest neighbour: equal
    weights, both always busy, the liar holds at most 1 / (2 - slack) of the wall time.
    Charged its figure unbounded below, it held all but the first slice."""
    rules = Rules(Policy.WEIGHTED, SLICE)
    honest = Account(0, 1.0, has_guest=True, pending=1)
    liar = Account(1, 1.0, has_guest=True, pending=1)
    table = {0: honest, 1: liar}
    now, cur = 0, None
    for _ in range(1000):
        cur = rules.pick(table, cur, None, now, None)
        assert cur is not None
        rules.begin_slice(cur, now)
        now += SLICE
        rules.end_slice(cur, now, device_ran=0 if cur is liar else SLICE)
    held = liar.wall_ns / (liar.wall_ns + honest.wall_ns)
    assert held <= 1 / (2 - DEVICE_CHARGE_SLACK) + 1 / 1000


def test_disagreement_is_the_difference_of_the_two_shares_in_points() -> None:
    clock = {"device_clock": True}
    rows = [{"device_ns": 30, "wall_ns": 50, **clock}, {"device_ns": 70, "wall_ns": 50, **clock}]
    disagreement(rows)
    assert [r["disagree_pp"] for r in rows] == [-20.0, 20.0]
    same = [{"device_ns": 5, "wall_ns": 5, **clock}, {"device_ns": 0, "wall_ns": 0, **clock}]
    disagreement(same)
    assert [r["disagree_pp"] for r in same] == [0.0, 0.0]
    # an engine without a clock of its own (emu) has nothing to disagree with
    emu = [{"device_ns": 5, "wall_ns": 5, "device_clock": False}]
    disagreement(emu)
    assert emu[0]["disagree_pp"] is None
