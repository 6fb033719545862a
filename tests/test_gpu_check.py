"""scripts/gpu-check's own plan: every step's limit fits its budget, so none is skipped."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check"


def _load() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_step_limits_fit_the_default_budget() -> None:
    gc = _load()
    assert set(gc.LIMITS) == set(gc.ORDER)
    worst = sum(gc.LIMITS.values()) + gc.NVSMI_TIMEOUT_S + len(gc.ORDER) * gc.STEP_OVERHEAD_S
    assert worst <= gc.DEFAULT_BUDGET_S, (
        f"steps may take {worst} s, more than the {gc.DEFAULT_BUDGET_S} s budget: "
        f"the last ones ({gc.ORDER[-2:]}) could be skipped"
    )
    # every step still gets the time its limit promises after all the ones before it
    used = gc.NVSMI_TIMEOUT_S
    for name in gc.ORDER:
        used += gc.LIMITS[name] + gc.STEP_OVERHEAD_S
        assert gc.DEFAULT_BUDGET_S - (used - gc.LIMITS[name]) >= gc.MIN_STEP_S, name


def test_the_docstring_states_the_budget_the_code_uses() -> None:
    gc = _load()
    said = re.search(r"default (\d+) s", gc.__doc__)
    assert said is not None and float(said.group(1)) == gc.DEFAULT_BUDGET_S


def test_default_out_is_a_dated_file_under_bench_results() -> None:
    out = _load().default_out()
    assert out.parent == SCRIPT.parent.parent / "bench" / "results"
    assert out.name == f"gpu-check-{datetime.now(UTC):%Y-%m-%d}.json"


def test_only_takes_commas_and_repeats_and_keeps_the_run_order() -> None:
    gc = _load()
    assert gc.parse_only(["demo,tests", "deps"]) == ["deps", "tests", "demo"]
    assert gc.parse_only(None) == gc.ORDER
    with pytest.raises(ValueError, match="unknown steps shares"):
        gc.parse_only(["share,shares"])


def test_every_step_of_the_issue_is_there_with_the_agreed_commands() -> None:
    gc = _load()
    assert gc.ORDER == ["deps", "device", "tests", "confined", "launch", "flr", "sched", "share",
                        "netgpu", "isolation", "demo"]  # fmt: skip
    assert gc.BENCHES["share"] == ["bench", "sched", "--backend", "cuda", "--quick", "--json",
                                   "--weights", "1:3,3:1,1:1,1:2:3:4"]  # fmt: skip
    assert gc.BENCHES["isolation"][:4] == ["bench", "isolation", "--backend", "cuda"]
    assert gc.BENCHES["demo"][:3] == ["demo", "--backend", "cuda"]
    # confinement first, so the benches know whether to fall back to sandbox off
    assert gc.ORDER.index("confined") < min(gc.ORDER.index(b) for b in gc.BENCHES)


def test_the_gpu_tests_and_the_confined_selection_exist() -> None:
    gc = _load()
    files = gc.gpu_test_files()
    assert {"tests/test_cuda_gpu.py", "tests/test_cuda_gpu_whole.py"} <= set(files)
    confinement = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(gc.CONFINEMENT_TESTS))
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         *confinement, "-k", " or ".join(gc.CONFINED_K)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    ids = [ln for ln in r.stdout.splitlines() if "::" in ln]
    for term in gc.CONFINED_K:
        assert any(term in i for i in ids), f"-k {term} selects no test: {r.stdout[-2000:]}"


def test_a_carried_bwrap_is_found_by_the_steps() -> None:
    env = _load().environment()
    carried = str(ROOT / ".gpu-deps" / "bin")
    assert env["GPUVIRT_TOOL_PATH"] == carried and env["PATH"].startswith(carried)


def test_a_rerun_of_some_steps_records_them_and_keeps_its_own_file(tmp_path: Path) -> None:
    # deps and device on this machine (no CuPy): deps says what is missing, device is
    # not run for it; the JSON says which steps were asked for.
    out = tmp_path / "check.json"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "device,deps", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert report["only"] == ["deps", "device"] and list(report["steps"]) == ["deps", "device"]
    if "cupy" in report["steps"]["deps"]["missing"]:
        assert r.returncode == 1 and report["all_ok"] is False
        assert report["steps"]["device"]["error"].startswith("not run: missing")
    assert "bwrap" in report["steps"]["deps"]


def test_the_report_puts_each_figure_beside_emu_and_native(tmp_path: Path) -> None:
    from gpuvirt.bench.gpu_report import render

    # the shape a run's JSON has (a test input: not a result of any device)
    check = {"date": "2026-12-05T10:00:00+00:00", "all_ok": False, "steps": {
        "launch": {"ok": True, "seconds": 9.0, "result": {
            "bench": "launch", "p50_us": 30.0, "floor_p50_us": 12.0,
            "targets": {"ratio_p50": {"value": 2.5, "target": "<= 3", "met": True}}}},
        "flr": {"ok": False, "error": "timed out"}}}  # fmt: skip
    emu = [{"bench": "launch", "p50_us": 20.5, "targets": {"ratio_p50": {"value": 0.3}}}]
    md = render(check, emu)
    assert "| p50_us | 30 | 20.5 | 12 |" in md
    assert "| target ratio_p50 <= 3 | 2.5 | 0.3 | met |" in md
    assert "| flr | False | - | timed out |" in md
