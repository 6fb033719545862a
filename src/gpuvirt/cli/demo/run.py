"""What one demo run holds while it goes: guests, the stream, samples, events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuvirt.cli.demo.guest import Guest
from gpuvirt.cli.demo.meter import ShareMeter
from gpuvirt.cli.demo.sender import StreamSender


@dataclass
class Run:
    n: int
    duration: float
    guests: list[Guest] = field(default_factory=list)
    sender: StreamSender | None = None
    netgpu_skip: str | None = None
    status: dict[str, Any] = field(default_factory=dict)
    engines: set[int] = field(default_factory=set)
    meter: ShareMeter = field(default_factory=ShareMeter)
    events: list[dict[str, Any]] = field(default_factory=list)
    t0: float = 0.0
    backend: str = "emu"
    sent: list[str] = field(default_factory=list)  # incidents ordered so far, in order
    phase: str = "starting"


def roles(n: int) -> dict[int, str]:
    """VF0 ingests the stream; the heaviest VF is the hostile one (it reaches job_timeout
    soonest): its hang and its fault are reset while the others work on."""
    r = dict.fromkeys(range(n), "compute")
    r[0] = "netgpu"
    r[n - 1] = "hostile"
    return r
