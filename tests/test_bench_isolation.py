"""bench isolation without a GPU: it refuses, and its verdicts (what a fault did to each
tenant, the memory taken beyond a share, the targets) read tenants' events as they
report them. Nothing here measures a GPU: those figures come only from a device."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpuvirt.bench import LONG, SUITES, mps
from gpuvirt.bench.isolation import FAULTS, SETUPS, Tenant, figures, judge, outcome, targets
from gpuvirt.device.cuda import cupy_installed


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuvirt", "bench", "isolation", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_on_emu_it_refuses_and_says_why() -> None:
    r = _bench("--json")
    assert r.returncode == 2, r.stderr
    text = " ".join(r.stderr.split())
    assert "cannot run here" in text and "--backend cuda" in text and "Traceback" not in text
    assert r.stdout == ""  # no figures of another backend


@pytest.mark.skipif(cupy_installed(), reason="CuPy is installed here")
def test_on_cuda_without_cupy_it_refuses_and_says_why() -> None:
    r = _bench("--backend", "cuda", "--quick", "--json")
    assert r.returncode == 2, r.stderr
    assert "needs CuPy" in " ".join(r.stderr.split()) and r.stdout == ""


def test_it_is_not_part_of_bench_all() -> None:
    assert "isolation" in SUITES and "isolation" in LONG


def _events(*pairs: tuple[str, float], **extra: object) -> list[dict[str, object]]:
    return [{"ev": ev, "t": t, **extra} for ev, t in pairs]


def _steady(t0: float, t1: float, every: float = 0.1) -> list[tuple[str, float]]:
    n = round((t1 - t0) / every)
    return [("ok", t0 + i * every) for i in range(n)]


def test_a_neighbour_that_kept_working_is_unaffected() -> None:
    t = Tenant("T1", _events(*_steady(9.0, 13.0)))
    row = judge(t, fault_t=10.0, end_t=13.0)
    assert row["fate"] == "unaffected" and row["errors"] == 0
    assert row["longest_stall_s"] == pytest.approx(0.1, abs=1e-6)
    assert row["back_after_s"] is None


def test_fates_died_stuck_lost_work_slowed() -> None:
    died = Tenant("T1", _events(*_steady(9.0, 10.0), ("error", 10.1), ("dead", 10.2)), rc=3)
    assert judge(died, 10.0, 13.0)["fate"] == "died"
    stuck = Tenant("T0", _events(*_steady(9.0, 10.0)), rc=-9, killed=True)
    assert judge(stuck, 10.0, 13.0)["fate"] == "stuck"
    lost = Tenant("T0", [*_events(*_steady(9.0, 10.0)), {"ev": "error", "t": 10.5, "error": "x"},
                         *_events(("reset", 11.0), *_steady(11.2, 13.0))])  # fmt: skip
    row = judge(lost, 10.0, 13.0)
    assert row["fate"] == "lost work" and row["back_after_s"] == pytest.approx(1.2)
    assert row["longest_stall_s"] == pytest.approx(1.2)
    slow = Tenant("T2", _events(*_steady(9.0, 10.0, 0.01), *_steady(10.0, 13.0, 0.1)))
    assert judge(slow, 10.0, 13.0)["fate"] == "slowed"


def test_outcome_counts_harmed_neighbours_and_memory_beyond_the_share() -> None:
    plan = next(p for p in FAULTS if p.name == "grab_memory")
    t0 = Tenant("T0", [*_events(*_steady(9.0, 10.0)), {"ev": "fault_result", "t": 10.1,
                "result": {"pool_bytes": 256 << 20, "malloc_bytes": 100 << 30}}])  # fmt: skip
    t1 = Tenant("T1", _events(*_steady(9.0, 13.0)))
    t2 = Tenant("T2", _events(*_steady(9.0, 10.0), ("error", 10.5), ("dead", 10.6)), rc=3)
    o = outcome(plan, {"T0": t0, "T1": t1, "T2": t2}, 10.0, 13.0, share=2 << 30)
    assert o["neighbours_harmed"] == 1 and o["neighbours_died"] == 1
    assert o["taken_bytes"] == (256 << 20) + (100 << 30)
    assert o["beyond_share_bytes"] == o["taken_bytes"] - (2 << 30)


def test_the_report_has_every_fault_and_setup_and_the_targets_judge_gpuvirt_only() -> None:
    assert {p.name for p in FAULTS} == {"spin", "illegal_address", "grab_memory"}
    assert SETUPS == ("gpuvirt", "mps", "timeslice")
    fine = {"neighbours_harmed": 0, "faulty_back_after_s": 1.5}
    runs = {p.name: {"gpuvirt": dict(fine), "mps": {"neighbours_harmed": 2,
            "faulty_back_after_s": None}} for p in FAULTS}  # fmt: skip
    runs["grab_memory"]["gpuvirt"]["faulty_back_after_s"] = None  # not reset: not judged
    assert all(t.met for t in targets(runs))
    runs["spin"]["gpuvirt"]["neighbours_harmed"] = 1
    assert not all(t.met for t in targets(runs))
    f = figures(runs, {"mps": "nvidia-cuda-mps-control is not installed"})
    assert set(f["plans"]) == set(runs) and f["setups_skipped"]["mps"]


def test_mps_clients_get_a_private_pipe_and_the_share_as_their_cap(tmp_path) -> None:
    env = mps.daemon_env({"PATH": "/usr/bin"}, tmp_path / "pipe", tmp_path / "log")
    assert env[mps.PIPE_ENV] == str(tmp_path / "pipe") and env[mps.LOG_ENV] == str(tmp_path / "log")
    assert mps.mem_limit(2 << 30) == {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M"}
    assert mps.holders(str(tmp_path / "pipe")) == []  # nothing carries a fresh directory
