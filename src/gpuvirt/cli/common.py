"""What every command shares: finding the configuration and the host, printing."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from gpuvirt.admin_client import AdminClient
from gpuvirt.config import HostConfig, load_config
from gpuvirt.errors import GpuvirtError
from gpuvirt.text import printable, printable_data

# Off a terminal rich assumes 80 columns, which folds the VF tables; pipes and logs
# get the width `top` uses there too.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, highlight=False)

ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", help="Host configuration (default: $GPUVIRT_CONFIG, "
        "/etc/gpuvirt/gpuvirt.toml, built-in defaults)", show_default=False,
    ),
]  # fmt: skip
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def fail(message: str, code: int = 1) -> typer.Exit:
    # One line however long (logs and scripts grep it), not folded at 80 columns.
    err_console.print(f"[bold red]error:[/] {escape(printable(message))}", soft_wrap=True)
    return typer.Exit(code)


def config_or_exit(path: Path | None, overrides: dict[str, Any] | None = None) -> HostConfig:
    try:
        return load_config(path, overrides)
    except GpuvirtError as e:
        raise fail(str(e), 2) from None


def admin(path: Path | None) -> AdminClient:
    cfg = config_or_exit(path)
    return AdminClient.of(cfg.host, create=False)


def call(fn: Any, *args: Any) -> Any:
    """Run a client call; a GpuvirtError becomes a clean message and exit code 1."""
    try:
        return fn(*args)
    except GpuvirtError as e:
        raise fail(str(e)) from None


def print_json(obj: Any) -> None:
    # the host escapes what tenants write (gpuvirt.text); so does every printer, so
    # that `jq -r` of any field cannot reach a terminal's controls either
    sys.stdout.write(json.dumps(printable_data(obj), indent=2, default=str) + "\n")


def cell(value: Any) -> Text:
    """A value as a table cell: escaped, and rich Text, so `[link=...]` in it is letters."""
    return Text(printable(value))
