"""`gpuvirt demo`: one short run, judged by its --json summary and by what it leaves behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpuvirt.cli.demo.sender import netgpu_available

FLR_STEPS = {"off_schedule", "notify", "kill", "scrub", "engine_start"}


def running(pid: int) -> bool:
    """A process that exists and is not a zombie waiting for its reaper."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def orphan_engines() -> set[int]:
    """Engine processes whose host is gone (re-parented to init)."""
    out = set()
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"gpuvirt.device.engine" in cmd and ppid == 1:
            out.add(int(proc.name))
    return out


@pytest.mark.timeout(180)
def test_demo_verifies_everything_and_leaves_nothing_behind() -> None:
    orphans_before = orphan_engines()
    r = subprocess.run(
        [sys.executable, "-m", "gpuvirt", "demo", "--duration", "4", "--vfs", "3", "--json"],
        capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    s = json.loads(r.stdout)
    assert r.returncode == 0, (s["failures"], r.stderr[-3000:])
    assert s["ok"] and s["failures"] == []
    assert (s["backend"], s["policy"], s["vfs"]) == ("emu", "weighted", 3)

    # Shares: configured from the weights 1:2:3; every VF got device time.
    shares = {x["vf"]: x for x in s["shares"]}
    assert sorted(shares) == [0, 1, 2]
    for vf, w in ((0, 1), (1, 2), (2, 3)):
        assert shares[vf]["weight"] == w
        assert shares[vf]["configured"] == pytest.approx(w / 6, abs=1e-4)
    # Weighted: device time in the calm part of the run follows the weights' order
    # (round robin or fairness would give each VF a third).
    steady = [shares[vf]["achieved_steady"] for vf in (0, 1, 2)]
    assert None not in steady, "no interval with every VF active and no FLR"
    assert steady[0] < steady[1] < steady[2], steady
    assert sum(x["achieved"] for x in s["shares"]) == pytest.approx(1, abs=1e-3)

    # Work: every VF verified results and none was wrong.
    work = {x["vf"]: x for x in s["work"]}
    assert all(x["verified"] > 0 and x["failed"] == 0 and x["ok"] for x in work.values())
    roles = {vf: x["role"] for vf, x in work.items()}
    assert roles == {0: "netgpu", 1: "compute", 2: "hang"}

    # The hang: one FLR, of that VF only, with its steps; its guest went on afterwards.
    (flr,) = s["flrs"]
    assert flr["vf"] == 2 and flr["reason"] == "job_timeout"
    assert flr["steps_ms"].keys() >= FLR_STEPS and flr["total_ms"] > 0
    assert work[2]["resets"] == 1 and work[2]["verified_after_reset"] >= 1
    assert work[0]["resets"] == work[1]["resets"] == 0

    # NetGPU: every byte sent arrived and hashed the same, unless this build has no NetGPU.
    n = s["netgpu"]
    if netgpu_available() is None:
        assert n["status"] == "verified"
        assert n["bytes_received"] == n["bytes_sent"] == n["bytes_verified"] > 0
        assert n["sha256_received"] == n["sha256_sent"]
    else:
        assert n["status"] == "skipped" and n["reason"]

    # Nothing left running: host, every engine it had (the reset VF's old one too), guests.
    pids = [s["pids"]["host"], *s["pids"]["engines"], *s["pids"]["guests"]]
    assert len(s["pids"]["engines"]) >= 4, "three engines, and a fresh one after the FLR"
    assert [p for p in pids if running(p)] == []
    assert orphan_engines() - orphans_before == set(), "an engine outlived its host"
