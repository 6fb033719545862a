"""The `gpuvirt` command: every subcommand registered in one place.

Subcommand modules define plain functions (or their own Typer groups) and
never import this module, so there is no cycle between the app and them.
"""

from __future__ import annotations

import typer

from gpuvirt.cli import bench, events, k8s, netgpu, top, vf
from gpuvirt.cli.demo.command import demo
from gpuvirt.cli.host_cmd import host

app = typer.Typer(
    name="gpuvirt",
    help="GPU virtualization host: carve one GPU into isolated virtual GPUs (VFs).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
for command in (host, top.top, events.events, bench.bench, demo):
    app.command()(command)
app.add_typer(vf.app, name="vf")
app.add_typer(netgpu.app, name="netgpu")
app.add_typer(k8s.app, name="k8s")
