"""The host's event log: every state change, reset step and refusal, in order.

Each event is one JSON line appended to <state_dir>/events.jsonl and kept in a
bounded in-memory ring for the admin endpoint. Events are emitted from the
asyncio loop and from the scheduler thread, hence the lock (host-internal only;
no engine or guest ever touches it).

Guests can make the host emit events (refusals, LOG_VF_ERROR) and put their own
text in them (a VF2PF driver version, an engine's stderr in a failure), so every
string of an event is escaped here (gpuvirt.text), and nothing here may grow with
what they send: the file is rotated at `max_bytes` (events.jsonl.1
.. .N kept), and reset and guard events live in a ring of their own per VF, so
a flood of other events, or another VF's resets, never pushes a VF's FLR
history out.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from gpuvirt.defaults import EVENT_HISTORY_KEEP as HISTORY_KEEP
from gpuvirt.defaults import EVENT_RING_KEEP
from gpuvirt.text import printable, printable_data


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


HISTORY = (Category.RESET, Category.GUARD)  # kept per VF, apart from the common ring


class EventLog:
    def __init__(
        self,
        path: Path | None,
        keep: int = EVENT_RING_KEEP,
        max_bytes: int = 16 << 20,
        files: int = 4,
    ) -> None:
        self._lock = threading.Lock()
        self._ring: deque[Event] = deque(maxlen=keep)
        self._history: dict[int | None, deque[Event]] = {}
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._seq = 0
        self._file = None
        self.max_bytes, self.files = max_bytes, files
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._open()

    def _open(self) -> None:
        assert self.path is not None
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        os.chmod(self.path, 0o640)
        self._size = self._file.tell()

    def _rotate(self) -> None:
        """events.jsonl -> .1 -> .2 ... -> .N (dropped); a fresh events.jsonl."""
        assert self._file is not None and self.path is not None
        self._file.close()
        for n in range(self.files, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{n}")
            newer = self.path.with_name(f"{self.path.name}.{n - 1}") if n > 1 else self.path
            if n == self.files:
                older.unlink(missing_ok=True)
            if newer.exists():
                newer.rename(older)
        self._open()

    def emit(
        self, category: Category, kind: str, message: str, vf: int | None = None, **data: Any
    ) -> Event:
        with self._lock:
            self._seq += 1
            ev = Event(
                self._seq,
                time.time(),
                str(category),
                kind,
                vf,
                printable(message),
                printable_data(data),
            )
            if category in HISTORY:
                self._history.setdefault(vf, deque(maxlen=HISTORY_KEEP)).append(ev)
            else:
                self._ring.append(ev)
            if self._file is not None:
                line = ev.to_json() + "\n"
                if self._size and self._size + len(line) > self.max_bytes:
                    self._rotate()
                self._file.write(line)
                self._size += len(line)
            for loop, waiter in self._waiters:
                loop.call_soon_threadsafe(waiter.set)
        return ev

    def since(self, after: int = 0, vf: int | None = None, limit: int = 1000) -> list[Event]:
        with self._lock:
            rings = [self._ring, *self._history.values()]
            out = [
                e
                for e in heapq.merge(*rings, key=lambda e: e.seq)
                if e.seq > after and (vf is None or e.vf == vf)
            ]
        return out[-limit:]

    async def wait_async(self, after: int, timeout: float) -> None:
        """On the loop, holding no thread: until an event newer than `after` exists."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        waiter = (loop, asyncio.Event())
        try:
            while True:
                with self._lock:
                    if self._seq > after:
                        return
                    waiter[1].clear()
                    self._waiters.add(waiter)
                left = deadline - loop.time()
                if left <= 0:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter[1].wait(), left)
        finally:
            with self._lock:
                self._waiters.discard(waiter)

    @property
    def last_seq(self) -> int:
        return self._seq

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
