"""The prepared claims, kept in one JSON file so that a restarted plugin knows them.

Written atomically after every change (a crash leaves the old or the new file,
never half of one) with a checksum over its contents, so a file damaged some
other way is refused with its path rather than trusted. A claim is recorded
as PREPARING before the VF is touched and PREPARED once its CDI spec is
written, so an interrupted prepare is finished or undone, never forgotten.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpuvirt.errors import GpuvirtError
from gpuvirt.k8s.dra.cdi import write_atomic

VERSION = 1


class Phase(enum.StrEnum):
    PREPARING = "preparing"
    PREPARED = "prepared"


@dataclass(slots=True)
class PreparedDevice:
    request: str
    pool: str
    device: str
    vf: int
    cdi_ids: list[str]
    # The VF's fb and weight before this claim changed them; unprepare restores them.
    previous: dict[str, int | float]


@dataclass(slots=True)
class ClaimEntry:
    namespace: str
    name: str
    phase: Phase
    devices: list[PreparedDevice] = field(default_factory=list)


class CheckpointError(GpuvirtError):
    pass


class Checkpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.claims: dict[str, ClaimEntry] = {}

    def load(self) -> Checkpoint:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return self
        try:
            doc = json.loads(raw)
            body = doc["claims"]
            ok = doc["checksum"] == _checksum(body) and doc["version"] == VERSION
            if ok:
                self.claims = {uid: _entry(e) for uid, e in body.items()}
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"checkpoint {self.path}: unreadable ({e}); move it away"
            ) from None
        if not ok:
            raise CheckpointError(
                f"checkpoint {self.path}: checksum or version mismatch (written by another"
                " version, or damaged); move it away to start with no prepared claims"
            )
        return self

    def save(self) -> None:
        body = {uid: _plain(e) for uid, e in self.claims.items()}
        doc = {"version": VERSION, "checksum": _checksum(body), "claims": body}
        write_atomic(self.path, json.dumps(doc, indent=1, sort_keys=True).encode(), 0o600)

    def holder(self, vf: int) -> str | None:
        """The claim UID that holds VF `vf`, if any."""
        for uid, entry in self.claims.items():
            if any(d.vf == vf for d in entry.devices):
                return uid
        return None


def _plain(entry: ClaimEntry) -> dict[str, Any]:
    return {**asdict(entry), "phase": str(entry.phase)}


def _entry(doc: dict[str, Any]) -> ClaimEntry:
    return ClaimEntry(
        namespace=doc["namespace"],
        name=doc["name"],
        phase=Phase(doc["phase"]),
        devices=[PreparedDevice(**d) for d in doc["devices"]],
    )


def _checksum(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
