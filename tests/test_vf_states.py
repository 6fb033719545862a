"""The VF state machine: every (state, event) pair, and random event sequences."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gpuvirt.config import VFPlan
from gpuvirt.errors import StateError
from gpuvirt.host.events import EventLog
from gpuvirt.host.vfmgr import TABLE, VF, Action, VFEvent, VFManager, VFState

S, E = VFState, VFEvent


def _manager(state: VFState, released: list[int]) -> tuple[VFManager, VF]:
    vf = VF(0, VFPlan(0, 1 << 20, 1.0, None, None), b"\0" * 32, state=state)  # type: ignore[arg-type]
    vfm = VFManager(
        [vf], EventLog(None), {Action.RELEASE_FULLACCESS: lambda v: released.append(v.index)}
    )
    return vfm, vf


@pytest.mark.parametrize(("state", "event"), list(itertools.product(VFState, VFEvent)))
def test_every_pair_is_applied_as_the_table_says_or_refused(state: VFState, event: VFEvent) -> None:
    released: list[int] = []
    vfm, vf = _manager(state, released)
    if (state, event) in TABLE:
        new, action = TABLE[state, event]
        assert vfm.accepts(vf, event)
        assert vfm.send(vf, event, "test") is new and vf.state is new
        assert released == ([0] if action is Action.RELEASE_FULLACCESS else [])
        (ev,) = vfm.events.since()
        assert (ev.kind, ev.data["old"], ev.data["new"], ev.data["event"]) == (
            "transition", state, new, event,
        )  # fmt: skip
    else:
        assert not vfm.accepts(vf, event)
        with pytest.raises(StateError, match=f"event {event} is illegal in {state}"):
            vfm.send(vf, event, "test")
        assert vf.state is state and released == []
        (ev,) = vfm.events.since()
        assert ev.kind == "refused" and ev.data == {
            "state": state, "event": event, "reason": "test",
        }  # fmt: skip


def test_the_table_keeps_the_lifecycle_rules() -> None:
    # Every state is reachable from UNAVAIL, and every state can get back to UNAVAIL.
    edges: dict[VFState, set[VFState]] = {s: set() for s in VFState}
    for (old, _ev), (new, _a) in TABLE.items():
        edges[old].add(new)

    def reach(start: VFState, graph: dict[VFState, set[VFState]]) -> set[VFState]:
        seen, todo = {start}, [start]
        while todo:
            for n in graph[todo.pop()] - seen:
                seen.add(n)
                todo.append(n)
        return seen

    assert reach(S.UNAVAIL, edges) == set(VFState)
    back = {s: {o for o in VFState if s in edges[o]} for s in VFState}
    assert reach(S.UNAVAIL, back) == set(VFState)
    # Leaving FULLACCESS other than to ACTIVE always hands the init lock on.
    for (old, _ev), (new, action) in TABLE.items():
        if old is S.FULLACCESS and new is not S.ACTIVE:
            assert action is Action.RELEASE_FULLACCESS, (old, _ev)
    # Only an admin's clear-guard ends a quarantine; a device reset does not.
    assert {ev for (old, ev) in TABLE if old is S.QUARANTINED} == {E.CLEAR_GUARD, E.DISABLED}


class Lifecycle(RuleBasedStateMachine):
    """Random event sequences: refused ones change nothing; the init lock is held
    exactly while the VF is in FULLACCESS; the log has one line per event sent."""

    def __init__(self) -> None:
        super().__init__()
        self.released: list[int] = []
        self.vfm, self.vf = _manager(S.UNAVAIL, self.released)
        self.lock_held = False
        self.sent = 0

    @rule(event=st.sampled_from(list(VFEvent)))
    def send(self, event: VFEvent) -> None:
        before = self.vf.state
        self.sent += 1
        if not self.vfm.accepts(self.vf, event):
            with pytest.raises(StateError):
                self.vfm.send(self.vf, event, "random")
            assert self.vf.state is before
            return
        n = len(self.released)
        new = self.vfm.send(self.vf, event, "random")
        if new is S.FULLACCESS:
            self.lock_held = True
        elif before is S.FULLACCESS and new is not S.ACTIVE:
            assert len(self.released) == n + 1
            self.lock_held = False
        elif before is S.FULLACCESS:
            self.lock_held = False  # GUEST_READY: activate() releases after the switch
        else:
            assert len(self.released) == n

    @invariant()
    def lock_only_in_fullaccess(self) -> None:
        assert self.lock_held == (self.vf.state is S.FULLACCESS)

    @invariant()
    def every_event_logged(self) -> None:
        assert len(self.vfm.events.since(0, None, 1 << 30)) == self.sent


TestLifecycle = Lifecycle.TestCase
