"""The VF state machine: every (state, event) pair, every guard's (request, state)
pair, and random event sequences."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gpuvirt.config import VFPlan
from gpuvirt.errors import StateError
from gpuvirt.host import vfmgr
from gpuvirt.host.events import EventLog
from gpuvirt.host.vfmgr import (
    ADMIN,
    ATTACH,
    GUEST_HELD,
    MAILBOX,
    ON_GUEST_GONE,
    TABLE,
    VF,
    VF2PF_READ,
    Action,
    AdminOp,
    Gone,
    VFEvent,
    VFManager,
    VFState,
    admin_refusal,
    mailbox_refusal,
)
from gpuvirt.protocol.mailbox import FailReason, GuestMsg

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


# The event each answered request sends to the table (host/daemon.py's lifecycle steps).
REQUEST_EVENT = {
    GuestMsg.REQ_GPU_INIT_ACCESS: E.GUEST_INIT,
    GuestMsg.REL_GPU_INIT_ACCESS: E.GUEST_READY,
    GuestMsg.REQ_GPU_FINI_ACCESS: E.GUEST_FINI,
}


@pytest.mark.parametrize(("msg", "state"), list(itertools.product([ATTACH, *GuestMsg], VFState)))
def test_every_mailbox_pair_is_answered_or_refused_naming_both(msg, state: VFState) -> None:
    _vfm, vf = _manager(state, [])
    refusal = mailbox_refusal(msg, vf)
    assert refusal == MAILBOX[msg, state]
    if refusal is not None:
        assert re.match(rf"{getattr(msg, 'name', msg)} refused in {state}: \S", refusal.why)
    if msg == ATTACH:
        assert (refusal is None) == (state is S.AVAIL)
        want = {S.QUARANTINED: FailReason.QUARANTINED, S.UNAVAIL: FailReason.VF_DISABLED,
                S.FAILED: FailReason.VF_DISABLED}.get(state, FailReason.VF_BUSY)  # fmt: skip
        assert refusal is None or refusal.reason is want
        vf.conn = object()  # a VF has one guest: a second ATTACH is refused in every state
        taken = mailbox_refusal(msg, vf)
        assert taken is not None and taken.reason is FailReason.VF_BUSY and str(state) in taken.why
        return
    answered_in = {st for st in VFState if MAILBOX[msg, st] is None}
    if msg in (GuestMsg.REQ_GPU_RESET_ACCESS, GuestMsg.READY_TO_RESET, GuestMsg.LOG_VF_ERROR):
        assert answered_in == set(VFState)  # heard whatever the state
        return
    # A request is answered in exactly one state; refused elsewhere as BAD_STATE.
    assert len(answered_in) == 1
    assert refusal is None or refusal.reason is FailReason.BAD_STATE
    # ... and the event it sends is one the table takes there.
    if refusal is None and msg in REQUEST_EVENT:
        assert (state, REQUEST_EVENT[msg]) in TABLE


@pytest.mark.parametrize(("op", "state"), list(itertools.product(AdminOp, VFState)))
def test_every_admin_pair_is_allowed_or_refused_naming_both(op: AdminOp, state: VFState) -> None:
    _vfm, vf = _manager(state, [])
    why = admin_refusal(op, vf)
    assert why == ADMIN[op, state]
    if why is not None:
        assert why.startswith(f"{op} refused in {state}: ")
    # Never under a guest's feet, nor mid-reset; clear-fb needs an FB to scrub.
    refused = GUEST_HELD | {S.RESETTING} | ({S.UNAVAIL} if op is AdminOp.CLEAR_FB else set())
    assert (why is not None) == (state in refused)
    vf.conn, vf.guest_pid = object(), 4242  # a guest attached (not yet in init) counts too
    why = admin_refusal(op, vf)
    assert why is not None and str(state) in why and (state in GUEST_HELD or "4242" in why)


def test_the_state_sets_follow_the_table() -> None:
    # A guest's going: mid-init it is reset (and the init lock handed on); working, it
    # is suspended, which leads to the state a fini scrubs and brings back to AVAIL.
    for state, gone in ON_GUEST_GONE.items():
        if gone is Gone.RESET:
            assert TABLE[state, E.FLR] == (S.RESETTING, Action.RELEASE_FULLACCESS)
        elif gone is Gone.SUSPEND:
            after = TABLE[state, E.GUEST_FINI][0]
            assert ON_GUEST_GONE[after] is Gone.FINI
        else:
            assert TABLE[state, E.ENGINE_UP] == (S.AVAIL, Action.NONE)
    assert set(ON_GUEST_GONE) == GUEST_HELD
    # VF2PF is read from the guest's set-up until its fini ends.
    assert {TABLE[S.FULLACCESS, E.GUEST_READY][0], TABLE[S.ACTIVE, E.GUEST_FINI][0]} == VF2PF_READ


def test_no_host_module_but_vfmgr_names_a_state() -> None:
    # Every rule about states lives with the table: the rest of the host asks it.
    host = Path(vfmgr.__file__).parent
    states = "|".join(VFState.__members__)
    for path in host.rglob("*.py"):
        if path.name != "vfmgr.py":
            text = path.read_text()
            assert not re.search(rf"\b(VFState|S)\.({states})\b", text), path


class Lifecycle(RuleBasedStateMachine):
    """Random event sequences: refused ones change nothing; the table's actions hold
    the init lock exactly while the VF is in FULLACCESS, except on GUEST_READY, whose
    release is the daemon's; the log has one line per event sent."""

    def __init__(self) -> None:
        super().__init__()
        self.released: list[int] = []
        self.vfm, self.vf = _manager(S.UNAVAIL, self.released)
        self.lock_held: bool | None = False  # None: the daemon's to release, not the table's
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
        released = len(self.released) - n
        assert released == (1 if before is S.FULLACCESS and new is not S.ACTIVE else 0)
        if new is S.FULLACCESS:
            self.lock_held = True
        elif released:
            self.lock_held = False
        elif before is S.FULLACCESS:
            # GUEST_READY: the table releases nothing; Host.activate() must, once the VF
            # no longer runs alone. The model does not do that for it: from here the lock
            # is the daemon's, which test_vf_lifecycle_live.py checks on a live host
            # (test_the_daemon_hands_the_init_lock_on_once_a_guest_is_active).
            self.lock_held = None

    @invariant()
    def lock_only_in_fullaccess(self) -> None:
        if self.lock_held is not None:
            assert self.lock_held == (self.vf.state is S.FULLACCESS)
        else:
            assert self.vf.state is not S.FULLACCESS

    @invariant()
    def every_event_logged(self) -> None:
        assert len(self.vfm.events.since(0, None, 1 << 30)) == self.sent


TestLifecycle = Lifecycle.TestCase
