"""scripts/gpu-check's own plan: every step's limit fits its budget, so none is skipped."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-check"


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
