"""Ways to wait on a real host: always on something it reports, never a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuvirt.host.process import HostProcess

MakeHost = Callable[..., HostProcess]


def wait_event(
    hp: HostProcess,
    match: Callable[[dict[str, Any]], bool],
    timeout: float = 30.0,
    after: int = 0,
) -> dict[str, Any]:
    """The first event (after seq `after`) that `match` accepts; long-polls the host."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no matching event within {timeout} s")
        events = hp.admin.events(after=after, wait=min(left, 5.0))
        for ev in events:
            if match(ev):
                return ev
            after = ev["seq"]


def wait_state(hp: HostProcess, vf: int, state: str, timeout: float = 30.0) -> None:
    """Until VF `vf` is in `state` (checked now, then on each of its transitions)."""
    after = last_seq(hp)
    if hp.admin.vf(vf)["state"] == state:
        return
    wait_event(
        hp,
        lambda e: e["vf"] == vf and e["kind"] == "transition" and e["data"]["new"] == state,
        timeout,
        after,
    )


def last_seq(hp: HostProcess) -> int:
    events = hp.admin.events(after=0)
    return events[-1]["seq"] if events else 0


def fb_fds(pid: int) -> list[str]:
    """The memfd names a process holds open (its view of device memory)."""
    out = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("/memfd:"):
            out.append(target)
    return out
