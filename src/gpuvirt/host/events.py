"""The host's event log: every state change, reset step and refusal, in order.

Each event is one JSON line appended to <state_dir>/events.jsonl and kept in a
bounded in-memory ring for the admin endpoint. Events are emitted from the
asyncio loop and from the scheduler thread, hence the lock (host-internal only;
no engine or guest ever touches it).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any


class Category(StrEnum):
    STATE = "state"  # a VF state transition
    MAILBOX = "mailbox"  # attach, refusals, handshake steps, liveness
    SCHED = "sched"  # world-switch anomalies, policy changes
    RESET = "reset"  # FLR and device reset steps, with durations
    GUARD = "guard"  # guard trips and clears
    ADMIN = "admin"  # operator actions
    HOST = "host"  # start, stop, configuration


@dataclass(frozen=True)
class Event:
    seq: int
    ts: float  # wall clock, seconds since the epoch
    category: str
    kind: str
    vf: int | None
    message: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


class EventLog:
    def __init__(self, path: Path | None, keep: int = 4096) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._ring: deque[Event] = deque(maxlen=keep)
        self._seq = 0
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
            os.chmod(path, 0o640)
        self.path = path

    def emit(
        self, category: Category, kind: str, message: str, vf: int | None = None, **data: Any
    ) -> Event:
        with self._lock:
            self._seq += 1
            ev = Event(self._seq, time.time(), str(category), kind, vf, message, data)
            self._ring.append(ev)
            if self._file is not None:
                self._file.write(ev.to_json() + "\n")
            self._cond.notify_all()
        return ev

    def since(self, after: int = 0, vf: int | None = None, limit: int = 1000) -> list[Event]:
        with self._lock:
            out = [e for e in self._ring if e.seq > after and (vf is None or e.vf == vf)]
        return out[-limit:]

    def wait(self, after: int, timeout: float) -> None:
        """Block (a host thread, never the loop) until an event newer than `after` exists."""
        with self._cond:
            self._cond.wait_for(lambda: self._seq > after, timeout)

    @property
    def last_seq(self) -> int:
        return self._seq

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
