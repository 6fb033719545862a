"""`gpuvirt host`: run the daemon."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from gpuvirt.cli.common import ConfigOpt, config_or_exit, fail
from gpuvirt.errors import GpuvirtError


def host(
    config: ConfigOpt = None,
    backend: Annotated[str | None, typer.Option(help="emu | cuda")] = None,
    vf_num: Annotated[int | None, typer.Option(help="Number of VFs (1..31).")] = None,
    fb_total: Annotated[str | None, typer.Option(help="Device memory to carve, e.g. 2GiB.")] = None,
    policy: Annotated[str | None, typer.Option(help="fairness|round_robin|liquid|weighted")] = None,
    time_slice_ms: Annotated[float | None, typer.Option(help="World-switch slice.")] = None,
    socket: Annotated[Path | None, typer.Option(help="Mailbox socket path.")] = None,
    admin: Annotated[str | None, typer.Option(help="Admin socket path or HOST:PORT.")] = None,
    state_dir: Annotated[Path | None, typer.Option(help="Event log and tokens.")] = None,
    print_config: Annotated[
        bool, typer.Option("--print-config", help="Print the effective configuration and exit.")
    ] = False,
    ready_file: Annotated[
        Path | None, typer.Option(help="Write the pid here once the host serves.", hidden=True)
    ] = None,
) -> None:
    """Run the host daemon (the PF driver) in the foreground."""
    overrides = {
        "device.backend": backend, "sriov.vf_num": vf_num, "device.fb_total": fb_total,
        "scheduler.policy": policy, "scheduler.time_slice_ms": time_slice_ms,
        "host.socket": str(socket) if socket else None, "host.admin": admin,
        "host.state_dir": str(state_dir) if state_dir else None,
    }  # fmt: skip
    cfg = config_or_exit(config, {k: v for k, v in overrides.items() if v is not None})
    if print_config:
        typer.echo(cfg.dump_toml())
        return
    from gpuvirt.host.daemon import run_host

    try:
        asyncio.run(run_host(cfg, ready_file))
    except GpuvirtError as e:
        raise fail(str(e), 2) from None
