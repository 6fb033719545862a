"""What every benchmark suite shares: the Result, percentiles, a scratch host."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuvirt.config import HostConfig, config_from_dict
from gpuvirt.host.process import HostProcess


@dataclass
class Target:
    name: str  # the figure it judges
    value: float
    limit: float
    op: str  # "<=" or ">="

    @property
    def met(self) -> bool:
        return self.value <= self.limit if self.op == "<=" else self.value >= self.limit


@dataclass
class Result:
    bench: str
    backend: str
    figures: dict[str, Any]
    targets: list[Target] = field(default_factory=list)
    # rows for the readable table: (what, value, unit)
    rows: list[tuple[str, Any, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    series: dict[str, Any] = field(default_factory=dict)  # raw data for plots (not in --json)

    @property
    def targets_met(self) -> bool:
        return all(t.met for t in self.targets)

    def to_json(self) -> dict[str, Any]:
        return {
            "bench": self.bench,
            "backend": self.backend,
            "targets_met": self.targets_met,
            **self.figures,
            "targets": {
                t.name: {"value": t.value, "target": f"{t.op} {t.limit:g}", "met": t.met}
                for t in self.targets
            },
            "notes": self.notes,
        }


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


# `gpuvirt bench --sandbox MODE`: the engine.sandbox of every host a suite starts,
# so confinement's cost is measured by running the same suite both ways.
SANDBOX_ENV = "GPUVIRT_BENCH_SANDBOX"


def host_config(workdir: Path, **sections: dict[str, Any]) -> HostConfig:
    base: dict[str, Any] = {
        "host": {
            "socket": str(workdir / "host.sock"),
            "admin": str(workdir / "admin.sock"),
            "state_dir": str(workdir / "state"),
        },
        "device": {"fb_total": "1GiB", "pf_fb": "64MiB"},
    }
    if os.environ.get(SANDBOX_ENV):
        base["engine"] = {"sandbox": os.environ[SANDBOX_ENV]}
    for name, values in sections.items():
        if name == "vf":
            base["vf"] = values
        else:
            base.setdefault(name, {}).update(values)
    return config_from_dict(base)


@contextlib.contextmanager
def scratch_host(env: dict[str, str] | None = None, **sections: Any) -> Iterator[HostProcess]:
    """A host daemon in a temporary directory, stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="gpuvirt-bench-") as tmp:
        work = Path(tmp)
        with HostProcess(host_config(work, **sections), work / "run", env) as hp:
            yield hp
