"""`gpuvirt bench all --report DIR`: report.md with every suite's tables, and PNG plots.

Plots come from each Result's `series` (raw data the suites keep for this):
  sched   series["shares_over_time"] = {"t": [...], "vf0": [...], ...}, series["weights"],
          series["switch_latency_us"] = [...]
  launch  series["launch_us"], series["floor_us"]
  netgpu  series["rows"] (or figures["rows"]): {path, streams, gbytes_per_s, cpu_s_per_gb}
A series that is missing is said so in the report instead of a plot; a report
never fails for want of one. Matplotlib is drawn through its object API on
the Agg canvas (no pyplot, no display, no global backend switch).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gpuvirt
from gpuvirt.bench.common import Result, machine, percentile

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

SWITCH_TARGETS_US = {"p50 target": 150.0, "p99 target": 1000.0}  # DESIGN.md, "Performance"
PATH_ORDER = ("zerocopy", "raw", "copy")


def write_report(results: Sequence[Result], directory: Path) -> Path:
    """Write report.md, report.json and the plots into `directory`; return report.md's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plotter = _Plotter(directory)
    lines = _head(results)
    for r in results:
        lines += _section(r, plotter)
    path = directory / "report.md"
    path.write_text("\n".join(lines) + "\n")
    (directory / "report.json").write_text(
        json.dumps([r.to_json() for r in results], indent=2, default=str) + "\n"
    )
    return path


# ---- markdown ---------------------------------------------------------------------------


def _head(results: Sequence[Result]) -> list[str]:
    now = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    backends = ", ".join(sorted({r.backend for r in results})) or "-"
    lines = [
        "# gpuvirt benchmark report",
        "",
        f"{now} · gpuvirt {gpuvirt.__version__} · backend {backends} · "
        f"{platform.node()}: {os.cpu_count()} CPUs, {platform.machine()}, "
        f"Linux {platform.release()}, Python {platform.python_version()}",
        "",
        "machine: " + ", ".join(f"{k} {v}" for k, v in machine(backends).items()),
        "",
        "Each suite measures gpuvirt against a baseline run side by side in the same run; "
        "compare the ratios, not the absolute figures, across machines.",
        "",
        "| suite | backend | targets met |",
        "|---|---|---|",
    ]
    for r in results:
        met = sum(t.met for t in r.targets)
        verdict = "no targets" if not r.targets else f"{met}/{len(r.targets)}"
        mark = "" if r.targets_met else " ✗"
        lines.append(f"| [{r.bench}](#{r.bench}) | {r.backend} | {verdict}{mark} |")
    return [*lines, ""]


def _section(r: Result, plotter: _Plotter) -> list[str]:
    lines = [f"## {r.bench}", ""]
    if r.rows:
        lines += ["| measure | value | unit |", "|---|---:|---|"]
        lines += [f"| {_md(what)} | {_fmt(value)} | {_md(unit)} |" for what, value, unit in r.rows]
        lines.append("")
    if r.targets:
        lines += ["| target | value | limit | met |", "|---|---:|---|---|"]
        for t in r.targets:
            met = "yes" if t.met else "**no**"
            lines.append(f"| {t.name} | {_fmt(t.value)} | {t.op} {t.limit:g} | {met} |")
        lines.append("")
    spreads = r.figures.get("spread")
    if isinstance(spreads, dict) and spreads:
        rounds = r.figures.get("rounds", "?")
        lines += [f"Over {rounds} rounds (the headline is the median):", "",
                  "| figure | min | median | max |", "|---|---:|---:|---:|"]  # fmt: skip
        for name, v in spreads.items():
            if isinstance(v, list) and len(v) == 3:
                lines.append(f"| {_md(name)} | {_fmt(v[0])} | {_fmt(v[1])} | {_fmt(v[2])} |")
        lines.append("")
    for note in r.notes:
        lines.append(f"> {_md(note)}")
    if r.notes:
        lines.append("")
    if not (r.rows or r.targets or r.notes):
        lines += ["_This suite recorded no figures._", ""]
    for plot in _PLOTS.get(r.bench, ()):
        lines += plot(r, plotter)
    return lines


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if math.isfinite(value) else str(value)
    return _md(value)


# ---- plots ------------------------------------------------------------------------------


