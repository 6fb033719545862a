"""The event log under floods: rotated on disk, FLR history kept per VF in memory."""

from __future__ import annotations

import json
from pathlib import Path

from gpuvirt.host.events import HISTORY_KEEP, Category, EventLog


def test_the_log_file_is_rotated_and_bounded(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, max_bytes=4096, files=3)
    for i in range(2000):
        log.emit(Category.MAILBOX, "vf_error", f"flood {i}", 1, code=i)
    log.close()
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == [
        "events.jsonl", "events.jsonl.1", "events.jsonl.2", "events.jsonl.3"
    ]  # fmt: skip
    assert all(f.stat().st_size <= 4096 for f in files)
    # Newest in events.jsonl, then .1, .2, .3 in order, with no gap between them.
    seqs = [
        [json.loads(line)["seq"] for line in (tmp_path / name).read_text().splitlines()]
        for name in ("events.jsonl.3", "events.jsonl.2", "events.jsonl.1", "events.jsonl")
    ]
    flat = [s for part in seqs for s in part]
    assert flat == list(range(flat[0], 2001))


def test_a_reopened_log_continues_its_size_count(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text("x" * 5000 + "\n")
    log = EventLog(path, max_bytes=4096, files=2)
    log.emit(Category.HOST, "start", "again")
    log.close()
    assert (tmp_path / "events.jsonl.1").read_text().startswith("xxx")
    assert json.loads(path.read_text())["kind"] == "start"


def test_floods_never_push_out_a_vfs_flr_history() -> None:
    log = EventLog(None, keep=100)
    for i in range(5):
        log.emit(Category.RESET, "flr.done", f"FLR {i} of VF0", 0)
    log.emit(Category.GUARD, "guard.trip", "VF0 quarantined", 0)
    for _ in range(10_000):  # another VF floods both the common ring and its own resets
        log.emit(Category.MAILBOX, "vf_error", "flood", 1)
        log.emit(Category.RESET, "flr.start", "flood FLR", 1)
    vf0 = log.since(0, vf=0)
    assert [e.kind for e in vf0] == ["flr.done"] * 5 + ["guard.trip"]
    everything = log.since(0, limit=1 << 30)
    assert [e.seq for e in everything] == sorted(e.seq for e in everything)
    assert sum(e.vf == 1 and e.category == "reset" for e in everything) == HISTORY_KEEP
    assert sum(e.category == "mailbox" for e in everything) == 100
