"""Who may wait to attach: the mailbox's bookkeeping before a guest has authenticated.

A connection is accepted before it has said anything, so until its ATTACH is
answered it costs the host a slot. At most `max_pending_attach` connections hold
one, at most MAX_PENDING_ATTACH_PER_UID of them (or `max_pending_attach`, if
lower) of one uid as the kernel recorded it at connect (SO_PEERCRED), so one
uid's flood never takes another's slot; one more is refused at once with
TOO_MANY or TOO_MANY_UID. Each refusal, here or of an ATTACH itself (host/
mailbox.py's Session), is an event, up to a throttle. No I/O here: the mailbox
reads the peer, sends the refusal and closes the connection.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from gpuvirt.config import HostSection
from gpuvirt.defaults import GUEST_EVENT_BURST as EVENT_BURST
from gpuvirt.defaults import GUEST_EVENTS_PER_S as EVENTS_PER_S
from gpuvirt.defaults import MAX_PENDING_ATTACH_PER_UID
from gpuvirt.host.events import Category, EventLog
from gpuvirt.host.ratelimit import EventThrottle
from gpuvirt.protocol.mailbox import FailReason


@dataclass(frozen=True)
class Limits:
    """What one peer may cost the host (DESIGN.md, "Untrusted inputs"), from [host]."""

    attach_timeout_s: float  # for its ATTACH, from the accept
    max_pending_attach: int  # connections waiting to attach, all peers together
    max_frames_per_s: int  # an attached guest's frames read (the mailbox's reader)

    @classmethod
    def of(cls, host: HostSection) -> Limits:
        return cls(host.attach_timeout_ms / 1000, host.max_pending_attach, host.max_frames_per_s)


def peer_cred(sock: socket.socket) -> tuple[int, int]:
    """The connected peer's pid and uid, as the kernel recorded them at connect."""
    pid, uid, _gid = struct.unpack(
        "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    )
    return pid, uid


class Admission:
    """The pre-auth slots taken, in all and per uid, and the refusals' events."""

    def __init__(self, limits: Limits, events: EventLog) -> None:
        self.limits = limits
        self.events = events
        self.pending = 0  # connections accepted and not yet attached (or refused)
        self.pending_by_uid: dict[int, int] = {}
        self._refusals = EventThrottle(EVENTS_PER_S, EVENT_BURST)

    def admit(self, uid: int) -> tuple[FailReason, str] | None:
        """Take a slot for a fresh connection of `uid`: None, or why there is none."""
        most = self.limits.max_pending_attach
        per_uid = min(MAX_PENDING_ATTACH_PER_UID, most)
        if self.pending >= most:
            return FailReason.TOO_MANY, (
                f"{self.pending} connections already waiting to attach "
                f"(host.max_pending_attach = {most})"
            )
        if self.pending_by_uid.get(uid, 0) >= per_uid:
            return FailReason.TOO_MANY_UID, (
                f"{per_uid} connections of uid {uid} already waiting to attach "
                "(MAX_PENDING_ATTACH_PER_UID)"
            )
        self.pending += 1
        self.pending_by_uid[uid] = self.pending_by_uid.get(uid, 0) + 1
        return None

    def done(self, uid: int) -> None:
        """A pending connection attached or was refused: its slots are free."""
        self.pending -= 1
        left = self.pending_by_uid.pop(uid) - 1
        if left:
            self.pending_by_uid[uid] = left

    def refused(self, reason: FailReason, why: str, vf: int | None, peer: tuple[int, int]) -> None:
        """One event per refusal, up to the throttle; beyond it they are counted."""
        dropped = self._refusals.admit()
        if dropped is None:
            return
        pid, uid = peer
        self.events.emit(
            Category.MAILBOX, "attach.refused", f"ATTACH from pid {pid} uid {uid} refused: {why}",
            vf, reason=reason.name, pid=pid, uid=uid, suppressed=dropped,
        )  # fmt: skip
