"""`gpuvirt events`: the host's event log, optionally followed as it grows.

Events come from the admin endpoint's /events (the host keeps the most
recent few thousand in memory; the full log is <state_dir>/events.jsonl on
the host). `--follow` long-polls, so a new event is printed as soon as the
host emits it, with no polling interval in between.
"""

from __future__ import annotations

import json as json_mod
import re
import sys
import time
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Annotated, Any

import typer
from rich.text import Text

from gpuvirt.admin_client import AdminClient
from gpuvirt.cli.common import ConfigOpt, admin, err_console, fail
from gpuvirt.cli.top import make_console, quiet_broken_pipe
from gpuvirt.errors import GpuvirtError, HostUnreachableError
from gpuvirt.text import printable, printable_data

FIELDS = ("seq", "ts", "category", "kind", "vf", "message", "data")
CATEGORY_STYLE = {
    "state": "cyan", "mailbox": "yellow", "sched": "white", "reset": "magenta",
    "guard": "bold red", "admin": "blue", "host": "green",
}  # fmt: skip
# Larger than the host's in-memory ring, so one request returns all it has.
ALL = 1_000_000
LONG_POLL_S = 10.0  # the host answers at once when an event arrives; this only bounds a quiet wait
RETRY_S = 1.0  # between attempts to reach a host that went away while following

_AGO = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)", re.ASCII)
_AGO_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_since(text: str, now: float | None = None) -> float:
    """Epoch seconds for `--since`: an age like 30s, 5m, 1h30m, 2d, or an ISO 8601 time.

    An ISO time without a zone is local time, as the operator reads a clock.
    """
    now = time.time() if now is None else now
    s = text.strip()
    pos, total, matched = 0, 0.0, False
    for m in _AGO.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _AGO_UNITS[m.group(2)]
        pos, matched = m.end(), True
    if matched and pos == len(s):
        return now - total
    try:
        return datetime.fromisoformat(s).timestamp()
    except ValueError:
        raise ValueError(
            f"--since {text!r}: expected an age such as 30s, 5m, 1h30m, 2d "
            "or an ISO time such as 2025-06-01T12:00:00"
        ) from None


def event_text(ev: Mapping[str, Any]) -> Text:
    stamp = datetime.fromtimestamp(ev["ts"]).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    vf = "" if ev["vf"] is None else f"VF{ev['vf']}"
    t = Text()
    t.append(f"{stamp} ", style="dim")
    t.append(f"{ev['seq']:>6} ", style="dim")
    t.append(f"{printable(ev['category']):<7} ", style=CATEGORY_STYLE.get(ev["category"], ""))
    t.append(f"{printable(ev['kind']):<22} ", style="bold")
    t.append(f"{vf:<4} ")
    t.append(printable(ev["message"]))  # the host escapes it too; an older host did not
    return t


def event_json(ev: Mapping[str, Any]) -> str:
    fields = printable_data({k: ev.get(k) for k in FIELDS})
    return json_mod.dumps(fields, separators=(",", ":"), default=str)


def fetch(
    client: AdminClient, after: int, vf: int | None, wait: float = 0.0
) -> list[dict[str, Any]]:
    q = f"/events?after={after}&limit={ALL}&wait={wait:g}" + (f"&vf={vf}" if vf is not None else "")
    return client.request("GET", q, timeout=wait + 30)


def follow(
    client: AdminClient, after: int, vf: int | None, on_gap: Any = None
) -> Iterator[dict[str, Any]]:
    """Every event newer than `after`, forever; rides out a host restart.

    A restarted host numbers its events from 1 again, so when the host's pid
    changes the cursor goes back to 0 rather than skipping the new log.
    """
    pid = _host_pid(client)
    while True:
        try:
            batch = fetch(client, after, vf, LONG_POLL_S)
        except HostUnreachableError as e:
            if on_gap is not None:
                on_gap(str(e))
            while True:
                time.sleep(RETRY_S)  # retry period while the host is down
                try:
                    new_pid = _host_pid(client)
                    break
                except HostUnreachableError:
                    continue
            if new_pid != pid:
                pid, after = new_pid, 0
            continue
        for ev in batch:
            after = max(after, ev["seq"])
            yield ev


def _waiting(why: str) -> None:
    err_console.print(f"waiting for the host: {why}")


def _host_pid(client: AdminClient) -> Any:
    return client.status().get("pid")


def events(
    config: ConfigOpt = None,
    follow_: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new events as they happen.")
    ] = False,
    vf: Annotated[int | None, typer.Option("--vf", min=0, help="Only this VF's events.")] = None,
    since: Annotated[
        str | None,
        typer.Option(help="Only events from this long ago (30s, 5m, 1h30m) or this ISO time on."),
    ] = None,
    lines: Annotated[
        int | None, typer.Option("--lines", "-n", min=0, help="Only the last N past events.")
    ] = None,
    json: Annotated[
        bool,
        typer.Option("--json", help="One JSON object per line: " + ", ".join(FIELDS) + "."),
    ] = False,
) -> None:
    """The host's event log: state changes, resets with their step timings, refusals."""
    try:
        cutoff = parse_since(since) if since is not None else None
    except ValueError as e:
        raise fail(str(e), 2) from None
    client = admin(config)
    console = make_console()

    def emit(ev: Mapping[str, Any]) -> None:
        if cutoff is not None and ev["ts"] < cutoff:
            return
        if json:
            sys.stdout.write(event_json(ev) + "\n")
            sys.stdout.flush()
        else:
            console.print(event_text(ev), soft_wrap=True)

    try:
        backlog = fetch(client, 0, vf)
    except GpuvirtError as e:
        raise fail(str(e)) from None
    # Follow on from the newest event the host had, even when the backlog shown is cut short.
    after = max((e["seq"] for e in backlog), default=0)
    past = [e for e in backlog if cutoff is None or e["ts"] >= cutoff]
    if lines is not None:
        past = past[-lines:] if lines else []
    try:
        for ev in past:
            emit(ev)
        if not follow_:
            return
        for ev in follow(client, after, vf, _waiting):
            emit(ev)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        quiet_broken_pipe()
    except GpuvirtError as e:
        raise fail(str(e)) from None
