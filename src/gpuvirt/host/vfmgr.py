"""The VF table and the VF state machine.

The VF lifecycle is one table, TABLE: (state, event) -> (next state, action),
in this file. The mailbox, the admin API, the scheduler and the resetter say
what happened by sending an event (`VFManager.send`); none of them sets a
state. A pair not in the table raises StateError naming the VF, the state and
the event, and leaves the VF as it was; guest input is checked before it gets
here, so a refused pair is a host bug or a race the caller must handle (it
asks `accepts` first). Every transition is a STATE event in the log.

    UNAVAIL ─ENABLED→ AVAIL ─GUEST_INIT→ FULLACCESS ─GUEST_READY→ ACTIVE ─GUEST_FINI→ SUSPEND
    SUSPEND ─ENGINE_UP→ AVAIL (fini: FB scrubbed, fresh engine)
    AVAIL|FULLACCESS|ACTIVE|SUSPEND ─FLR|DEVICE_RESET|DISABLE→ RESETTING
    RESETTING ─ENGINE_UP→ AVAIL   ─GUARD_TRIP→ QUARANTINED   ─ENGINE_FAILED→ FAILED
    QUARANTINED ─CLEAR_GUARD→ RESETTING     FAILED ─DEVICE_RESET→ RESETTING
    RESETTING|QUARANTINED|FAILED ─DISABLED→ UNAVAIL       UNAVAIL ─ENGINE_FAILED→ FAILED

A device reset skips QUARANTINED VFs (no DEVICE_RESET from there): only an
admin's clear-guard ends a quarantine.

The guards live here too: what each state allows that is not an event of the
table. No other module tests `vf.state`; it asks the table (`accepts`) or a
guard below: `MAILBOX` (a guest's request × the state: answered, or which FAIL),
`ADMIN` (clear-fb and an FB change × the state: allowed, or why not), and the
state sets the daemon, the info blocks and the status report go by.
tests/test_vf_states.py walks every pair of each, as it walks the table.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from gpuvirt.errors import StateError
from gpuvirt.host.events import Category, EventLog
from gpuvirt.protocol.mailbox import FailReason, GuestMsg

if TYPE_CHECKING:
    from gpuvirt.config import VFPlan
    from gpuvirt.device.base import Engine


class VFState(StrEnum):
    UNAVAIL = "UNAVAIL"
    AVAIL = "AVAIL"
    FULLACCESS = "FULLACCESS"
    ACTIVE = "ACTIVE"
    SUSPEND = "SUSPEND"
    RESETTING = "RESETTING"
    QUARANTINED = "QUARANTINED"
    FAILED = "FAILED"


class VFEvent(StrEnum):
    ENABLED = "enabled"  # an engine runs on a new FB (admin enable, host start)
    GUEST_INIT = "guest_init"  # REQ_GPU_INIT_ACCESS granted
    GUEST_READY = "guest_ready"  # REL_GPU_INIT_ACCESS
    GUEST_FINI = "guest_fini"  # REQ_GPU_FINI_ACCESS, or the guest went away
    ENGINE_UP = "engine_up"  # FB scrubbed and a fresh engine started
    ENGINE_FAILED = "engine_failed"  # no engine could be started
    FLR = "flr"  # a VF FLR begins (hang, engine death, guest or admin request)
    DEVICE_RESET = "device_reset"  # a whole-device reset takes this VF
    DISABLE = "disable"  # admin disable begins
    DISABLED = "disabled"  # engine gone, FB destroyed
    GUARD_TRIP = "guard_trip"  # too many FLRs in the guard's window
    CLEAR_GUARD = "clear_guard"  # an admin ended the quarantine
    RECARVE = "recarve"  # an admin gives a VF without a guest a new FB size (vf set --fb)


class Action(Enum):
    """What the host must do as part of a transition, run by VFManager itself so that
    no path out of a state can forget it."""

    NONE = "none"
    RELEASE_FULLACCESS = "release_fullaccess"  # the global init lock (GIM: one VF at a time)


S, E, A = VFState, VFEvent, Action
_RESET_FROM = (S.AVAIL, S.FULLACCESS, S.ACTIVE, S.SUSPEND)


def _table() -> dict[tuple[VFState, VFEvent], tuple[VFState, Action]]:
    t = {
        (S.UNAVAIL, E.ENABLED): (S.AVAIL, A.NONE),
        (S.UNAVAIL, E.ENGINE_FAILED): (S.FAILED, A.NONE),
        (S.AVAIL, E.GUEST_INIT): (S.FULLACCESS, A.NONE),
        (S.FULLACCESS, E.GUEST_READY): (S.ACTIVE, A.NONE),
        (S.ACTIVE, E.GUEST_FINI): (S.SUSPEND, A.NONE),
        (S.SUSPEND, E.ENGINE_UP): (S.AVAIL, A.NONE),
        (S.RESETTING, E.ENGINE_UP): (S.AVAIL, A.NONE),
        (S.RESETTING, E.ENGINE_FAILED): (S.FAILED, A.NONE),
        (S.RESETTING, E.GUARD_TRIP): (S.QUARANTINED, A.NONE),
        (S.RESETTING, E.DEVICE_RESET): (S.RESETTING, A.NONE),  # its FLR escalated
        (S.FAILED, E.DEVICE_RESET): (S.RESETTING, A.NONE),
        (S.QUARANTINED, E.CLEAR_GUARD): (S.RESETTING, A.NONE),
        (S.AVAIL, E.RECARVE): (S.RESETTING, A.NONE),
    }
    for state in _RESET_FROM:
        # Leaving FULLACCESS any way but GUEST_READY hands the init lock on.
        act = A.RELEASE_FULLACCESS if state is S.FULLACCESS else A.NONE
        for ev in (E.FLR, E.DEVICE_RESET, E.DISABLE):
            t[state, ev] = (S.RESETTING, act)
    for state in (S.RESETTING, S.QUARANTINED, S.FAILED):
        t[state, E.DISABLED] = (S.UNAVAIL, A.NONE)
    return t


TABLE: dict[tuple[VFState, VFEvent], tuple[VFState, Action]] = _table()

# ---- guards ------------------------------------------------------------------------

# A guest holds the VF: initializing, working or finishing. Its FB stays as it is.
GUEST_HELD = frozenset({S.FULLACCESS, S.ACTIVE, S.SUSPEND})
# A guest's work may run: initializing (alone on the device) or active.
GUEST_STATES = frozenset({S.FULLACCESS, S.ACTIVE})
# The guest has set up (REL_GPU_INIT_ACCESS) and not yet left: its VF2PF is read.
VF2PF_READ = frozenset({S.ACTIVE, S.SUSPEND})


def enabled(vf: VF) -> bool:
    """The VF has an engine and an FB, or is getting or lost them: anything but UNAVAIL."""
    return vf.state is not S.UNAVAIL


class Gone(Enum):
    """What a guest's going (fini, closed connection, lost liveness) asks of its VF."""

    RESET = "reset"  # mid-init: the half set-up VF is reset (FLR)
    SUSPEND = "suspend"  # working: off the schedule, then as FINI
    FINI = "fini"  # finished: FB scrubbed, a fresh engine, AVAIL