class _Plotter:
    """Saves figures into the report directory; knows when matplotlib is missing."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        try:
            from matplotlib.figure import Figure
        except ImportError:
            self.missing: str | None = (
                "matplotlib is not installed (`pip install gpuvirt[report]`); plots skipped"
            )
            self._figure: Callable[..., Figure] | None = None
        else:
            self.missing = None
            self._figure = Figure

    def save(self, name: str, title: str, draw: Callable[[Figure], None]) -> list[str]:
        if self._figure is None:
            return [f"_{title}: {self.missing}._", ""]
        fig = self._figure(figsize=(8, 4.2), layout="constrained")
        draw(fig)
        fig.savefig(self.directory / name, dpi=110)
        return [f"![{title}]({name})", ""]


def _missing(what: str, suite: str) -> list[str]:
    return [f"_No {what} in this run (the {suite} suite did not record one); plot skipped._", ""]


def _numbers(x: Any) -> list[float]:
    if not isinstance(x, Sequence) or isinstance(x, str | bytes):
        return []
    return [float(v) for v in x if isinstance(v, int | float) and math.isfinite(v)]


def _shares_plot(r: Result, p: _Plotter) -> list[str]:
    s = r.series.get("shares_over_time")
    if not isinstance(s, dict) or not _numbers(s.get("t")):
        return _missing("shares-over-time series", r.bench)
    t = _numbers(s["t"])
    vfs = sorted((k for k in s if k != "t"), key=lambda k: int(k[2:]) if k[2:].isdigit() else 0)
    configured = _configured_shares(r, vfs)

    def draw(fig: Figure) -> None:
        ax = fig.subplots()
        for vf in vfs:
            (line,) = ax.plot(t, _numbers(s[vf])[: len(t)], label=vf.upper())
            if vf in configured:
                ax.axhline(configured[vf], color=line.get_color(), linestyle="--", linewidth=0.8)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("share of device time")
        ax.set_title("Shares over time per VF (dashed: configured)")
        top = max((max(_numbers(s[vf]), default=0.0) for vf in vfs), default=1.0)
        ax.set_ylim(0, top * 1.3 or 1.0)  # headroom for the legend above the highest line
        ax.legend(loc="upper right", ncols=min(4, len(vfs)) or 1)
        ax.grid(alpha=0.3)

    return p.save("sched_shares.png", "Shares over time per VF", draw)


def _configured_shares(r: Result, vfs: list[str]) -> dict[str, float]:
    cfg = r.figures.get("share_configured")
    if isinstance(cfg, dict):
        return {k: float(v) for k, v in cfg.items()}
    weights = _numbers(r.series.get("weights"))
    if len(weights) == len(vfs) and sum(weights):
        return {vf: w / sum(weights) for vf, w in zip(vfs, weights, strict=True)}
    return {}


def _switch_plot(r: Result, p: _Plotter) -> list[str]:
    lat = [x for x in _numbers(r.series.get("switch_latency_us")) if x > 0]
    if not lat:
        return _missing("world-switch latency series", r.bench)

    def draw(fig: Figure) -> None:
        ax = fig.subplots()
        lo, hi = min(lat), max(lat)
        # Log bins: the body sits near 100 µs and the tail reaches milliseconds.
        edges = [lo * (hi / lo) ** (i / 60) for i in range(61)] if hi > lo else [lo * 0.9, hi * 1.1]
        ax.hist(lat, bins=edges, color="#4878a8")
        ax.set_xscale("log")
        _vline(ax, percentile(lat, 50), "p50", "black", "-")
        _vline(ax, percentile(lat, 99), "p99", "black", ":")
        for name, us in SWITCH_TARGETS_US.items():
            _vline(ax, us, name, "#c0392b", "--")
        ax.set_xlabel("world-switch latency (µs, log scale)")
        ax.set_ylabel("switches")
        ax.set_title(f"World-switch latency ({len(lat)} switches)")
        ax.legend(loc="upper right")

    return p.save("sched_switch_latency.png", "World-switch latency histogram", draw)


def _vline(ax: Axes, x: float, label: str, color: str, style: str) -> None:
    ax.axvline(x, color=color, linestyle=style, linewidth=1, label=f"{label} {x:.0f} µs")


def _launch_plot(r: Result, p: _Plotter) -> list[str]:
    launch, floor = _numbers(r.series.get("launch_us")), _numbers(r.series.get("floor_us"))
    if not launch:
        return _missing("launch latency series", r.bench)

    def draw(fig: Figure) -> None:
        ax = fig.subplots()
        for name, xs in (("launch round trip", launch), ("socket ping-pong (floor)", floor)):
            if xs:
                s = sorted(xs)
                ax.plot(s, [(i + 1) / len(s) for i in range(len(s))], label=name)
        ax.set_xscale("log")
        ax.set_xlabel("round trip (µs, log scale)")
        ax.set_ylabel("fraction of samples ≤ x")
        ax.set_title("Launch round trip against the socket ping-pong floor")
        ax.legend(loc="lower right")
        ax.grid(alpha=0.3)

    return p.save("launch_latency.png", "Launch round trip CDF", draw)


def _netgpu_plot(r: Result, p: _Plotter) -> list[str]:
    rows = r.series.get("rows") or r.figures.get("rows")
    if not isinstance(rows, list) or not all(isinstance(x, dict) for x in rows) or not rows:
        return _missing("NetGPU throughput rows", r.bench)
    paths = [x for x in PATH_ORDER if any(row.get("path") == x for row in rows)]
    paths += sorted({str(row.get("path")) for row in rows} - set(paths))
    streams = sorted({int(row.get("streams", 1)) for row in rows})

    def value(path: str, n: int, key: str) -> float:
        for row in rows:
            if row.get("path") == path and int(row.get("streams", 1)) == n:
                v = row.get(key)
                return float(v) if isinstance(v, int | float) else 0.0
        return 0.0

    def draw(fig: Figure) -> None:
        axes = fig.subplots(1, 2)
        width = 0.8 / max(1, len(paths))
        for ax, key, label in (
            (axes[0], "gbytes_per_s", "throughput (GB/s)"),
            (axes[1], "cpu_s_per_gb", "CPU seconds per GB"),
        ):
            for k, path in enumerate(paths):
                xs = [i + (k - (len(paths) - 1) / 2) * width for i in range(len(streams))]
                ax.bar(xs, [value(path, n, key) for n in streams], width, label=path)
            ax.set_xticks(range(len(streams)), [str(n) for n in streams])
            ax.set_xlabel("TCP streams")
            ax.set_ylabel(label)
            ax.grid(axis="y", alpha=0.3)
        axes[0].legend()
        fig.suptitle("NetGPU zero-copy receive against raw recv_into and the copying baseline")

    return p.save("netgpu_throughput.png", "NetGPU throughput against the baselines", draw)


_PLOTS: dict[str, tuple[Callable[[Result, _Plotter], list[str]], ...]] = {
    "sched": (_shares_plot, _switch_plot),
    "launch": (_launch_plot,),
    "netgpu": (_netgpu_plot,),
}
