"""`gpuvirt bench all --report DIR`: report.md with every suite's tables and PNG plots.

The suites themselves are measured elsewhere; here Results are built by hand
with the series the suites record, so the report is checked in a second.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from gpuvirt.bench.common import Result, Target
from gpuvirt.bench.report import write_report

PNG = b"\x89PNG\r\n\x1a\n"


def sched_result(series: bool = True) -> Result:
    rng = random.Random(1)
    t = [0.5 * i for i in range(1, 21)]
    weights = [1, 2, 3, 4]
    configured = {f"vf{i}": w / 10 for i, w in enumerate(weights)}
    over_time = {vf: [c + rng.gauss(0, 0.01) for _ in t] for vf, c in configured.items()}
    return Result(
        bench="sched",
        backend="emu",
        figures={"switch_p50_us": 90.0, "share_configured": configured},
        targets=[Target("switch_p50_us", 90.0, 150, "<="), Target("jain_equal", 0.95, 0.99, ">=")],
        rows=[
            ("world switch p50", 90.0, "µs"),
            ("VF0 weight 1: achieved | configured", "9.9% / 10%", "share"),
        ],
        notes=["2 cores; noisy"],
        series=(
            {
                "switch_latency_us": [rng.lognormvariate(4.5, 0.6) for _ in range(3000)],
                "shares_over_time": {"t": t, **over_time},
                "weights": weights,
            }
            if series
            else {}
        ),
    )


def netgpu_result() -> Result:
    rows = [
        {"path": p, "streams": s, "gbytes_per_s": g, "cpu_s_per_gb": c}
        for p, g, c in (("zerocopy", 2.0, 0.3), ("raw", 2.1, 0.3), ("copy", 1.1, 0.6))
        for s in (1, 4)
    ]
    return Result("netgpu", "emu", {"rows": rows, "throughput_ratio": 0.95}, series={"rows": rows})


def launch_result() -> Result:
    launch = [60.0 + i % 7 for i in range(500)]
    floor = [40.0 + i % 5 for i in range(500)]
    return Result(
        "launch",
        "emu",
        {"p50_us": 60.0},
        rows=[("launch round trip p50", 60.0, "µs")],
        series={"launch_us": launch, "floor_us": floor},
    )


@pytest.mark.timeout(60)
def test_report_has_tables_and_plots(tmp_path: Path) -> None:
    results = [launch_result(), sched_result(), netgpu_result(), Result("flr", "emu", {})]
    path = write_report(results, tmp_path / "report")
    assert path == tmp_path / "report" / "report.md"
    md = path.read_text()
    for suite in ("launch", "sched", "netgpu", "flr"):
        assert f"\n## {suite}\n" in md
    assert "| world switch p50 | 90 | µs |" in md
    assert "achieved \\| configured" in md, "a | in a cell must not break the table"
    assert "| jain_equal | 0.95 | >= 0.99 | **no** |" in md
    assert "| [sched](#sched) | emu | 1/2 ✗ |" in md
    assert "> 2 cores; noisy" in md
    assert "_This suite recorded no figures._" in md
    pngs = (
        "sched_shares.png",
        "sched_switch_latency.png",
        "netgpu_throughput.png",
        "launch_latency.png",
    )
    for name in pngs:
        assert f"]({name})" in md
        assert (path.parent / name).read_bytes()[:8] == PNG
    data = json.loads((path.parent / "report.json").read_text())
    assert [d["bench"] for d in data] == ["launch", "sched", "netgpu", "flr"]


@pytest.mark.timeout(60)
def test_report_says_when_a_series_is_missing(tmp_path: Path) -> None:
    path = write_report([sched_result(series=False), Result("netgpu", "emu", {})], tmp_path)
    md = path.read_text()
    assert "No shares-over-time series in this run" in md
    assert "No world-switch latency series in this run" in md
    assert "No NetGPU throughput rows in this run" in md
    assert not list(tmp_path.glob("*.png"))
