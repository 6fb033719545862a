"""`gpuvirt bench NAME [--json]`: run a benchmark suite, print a table or JSON."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from gpuvirt.bench import LONG, SUITES
from gpuvirt.bench.common import SANDBOX_ENV, Result
from gpuvirt.bench.sched_wait import parse_weights
from gpuvirt.cli.common import JsonOpt, console, fail, print_json
from gpuvirt.errors import DeviceError


def run_suite(name: str, quick: bool, backend: str, **knobs: float | str | None) -> Result:
    module = importlib.import_module(SUITES[name])
    given = {k: v for k, v in knobs.items() if v is not None}
    return module.run(quick=quick, backend=backend, **given)


def result_table(r: Result) -> Table:
    t = Table(title=f"bench {r.bench} · {r.backend}", header_style="bold")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_column("unit")
    for what, value, unit in r.rows:
        t.add_row(what, f"{value:.3g}" if isinstance(value, float) else str(value), unit)
    for tg in r.targets:
        mark = "[green]met[/]" if tg.met else "[red]missed[/]"
        t.add_row(f"target {tg.name} {tg.op} {tg.limit:g}", f"{tg.value:.3g}", mark)
    return t


def bench(
    name: Annotated[str, typer.Argument(help=f"One of: {', '.join(SUITES)}, all")],
    json: JsonOpt = False,
    quick: Annotated[bool, typer.Option(help="Shorter runs (for tests and smoke checks).")] = False,
    backend: Annotated[str, typer.Option(help="emu | cuda")] = "emu",
    report: Annotated[
        Path | None, typer.Option(help="With `all`: write report.md and plots here.")
    ] = None,
    sandbox: Annotated[
        str | None,
        typer.Option(
            help="engine.sandbox of the hosts benchmarked (required | off): "
            "run twice to measure what confinement costs"
        ),
    ] = None,
    minutes: Annotated[
        float | None,
        typer.Option(
            min=0.05, help="chaos: how long to inject faults (at least one of each kind)."
        ),
    ] = None,
    frames: Annotated[
        int | None, typer.Option(min=1, help="fuzz: how many frames to send.")
    ] = None,
    weights: Annotated[
        str | None,
        typer.Option(
            help="sched: only these weight sets, device-bound (e.g. 1:3,3:1,1:1,1:2:3:4)."
        ),
    ] = None,
) -> None:
    """Measure gpuvirt against baselines run side by side; ratios, not absolutes."""
    if sandbox is not None:
        os.environ[SANDBOX_ENV] = sandbox
    names = [n for n in SUITES if n not in LONG] if name == "all" else [name]
    if any(n not in SUITES for n in names):
        raise fail(f"unknown benchmark {name!r}; one of: {', '.join(SUITES)}, all", 2)
    if minutes is not None and name != "chaos":
        raise fail(f"--minutes is for `bench chaos`, not {name!r}", 2)
    if frames is not None and name != "fuzz":
        raise fail(f"--frames is for `bench fuzz`, not {name!r}", 2)
    if weights is not None:
        if name != "sched":
            raise fail(f"--weights is for `bench sched`, not {name!r}", 2)
        try:
            parse_weights(weights)
        except ValueError as e:
            raise fail(f"--weights: {e}", 2) from None
    results = []
    for n in names:
        try:
            r = run_suite(n, quick, backend, minutes=minutes, frames=frames, weights=weights)
        except DeviceError as e:  # the suite cannot run here (isolation without a GPU)
            raise fail(f"bench {n} --backend {backend} cannot run here: {e}", 2) from None
        results.append(r)
        if json:
            print_json(r.to_json())
        else:
            console.print(result_table(r))
            for note in r.notes:
                console.print(f"  note: {note}")
    if report is not None:
        from gpuvirt.bench.report import write_report

        path = write_report(results, report)
        if not json:
            console.print(f"report: {path}")
