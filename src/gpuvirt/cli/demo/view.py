"""The demo on screen: the live view while it runs and the summary at the end."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gpuvirt.cli import events as events_cli
from gpuvirt.cli import top as top_cli
from gpuvirt.cli.demo.knobs import PLAIN_FRAME_S
from gpuvirt.cli.demo.run import Run


class View:
    """The live view: `gpuvirt top`'s frame plus each guest's progress and recent events."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.rates = top_cli.RateTracker()
        self.dev = top_cli.DeviceRates()
        self.vfs: dict[int, top_cli.VFRates] = {}

    def observe(self, run: Run) -> None:
        """Every tick, shown or not: rates need successive samples of the same guests."""
        if run.status:
            self.dev, self.vfs = self.rates.update(run.status)

    def render(self, run: Run) -> RenderableType:
        parts: list[RenderableType] = [self._header(run)]
        if run.status:
            dev, vfs = self.dev, self.vfs
            extra: dict[str, dict[int, RenderableType]] = {"role": {}, "verified": {}, "wrong": {}}
            for g in run.guests:
                extra["role"][g.vf] = g.role
                extra["verified"][g.vf] = str(g.last.get("verified", 0))
                wrong = g.last.get("failed", 0)
                extra["wrong"][g.vf] = Text(str(wrong), style="bold red" if wrong else "")
            parts.append(top_cli.frame(run.status, dev, vfs, extra))
        recent = [e for e in run.events if e["category"] in ("reset", "guard")][-6:]
        if recent:
            parts.append(Text("recent events", style="bold"))
            parts.extend(events_cli.event_text(e) for e in recent)
        return Group(*parts)

    def _header(self, run: Run) -> Text:
        t = Text("gpuvirt demo", style="bold")
        if run.t0:
            t.append(f" · {time.monotonic() - run.t0:.0f}/{run.duration:g} s")
        t.append(f" · {run.phase}")
        seen = next((g.incidents for g in run.guests if g.role == "hostile"), {})
        for kind in run.sent:
            h = seen.get(kind, {})
            if "recovered" in h:
                state = "recovered"
            elif "error" in h:
                state = "reset, coming back"
            elif h:
                state = "waiting for the host"
            else:
                state = "sent"
            t.append(f" · {kind}: {state}")
        if run.sender is not None:
            t.append(f" · NetGPU stream: {top_cli.human_bytes(run.sender.sent)} sent")
        elif run.netgpu_skip:
            t.append(f" · NetGPU: skipped ({run.netgpu_skip})")
        return t


def summary_view(s: dict[str, Any]) -> Group:
    parts: list[RenderableType] = []
    t = Table(
        title=f"shares of device time (policy weighted, {s['backend']})",
        title_justify="left",
        header_style="bold",
    )
    for c in ("VF", "weight", "configured", "achieved (run)", "achieved (steady)", "error"):
        t.add_column(c, justify="right")
    for r in s["shares"]:
        steady = r["achieved_steady"]
        t.add_row(
            f"VF{r['vf']}", f"{r['weight']:g}", f"{100 * r['configured']:.1f}%",
            f"{100 * r['achieved']:.1f}%", "-" if steady is None else f"{100 * steady:.1f}%",
            f"{r['error_pp']:+.1f} pp",
        )  # fmt: skip
    parts.append(t)
    t = Table(title="work verified in each VF", title_justify="left", header_style="bold")
    for c in ("VF", "role", "verified", "wrong", "GFLOP", "resets", "after reset", "lost", "ok"):
        t.add_column(c, justify="left" if c in ("role", "ok") else "right")
    for r in s["work"]:
        t.add_row(
            f"VF{r['vf']}", r["role"], str(r["verified"]), str(r["failed"]), f"{r['gflop']:.1f}",
            str(r["resets"]), str(r["verified_after_reset"]), str(r["lost_to_reset"]),
            Text("yes", style="green") if r["ok"] else Text("NO", style="bold red"),
        )  # fmt: skip
    parts.append(t)
    n = s["netgpu"]
    if n["status"] == "skipped":
        parts.append(Text(f"NetGPU: skipped ({n['reason']})", style="yellow"))
    else:
        style = "green" if n["status"] == "verified" else "bold red"
        parts.append(Text(
            f"NetGPU on VF{n['vf']}: {n['bytes_received']:,} of {n['bytes_sent']:,} bytes received "
            f"into device memory; sha256 {n['sha256_received'][:16]}… "
            f"{'matches' if n['status'] == 'verified' else 'DOES NOT match'} the sender's",
            style=style,
        ))  # fmt: skip
    t = Table(title="FLRs", title_justify="left", header_style="bold")
    for c in ("VF", "incident", "reason", "total", "steps (ms)", "guest: caught after",
              "guest: back after"):  # fmt: skip
        t.add_column(c, justify="left" if c in ("incident", "reason", "steps (ms)") else "right")
    seen = {w["vf"]: w.get("incidents", {}) for w in s["work"]}
    for f in s["flrs"]:
        h = seen.get(f["vf"], {}).get(f.get("incident", ""), {})
        t.add_row(
            f"VF{f['vf']}", f.get("incident", "-"), f["reason"] or "?",
            "-" if f["total_ms"] is None else f"{f['total_ms']:.1f} ms",
            ", ".join(f"{k} {v:.1f}" for k, v in f["steps_ms"].items()),
            _ms_text(h.get("caught_after_ms")), _ms_text(h.get("back_after_ms")),
        )  # fmt: skip
    parts.append(t if s["flrs"] else Text("FLRs: none", style="bold red"))
    sc = s["sched"]
    parts.append(Text(
        f"world switches: {sc['switches']}, p50 {sc['switch_p50_us']} µs, "
        f"p99 {sc['switch_p99_us']} µs, "
        f"{sc['lost_pct']}% of device time lost to switching; {s['wall_s']} s in all",
        style="dim",
    ))  # fmt: skip
    if s["ok"]:
        parts.append(Text("everything verified", style="bold green"))
    else:
        parts.append(Text("verification FAILED:", style="bold red"))
        parts.extend(Text(f"  {f}", style="red") for f in s["failures"])
    return Group(*parts)


def _ms_text(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


@contextlib.contextmanager
def screen(json: bool) -> Iterator[Callable[[Run], None]]:
    """Where the live view goes: a terminal gets it in place; a log gets a frame now and then."""
    console = top_cli.make_console(stderr=json)
    if json and not console.is_terminal:
        yield lambda run: None
        return
    view = View(console)
    if console.is_terminal:
        with Live(console=console, auto_refresh=False, transient=False) as live:

            def live_show(run: Run) -> None:
                view.observe(run)
                live.update(view.render(run), refresh=True)

            yield live_show
        return
    last = [0.0]

    def plain(run: Run) -> None:
        view.observe(run)
        if time.monotonic() - last[0] >= PLAIN_FRAME_S or run.phase == "done":
            last[0] = time.monotonic()
            console.print(view.render(run))
            console.print()

    yield plain
