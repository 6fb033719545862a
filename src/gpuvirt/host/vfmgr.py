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
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import TYPE_CHECKING, Any

from gpuvirt.errors import StateError
from gpuvirt.host.events import Category, EventLog

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
# States in which a guest holds the VF and the scheduler may run its work.
GUEST_STATES = frozenset({S.FULLACCESS, S.ACTIVE})


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
