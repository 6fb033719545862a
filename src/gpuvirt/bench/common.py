"""What every benchmark suite shares: the Result, percentiles, spreads, the machine,
a scratch host."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
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
            "machine": machine(self.backend),
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

MIN_ROUNDS = 3


def spread(values: Sequence[float], ndigits: int = 4) -> list[float]:
    """[min, median, max] of one figure over the rounds; the median is the headline."""
    if not values:
        return [float("nan")] * 3
    return [round(v, ndigits) for v in (min(values), statistics.median(values), max(values))]


def _virt() -> str:
    """What the machine runs on (a hypervisor, a container), as systemd names it."""
    tool = shutil.which("systemd-detect-virt")
    if tool is not None:
        try:
            out = subprocess.run([tool], capture_output=True, text=True, timeout=5).stdout
            return out.strip() or "none"
        except (OSError, subprocess.SubprocessError):
            pass
    return "vm (unknown hypervisor)" if _hypervisor() else "unknown"


def _hypervisor() -> bool:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return "hypervisor" in line.split()
    return False


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


SYSCALL_BATCHES, SYSCALL_CALLS = 5, 2000  # how syscall_ns is sampled


def _syscall_ns() -> float:
    """What one bare system call costs here (getuid; glibc does not cache it), median of
    a few batches. Under some hypervisors every system call traps, and the launch round
    trip is mostly system calls: this tells such a machine apart (docs/benchmarks.md)."""
    batches = []
    for _ in range(SYSCALL_BATCHES):
        t = time.perf_counter_ns()
        for _ in range(SYSCALL_CALLS):
            os.getuid()
        batches.append((time.perf_counter_ns() - t) / SYSCALL_CALLS)
    return round(statistics.median(batches), 1)


def machine(backend: str) -> dict[str, Any]:
    """What a figure was measured on: ratios travel between machines, this says from where."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "virt": _virt(),
        # a container reports itself; the CPU flag says whether a hypervisor is under it
        "hypervisor": _hypervisor(),
        "python": platform.python_version(),
        "syscall_ns": _syscall_ns(),
        "backend": backend,
        # engine.sandbox of the hosts a suite starts (`bench --sandbox`; the default
        # is the host's: required)
        "sandbox": os.environ.get(SANDBOX_ENV) or "required",
    }


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


SPARES_POLL_S = 0.01  # how often wait_spares polls the host's status
# A 31-VF host's spares, all starting at once once it is ready: 4.2-6.0 s on a 2-vCPU VM.
SPARES_TIMEOUT_S = 60.0


def wait_spares(hp: HostProcess, timeout: float = SPARES_TIMEOUT_S) -> None:
    """Until every spare engine the host keeps is done starting (/status `spares`), so
    that the next FLR takes a ready one and no start runs beside a measurement."""
    deadline = time.monotonic() + timeout
    while (s := hp.status()["spares"])["ready"] < s["kept"]:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"spares not done starting after {timeout:g} s: {s}")
        time.sleep(SPARES_POLL_S)  # the poll's period: readiness is the host's word