# States not listed: the VF is resetting or gone already; nothing more to do.
ON_GUEST_GONE = {S.FULLACCESS: Gone.RESET, S.ACTIVE: Gone.SUSPEND, S.SUSPEND: Gone.FINI}

ATTACH: Literal["ATTACH"] = "ATTACH"  # a connection's first frame (no GuestMsg id)
MailboxMsg = GuestMsg | Literal["ATTACH"]


class Refusal(NamedTuple):
    reason: FailReason  # DW1 of the FAIL frame
    why: str  # for the event log: the request, the state and why


# The request each state answers; any other state gets FAIL(BAD_STATE, DW3 = the id).
_REQUEST_IN = {
    GuestMsg.REQ_GPU_INIT_DATA: S.AVAIL,
    GuestMsg.REQ_GPU_INIT_ACCESS: S.AVAIL,
    GuestMsg.REL_GPU_INIT_ACCESS: S.FULLACCESS,
    GuestMsg.REQ_GPU_FINI_ACCESS: S.ACTIVE,
    GuestMsg.REL_GPU_FINI_ACCESS: S.SUSPEND,
}
# Heard in any state: a reset request (the resetter takes what the table allows) and
# two notes (READY_TO_RESET matters only during an FLR, LOG_VF_ERROR is logged).
_ANY_STATE = (GuestMsg.REQ_GPU_RESET_ACCESS, GuestMsg.READY_TO_RESET, GuestMsg.LOG_VF_ERROR)
_ATTACH_REFUSED = {
    S.QUARANTINED: (FailReason.QUARANTINED, "the VF is quarantined (gpuvirt vf clear-guard)"),
    S.UNAVAIL: (FailReason.VF_DISABLED, "the VF is disabled"),
    S.FAILED: (FailReason.VF_DISABLED, "the VF failed; a device reset may recover it"),
}


