"""`gpuvirt vf ...`: show and manage VFs through the admin endpoint."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from gpuvirt.cli.common import ConfigOpt, JsonOpt, admin, call, cell, console, fail, print_json
from gpuvirt.config import format_size

app = typer.Typer(help="Show and manage virtual functions.", no_args_is_help=True)

STATE_STYLE = {
    "ACTIVE": "green", "AVAIL": "cyan", "FULLACCESS": "yellow", "SUSPEND": "blue",
    "RESETTING": "magenta", "QUARANTINED": "bold red", "FAILED": "bold red", "UNAVAIL": "dim",
}  # fmt: skip
Index = Annotated[int, typer.Argument(help="VF index", min=0, max=30)]


def vf_table(vfs: list[dict[str, Any]], title: str | None = None) -> Table:
    t = Table(title=title, header_style="bold")
    for col in ("VF", "state", "guest", "weight", "share cfg", "share now", "dev/wall",
                "FB used", "FB", "ctx", "launches", "FLRs", "guard", "engine"):  # fmt: skip
        t.add_column(col, justify="right" if col not in ("state", "guard", "engine") else "left")
    for v in vfs:
        g = v["guard"]
        t.add_row(
            str(v["index"]),
            f"[{STATE_STYLE.get(v['state'], '')}]{v['state']}[/]",
            str(v["guest_pid"] or "-"),
            f"{v['weight']:g}",
            f"{100 * v['configured_share']:.1f}%",
            f"{100 * v['achieved_share']:.1f}%",
            _disagreement(v),
            format_size(v["fb_used"]) if v["fb_used"] else "0",
            format_size(v["fb_total"]),
            # The engine's CUDA context, outside the FB (cuda); JSON also has scratch_bytes.
            format_size(v["context_bytes"]) if v["context_bytes"] else "-",
            str(v["launches_completed"]),
            str(v["flr_count"]),
            "TRIPPED" if g["tripped"] else f"{g['recent_flrs']}/{g['limit']}",
            # an unconfined engine is said on every line (engine.sandbox = "off")
            "confined" if v.get("sandbox") == "confined" else "[bold red]UNCONFINED[/]",
        )
    return t


def _disagreement(v: dict[str, Any]) -> str:
    """The gap between the device's own measure of the VF's device time and the wall
    clock's (cuda), flagged past 1 pp; '-' where the device's time is the wall clock."""
    pp = v.get("disagree_pp")
    if pp is None:
        return "-"
    return f"[bold red]{pp:.1f}pp ![/]" if v.get("device_disagrees") else f"{pp:.1f}pp"


@app.command("list")
def list_(config: ConfigOpt = None, json: JsonOpt = False) -> None:
    """Every VF: state, guest, shares, FB use, launches, FLRs."""
    st = call(admin(config).status)
    if json:
        print_json(st["vfs"])
    else:
        console.print(vf_table(st["vfs"], f"gpuvirt {st['backend']} · policy {st['policy']}"))


@app.command()
def show(index: Index, config: ConfigOpt = None, json: JsonOpt = False) -> None:
    """One VF in detail."""
    v = call(admin(config).vf, index)
    if json:
        print_json(v)
        return
    t = Table(show_header=False, title=f"VF{index}")
    t.add_column(style="bold")
    t.add_column()
    for k, val in v.items():
        t.add_row(cell(k), cell(val))  # driver_version is the guest's own text
    console.print(t)


def _action(name: str, doc: str) -> None:
    def run(index: Index, config: ConfigOpt = None, json: JsonOpt = False) -> None:
        v = call(admin(config).vf, index, name)
        if json:
            print_json(v)
        else:
            console.print(f"VF{index}: {name} done; state [bold]{v['state']}[/]")

    run.__doc__ = doc
    app.command(name)(run)


for _name, _doc in (
    ("enable", "Enable a VF: carve its FB and start its engine."),
    ("disable", "Disable a VF: detach its guest, stop its engine, scrub its FB."),
    ("reset", "Reset a VF (FLR): its guest is notified and re-initializes."),
    ("clear-fb", "Scrub a VF's FB (only while it has no guest)."),
    ("clear-guard", "Clear a VF's FLR guard; a quarantined VF becomes available."),
):
    _action(_name, _doc)


@app.command("set")
def set_(
    index: Index,
    fb: Annotated[
        str | None,
        typer.Option(help="New FB size, e.g. 512MiB (only while the VF has no guest)."),
    ] = None,
    weight: Annotated[
        float | None, typer.Option(help="New weight under the weighted policy (any time).")
    ] = None,
    config: ConfigOpt = None,
    json: JsonOpt = False,
) -> None:
    """Reconfigure a VF at run time: its FB (re-carved and scrubbed) and its weight."""
    if fb is None and weight is None:
        raise fail("nothing to set: give --fb SIZE, --weight W or both", 2)
    v = call(admin(config).vf_set, index, fb, weight)
    if json:
        print_json(v)
    else:
        console.print(
            f"VF{index}: FB {format_size(v['fb_total'])}, weight {v['weight']:g}; "
            f"state [bold]{v['state']}[/]"
        )
