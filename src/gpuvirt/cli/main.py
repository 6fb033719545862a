"""The `gpuvirt` command."""

from __future__ import annotations

import typer

from gpuvirt.cli import k8s, netgpu, vf
from gpuvirt.cli.host_cmd import host

app = typer.Typer(
    name="gpuvirt",
    help="GPU virtualization host: carve one GPU into isolated virtual GPUs (VFs).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command()(host)
app.add_typer(vf.app, name="vf")
app.add_typer(netgpu.app, name="netgpu")
app.add_typer(k8s.app, name="k8s")


def _register_optional() -> None:
    # Each of these modules registers its own commands on `app`.
    from gpuvirt.cli import bench, demo, events, k8s_dra, top  # noqa: F401


_register_optional()
