"""The VF table and the VF state machine.

Everything that decides whether a VF may move from one state to another lives
in TRANSITIONS, in this file; a step not in the table is a bug in the host
(never a guest's doing: guest input is checked before it gets here) and
raises StateError naming the VF, the state and the step. Every transition
emits a STATE event.

    UNAVAIL ─enable→ AVAIL ─init→ FULLACCESS ─release→ ACTIVE ⇄ SUSPEND ─fini→ AVAIL
    any ─→ RESETTING ─→ AVAIL | QUARANTINED | FAILED          QUARANTINED ─clear→ AVAIL
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
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


S = VFState
TRANSITIONS: dict[VFState, frozenset[VFState]] = {
    S.UNAVAIL: frozenset({S.AVAIL, S.FAILED}),
    S.AVAIL: frozenset({S.UNAVAIL, S.FULLACCESS, S.RESETTING}),
    S.FULLACCESS: frozenset({S.ACTIVE, S.RESETTING}),
    S.ACTIVE: frozenset({S.SUSPEND, S.RESETTING}),
    S.SUSPEND: frozenset({S.ACTIVE, S.AVAIL, S.RESETTING}),
    S.RESETTING: frozenset({S.AVAIL, S.QUARANTINED, S.FAILED, S.UNAVAIL}),
    S.QUARANTINED: frozenset({S.AVAIL, S.UNAVAIL, S.RESETTING}),
    S.FAILED: frozenset({S.RESETTING, S.UNAVAIL}),
}
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
    def __init__(self, vfs: list[VF], events: EventLog) -> None:
        self.vfs = vfs
        self.events = events

    def __getitem__(self, index: int) -> VF:
        return self.vfs[index]

    def __len__(self) -> int:
        return len(self.vfs)

    def transition(self, vf: VF, new: VFState, reason: str) -> None:
        if new not in TRANSITIONS[vf.state]:
            raise StateError(f"VF{vf.index}: illegal transition {vf.state} → {new} ({reason})")
        old, vf.state, vf.since = vf.state, new, time.time()
        self.events.emit(
            Category.STATE, "transition", f"{old} → {new}: {reason}", vf.index,
            old=str(old), new=str(new), reason=reason,
        )  # fmt: skip