def _mailbox() -> dict[tuple[MailboxMsg, VFState], Refusal | None]:
    t: dict[tuple[MailboxMsg, VFState], Refusal | None] = {}
    for state in VFState:
        if state is S.AVAIL:
            t[ATTACH, state] = None
        else:
            reason, why = _ATTACH_REFUSED.get(state, (FailReason.VF_BUSY, "the VF is taken"))
            t[ATTACH, state] = Refusal(reason, f"ATTACH refused in {state}: {why}")
        for msg in GuestMsg:
            home = _REQUEST_IN.get(msg)
            if home is None or home is state:
                t[msg, state] = None
            else:
                t[msg, state] = Refusal(
                    FailReason.BAD_STATE, f"{msg.name} refused in {state}: answered in {home}"
                )
    assert {m for m in GuestMsg if m not in _REQUEST_IN} == set(_ANY_STATE)
    return t


# (request, state) -> None (answered) or the refusal: every pair.
MAILBOX = _mailbox()


def mailbox_refusal(msg: MailboxMsg, vf: VF) -> Refusal | None:
    """Whether the mailbox answers `msg` for this VF now; a VF has one guest at a time."""
    if msg == ATTACH and vf.conn is not None:
        return Refusal(FailReason.VF_BUSY, f"ATTACH refused in {vf.state}: the VF has a guest")
    return MAILBOX[msg, vf.state]


class AdminOp(StrEnum):
    """Admin requests that are no event of the table but need the right state."""

    CLEAR_FB = "clear-fb"  # scrub the FB of a VF without a guest
    SET_FB = "set fb"  # re-carve the FB (vf set --fb)


def _admin() -> dict[tuple[AdminOp, VFState], str | None]:
    t: dict[tuple[AdminOp, VFState], str | None] = {}
    for state in VFState:
        for op in AdminOp:
            if state in GUEST_HELD:
                why = "the VF has a guest; detach it, or `gpuvirt vf disable` the VF first"
            elif state is S.RESETTING:
                why = "try again once it is AVAIL"
            elif state is S.UNAVAIL and op is AdminOp.CLEAR_FB:
                why = "it is disabled; it has no FB"
            else:
                t[op, state] = None  # SET_FB of a disabled VF: its next enable carves it
                continue
            t[op, state] = f"{op} refused in {state}: {why}"
    return t


# (admin request, state) -> None (allowed) or why not: every pair.
ADMIN = _admin()


def admin_refusal(op: AdminOp, vf: VF) -> str | None:
    """Why `op` cannot be done to this VF now, or None. An attached guest counts in any
    state: one that has not asked for init yet may have read its PF2VF."""
    if vf.conn is not None and vf.state not in GUEST_HELD:
        return f"{op} refused in {vf.state}: the VF has a guest (pid {vf.guest_pid})"
    return ADMIN[op, vf.state]


@dataclass
class VF:
    index: int
    plan: VFPlan
    token: bytes
    state: VFState = VFState.UNAVAIL
    engine: Engine | None = None
    guest_pid: int | None = None
    guest_uid: int | None = None
    conn: Any = None  # the mailbox session bound to this VF, if any
    checksum_key: int = 0
    flr_count: int = 0
    guard_trips: int = 0
    flr_times: deque[float] = field(default_factory=deque)
    last_flr: dict[str, Any] | None = None
    vf2pf: dict[str, Any] = field(default_factory=dict)
    vf2pf_bad: int = 0
    untrusted: bool = False
    since: float = field(default_factory=time.time)

    @property
    def fb(self) -> int:
        return self.plan.fb


class VFManager:
    def __init__(
        self, vfs: list[VF], events: EventLog, actions: dict[Action, Callable[[VF], None]]
    ) -> None:
        """`actions`: how the host carries out each of the table's actions."""
        self.vfs = vfs
        self.events = events
        self.actions = actions

    def __getitem__(self, index: int) -> VF:
        return self.vfs[index]

    def __len__(self) -> int:
        return len(self.vfs)

    def accepts(self, vf: VF, event: VFEvent) -> bool:
        return (vf.state, event) in TABLE

    def send(self, vf: VF, event: VFEvent, reason: str) -> VFState:
        """Apply one event; the table's action runs before the event is logged."""
        step = TABLE.get((vf.state, event))
        if step is None:
            self.events.emit(
                Category.STATE, "refused", f"{event} refused in {vf.state}: {reason}", vf.index,
                state=str(vf.state), event=str(event), reason=reason,
            )  # fmt: skip
            raise StateError(f"VF{vf.index}: event {event} is illegal in {vf.state} ({reason})")
        new, action = step
        old, vf.state, vf.since = vf.state, new, time.time()
        if action is not Action.NONE:
            self.actions[action](vf)
        self.events.emit(
            Category.STATE, "transition", f"{old} → {new} on {event}: {reason}", vf.index,
            old=str(old), new=str(new), event=str(event), reason=reason,
        )  # fmt: skip
        return new
