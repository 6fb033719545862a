"""`gpuvirt demo`: one short run, judged by its --json summary and by what it leaves behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuvirt.cli.demo.sender import netgpu_available
from gpuvirt.device.cuda import cupy_installed

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
    assert roles == {0: "netgpu", 1: "compute", 2: "hostile"}

    # The hang, then the fault (a write through a bad pointer kills the engine): one FLR
    # each, of that VF only, with its steps; its guest went on after each.
    hang, fault = s["flrs"]
    assert (hang["vf"], hang["incident"], hang["reason"]) == (2, "hang", "job_timeout")
    assert (fault["vf"], fault["incident"], fault["reason"]) == (2, "fault", "engine_died")
    for flr in (hang, fault):
        assert flr["steps_ms"].keys() >= FLR_STEPS and flr["total_ms"] > 0
    assert work[2]["resets"] == 2 and work[2]["verified_after_reset"] >= 1
    assert work[2]["incidents"]["fault"]["flr_reason"] == "engine_died"
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
    assert len(s["pids"]["engines"]) >= 5, "three engines, and a fresh one after each FLR"
    assert [p for p in pids if running(p)] == []
    assert orphan_engines() - orphans_before == set(), "an engine outlived its host"


def _demo_cuda(env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuvirt", "demo", "--backend", "cuda", "--duration", "2"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


@pytest.mark.skipif(cupy_installed(), reason="CuPy is installed here")
def test_demo_on_cuda_without_cupy_refuses_and_says_why() -> None:
    r = _demo_cuda()
    assert r.returncode == 2, r.stderr
    text = " ".join(r.stderr.split())
    assert "cannot run here" in text and "needs CuPy" in text and "emu" in text
    assert "Traceback" not in r.stderr


def test_demo_on_cuda_without_a_usable_gpu_refuses_and_says_why(tmp_path: Path) -> None:
    # A CuPy that imports but finds no device, as on a machine without an NVIDIA GPU.
    pkg = tmp_path / "cupy"
    (pkg / "cuda").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '14.0.0'\nfrom cupy import cuda\n")
    (pkg / "cuda" / "__init__.py").write_text("from cupy.cuda import runtime\n")
    (pkg / "cuda" / "runtime.py").write_text(
        "def getDeviceCount():\n"
        "    raise RuntimeError('cudaErrorNoDevice: no CUDA-capable device is detected')\n"
    )
    r = _demo_cuda({**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])})
    assert r.returncode == 2, r.stderr
    text = " ".join(r.stderr.split())
    assert "no usable NVIDIA GPU" in text and "cudaErrorNoDevice" in text
    assert "Traceback" not in r.stderr


def test_demo_refuses_an_unknown_backend() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "gpuvirt", "demo", "--backend", "rocm"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "one of emu, cuda" in r.stderr
