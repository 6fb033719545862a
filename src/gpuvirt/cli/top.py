"""`gpuvirt top`: a live view of the device and every VF, refreshed in place.

The frame is built from the admin endpoint's /status only, so `top` works
against any host it can reach and never slows the host down: one small JSON
request per refresh. Rates (launches/s, NetGPU bytes/s, switches/s) are the
difference of the host's counters between refreshes; the renderer here is
shared with `gpuvirt demo`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gpuvirt.admin_client import AdminClient
from gpuvirt.cli.common import ConfigOpt, JsonOpt, admin, fail, print_json
from gpuvirt.errors import GpuvirtError
from gpuvirt.text import printable

STATE_STYLE = {
    "ACTIVE": "green", "AVAIL": "cyan", "FULLACCESS": "yellow", "SUSPEND": "blue",
    "RESETTING": "magenta", "QUARANTINED": "bold red", "FAILED": "bold red", "UNAVAIL": "dim",
}  # fmt: skip
# Launch and NetGPU counters reach the host through the VF2PF block, which a
# guest rewrites every 2 s; a rate over a shorter window would swing between
# zero and double. Five seconds also matches the host's achieved-share window.
RATE_WINDOW_S = 5.0
# A pipe or a file has no width; rich would assume 80 columns and fold the VF table.
PLAIN_WIDTH = 160


def make_console(stderr: bool = False) -> Console:
    """A console that is plain (no colour, no cursor moves) off a terminal or with NO_COLOR."""
    probe = Console(stderr=stderr)
    if probe.is_terminal:
        return Console(stderr=stderr, highlight=False)
    width = int(os.environ.get("COLUMNS", "0") or 0) or PLAIN_WIDTH
    return Console(stderr=stderr, highlight=False, width=width, no_color=True)


def quiet_broken_pipe() -> None:
    """`gpuvirt top | head` closed the pipe: stop without a traceback at exit either."""
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# ---- rates --------------------------------------------------------------------------


@dataclass
class VFRates:
    launches_per_s: float | None = None
    netgpu_bytes_per_s: float | None = None


@dataclass
class DeviceRates:
    switches_per_s: float | None = None


class RateTracker:
    """Per-second rates from successive /status samples.

    A counter that goes down belongs to a new guest or a reset VF (launch and
    NetGPU counters are the guest's own), so that VF's history starts over
    rather than showing a negative rate.
    """

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._vf: dict[int, deque[tuple[float, int, int, Any]]] = {}
        self._dev: deque[tuple[float, int, Any]] = deque()

    def update(
        self, status: Mapping[str, Any], now: float | None = None
    ) -> tuple[DeviceRates, dict[int, VFRates]]:
        now = time.monotonic() if now is None else now
        pid = status.get("pid")
        self._dev = _append(self._dev, (now, status["sched"]["switches"], pid), now, self.window_s)
        dev = DeviceRates(_rate(self._dev, 1))
        out: dict[int, VFRates] = {}
        for v in status["vfs"]:
            key = (pid, v.get("guest_pid"), v.get("flr_count"))
            sample = (now, int(v["launches_completed"]), int(v["netgpu_rx_bytes"]), key)
            hist = _append(self._vf.get(v["index"], deque()), sample, now, self.window_s)
            self._vf[v["index"]] = hist
            out[v["index"]] = VFRates(_rate(hist, 1), _rate(hist, 2))
        return dev, out


def _append(hist: deque[Any], sample: tuple[Any, ...], now: float, window: float) -> deque[Any]:
    # The last element of a sample identifies the counter's owner; a new owner starts over.
    if hist and (hist[-1][-1] != sample[-1] or any(s < h for s, h in _counts(sample, hist[-1]))):
        hist = deque()
    hist.append(sample)
    # Keep one sample at or beyond the window's start so the rate spans the whole window.
    while len(hist) > 2 and hist[1][0] <= now - window:
        hist.popleft()
    return hist


def _counts(new: tuple[Any, ...], old: tuple[Any, ...]) -> list[tuple[int, int]]:
    return list(zip(new[1:-1], old[1:-1], strict=True))


def _rate(hist: deque[Any], field: int) -> float | None:
    if len(hist) < 2 or hist[-1][0] <= hist[0][0]:
        return None
    return (hist[-1][field] - hist[0][field]) / (hist[-1][0] - hist[0][0])


# ---- formatting ---------------------------------------------------------------------


def human_bytes(n: float | None, suffix: str = "") -> str:
    """Three significant digits: a table cell, not an exact figure (see config.format_size)."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}{suffix}"
    return f"{n:.0f} B{suffix}"


def human_duration(s: float) -> str:
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def guard_text(g: Mapping[str, Any]) -> Text:
    if g["tripped"]:
        return Text("TRIPPED", style="bold red")
    return Text(f"{g['recent_flrs']}/{g['limit']}", style="yellow" if g["recent_flrs"] else "")


# ---- the frame ----------------------------------------------------------------------


def device_table(status: Mapping[str, Any], rates: DeviceRates | None = None) -> Table:
    sc = status["sched"]
    t = Table(title="gpuvirt top", title_justify="left", header_style="bold", expand=False)
    for col in ("backend", "policy", "slice", "uptime", "switches", "switches/s", "lost",
                "switch p50", "switch p99", "host RSS", "engines"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("backend", "policy", "engines") else "right")
    confined = status.get("sandbox", {}).get("confined", False)
    t.add_row(
        status["backend"],
        status["policy"],
        f"{status['time_slice_ms']:g} ms",
        human_duration(status["uptime_s"]),
        str(sc["switches"]),
        _num(rates.switches_per_s if rates else None, "{:.0f}"),
        f"{sc['lost_pct']:.2f}%",
        _num(sc["switch_p50_us"], "{:.0f} µs"),
        _num(sc["switch_p99_us"], "{:.0f} µs"),
        human_bytes(status["host_rss_bytes"]),
        "confined" if confined else "[bold red]UNCONFINED[/]",
    )
    return t


def vf_table(
    status: Mapping[str, Any],
    rates: Mapping[int, VFRates] | None = None,
    extra: Mapping[str, Mapping[int, RenderableType]] | None = None,
) -> Table:
    """One row per VF; `extra` adds columns (name → VF index → cell), as the demo does."""
    rates = rates or {}
    extra = extra or {}
    t = Table(header_style="bold", expand=False)
    window = next((v["guard"]["window_s"] for v in status["vfs"]), 0)
    cols = ["VF", "state", "guest", "weight", "share cfg", "share now", "FB used/total",
            "launch/s", "FLRs", f"guard/{window:g}s", "NetGPU/s", *extra]  # fmt: skip
    for col in cols:
        t.add_column(
            col, justify="left" if col in ("VF", "state", "role") else "right", no_wrap=True
        )
    for v in status["vfs"]:
        i = v["index"]
        r = rates.get(i, VFRates())
        state = v["state"]
        t.add_row(
            f"VF{i}",
            Text(state, style=STATE_STYLE.get(state, "")),
            str(v["guest_pid"] or "-"),
            f"{v['weight']:g}",
            _pct(v["configured_share"]),
            _pct(v["achieved_share"]),
            f"{human_bytes(v['fb_used'])} / {human_bytes(v['fb_total'])}",
            _num(r.launches_per_s),
            str(v["flr_count"]),
            guard_text(v["guard"]),
            human_bytes(r.netgpu_bytes_per_s, "/s"),
            *(extra[c].get(i, "") for c in extra),
        )
    return t


def last_flrs(status: Mapping[str, Any]) -> Text | None:
    lines = []
    for v in status["vfs"]:
        f = v.get("last_flr")
        if f:
            steps = ", ".join(f"{k} {ms:.1f}" for k, ms in f.get("steps", {}).items())
            line = f"VF{v['index']} last FLR: {f['reason']}, {f['total_ms']:.1f} ms ({steps} ms)"
            lines.append(printable(line))  # a reason may carry an engine's (tenant's) words
    return Text("\n".join(lines), style="dim") if lines else None


def frame(
    status: Mapping[str, Any],
    dev_rates: DeviceRates | None = None,
    vf_rates: Mapping[int, VFRates] | None = None,
    extra: Mapping[str, Mapping[int, RenderableType]] | None = None,
) -> Group:
    parts: list[RenderableType] = [
        device_table(status, dev_rates),
        vf_table(status, vf_rates, extra),
    ]
    flrs = last_flrs(status)
    if flrs is not None:
        parts.append(flrs)
    return Group(*parts)


def error_frame(message: str) -> Text:
    return Text(f"gpuvirt top: {printable(message)}", style="bold red")


def with_rates(
    status: dict[str, Any], dev: DeviceRates, vfs: Mapping[int, VFRates]
) -> dict[str, Any]:
    """Status as JSON with the rates top computed, for `--json`."""
    out = dict(status)
    out["sched"] = {**status["sched"], "switches_per_s": dev.switches_per_s}
    out["vfs"] = [
        {
            **v,
            "launches_per_s": vfs[v["index"]].launches_per_s,
            "netgpu_rx_bytes_per_s": vfs[v["index"]].netgpu_bytes_per_s,
        }
        for v in status["vfs"]
    ]
    return out


# ---- the command --------------------------------------------------------------------


def top(
    config: ConfigOpt = None,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
    interval: Annotated[
        float, typer.Option("--interval", "-d", min=0.1, help="Seconds between refreshes.")
    ] = 1.0,
    json: JsonOpt = False,
) -> None:
    """Live view: the device and every VF (state, shares, FB, launches/s, FLRs, guard, NetGPU)."""
    client = admin(config)
    tracker = RateTracker()
    if once:
        try:
            st = client.status()
        except GpuvirtError as e:
            raise fail(str(e)) from None
        dev, vfs = tracker.update(st)
        if json:
            print_json(with_rates(st, dev, vfs))
        else:
            make_console().print(frame(st, dev, vfs))
        return
    try:
        if json:
            _loop_json(client, tracker, interval)
        else:
            _loop_view(client, tracker, interval)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        quiet_broken_pipe()


Sample = tuple[dict[str, Any], DeviceRates, dict[int, VFRates]]


def _sample(client: AdminClient, tracker: RateTracker) -> tuple[Sample | None, str]:
    """One /status with its rates, or why there is none (the host may be restarting)."""
    try:
        st = client.status()
    except GpuvirtError as e:
        return None, str(e)
    dev, vfs = tracker.update(st)
    return (st, dev, vfs), ""


def _loop_json(client: AdminClient, tracker: RateTracker, interval: float) -> None:
    import json as json_mod

    while True:
        got, err = _sample(client, tracker)
        line = {"error": err} if got is None else with_rates(*got)
        sys.stdout.write(json_mod.dumps(line, default=str) + "\n")
        sys.stdout.flush()
        time.sleep(interval)  # the refresh period the operator asked for


def _loop_view(client: AdminClient, tracker: RateTracker, interval: float) -> None:
    console = make_console()
    if not console.is_terminal:
        # Batch mode (a pipe, a log): frames one after another, like `top -b`.
        while True:
            got, err = _sample(client, tracker)
            console.print(error_frame(err) if got is None else frame(*got))
            console.print()
            time.sleep(interval)
    with Live(console=console, auto_refresh=False, screen=False) as live:
        while True:
            got, err = _sample(client, tracker)
            live.update(error_frame(err) if got is None else frame(*got), refresh=True)
            time.sleep(interval)
