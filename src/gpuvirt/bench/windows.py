"""Busy windows: keep VFs busy with real guests and cut what their kernels did, by their
own progress logs, at the instants of two scheduler snapshots (bench sched, flr, scale).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from gpuvirt.bench.proc_cpu import cpu_busy_s, process_cpu_ns
from gpuvirt.bench.workers import (
    WorkerReport,
    Workers,
    busy_guest,
    device_ns,
    running_rate,
    switch_gaps,
    work_between,
)
from gpuvirt.device.emu import exec_cpu
from gpuvirt.host.process import HostProcess

SETTLE_S = 1.0


def busy_windows(
    hp: HostProcess,
    vfs: list[int],
    seconds: float,
    windows: int = 1,
    sample_every: float = 0.0,
    kernel_s: float = 0.05,
    workload: str = "spin",
) -> list[dict[str, Any]]:
    """Keep `vfs` busy through `windows` back-to-back windows of `seconds` each.

    Each window carries the work every VF's kernels did inside it (their own progress
    logs, see workers.spin_log and wait.wait_log) and, beside it, the scheduler's
    accounting over the same instants (snapshots at both ends, and between for the share
    plot). `workload`: "spin" (CPU-bound kernels) or "wait" (device-bound).
    """
    with Workers() as w:
        for vf in vfs:
            w.start(busy_guest, str(hp.socket), vf, hp.token(vf), kernel_s, workload)
        w.wait_ready()
        # Guests attach one at a time (FULLACCESS is exclusive) and the first start
        # working before the last are in: measure the steady state, not the arrival.
        time.sleep(SETTLE_S)
        snaps = []
        for _ in range(windows):
            cpu0 = device_cpu_time(hp)
            first = hp.admin.request("GET", "/sched")
            samples = [first]
            end = time.monotonic() + seconds
            while sample_every and time.monotonic() + sample_every < end:
                time.sleep(sample_every)  # the sampling period of the share plot
                samples.append(hp.admin.request("GET", "/sched"))
            time.sleep(max(0.0, end - time.monotonic()))  # the measurement window itself
            last = hp.admin.request("GET", "/sched?latencies=1")
            samples.append(last)
            last["foreign_ns"] = foreign_ns(cpu0, device_cpu_time(hp))
            snaps.append(samples)
        reports = {r.vf: r for r in w.stop() if r is not None}
    return [_window(samples, vfs, reports) for samples in snaps]


def busy_window(hp: HostProcess, vfs: list[int], seconds: float, sample_every: float = 0.0,
                kernel_s: float = 0.05, workload: str = "spin") -> dict[str, Any]:  # fmt: skip
    return busy_windows(hp, vfs, seconds, 1, sample_every, kernel_s, workload)[0]


def _window(
    samples: list[dict[str, Any]], vfs: list[int], reports: dict[int, Any]
) -> dict[str, Any]:
    first, last = samples[0], samples[-1]
    t0, t1 = first["monotonic_ns"], last["monotonic_ns"]
    switches = last["switches"] - first["switches"]
    return {
        "span_ns": t1 - t0,
        "device_ns": {
            int(vf): last["vfs"][vf]["device_ns"] - first["vfs"][vf]["device_ns"]
            for vf in last["vfs"]
        },
        # iterations each VF's kernels did inside the window, by their own clocks
        "work": {
            vf: work_between(reports[vf].progress, t0, t1) if vf in reports else 0 for vf in vfs
        },
        # and the device time that work took them (workers.device_ns)
        "engine_ns": {vf: engine_ns(reports.get(vf), t0, t1) for vf in vfs},
        # and the world switches between them, by the same logs
        "gaps_ns": switch_gaps({vf: r.progress for vf, r in reports.items()}, t0, t1),
        "lost_ns": last["lost_ns"] - first["lost_ns"],
        # CPU time on the device's CPU not spent by the host's engines: other work there
        # (another host's engines, a test run) that a continued VF waited behind; None
        # where the device is not the host's CPU (cuda)
        "foreign_ns": last.get("foreign_ns"),
        "switches": switches,
        "latencies_ns": last.get("latencies_ns", [])[-switches:] if switches else [],
        "samples": samples,
        "reports": [reports.get(vf) for vf in vfs],
    }


def engine_ns(report: WorkerReport | None, t0: int, t1: int) -> float:
    """A VF's device time in [t0, t1] by its kernels' own log, at its running rate then
    (or over its whole log, if it never ran through a checkpoint inside)."""
    if report is None or not report.progress:
        return 0.0
    p = report.progress
    rate = running_rate(p, t0, t1) or running_rate(p, p[0][0], p[-1][0]) or 0.0
    return device_ns(p, t0, t1, rate)


def shares(window: dict[str, Any], vfs: list[int], key: str = "engine_ns") -> dict[int, float]:
    """Each VF's share of the device: `engine_ns` (by its kernels' own log, at its running
    rate), `work` (the work its kernels did: the device-bound workload's own device
    ns) or `device_ns` (the scheduler's accounting)."""
    total = sum(window[key][vf] for vf in vfs) or 1
    return {vf: window[key][vf] / total for vf in vfs}


CpuTime = tuple[int, dict[int, int]]  # the device CPU's busy ns, each engine's run ns


def device_cpu_time(hp: HostProcess) -> CpuTime | None:
    """The emulated device's CPU's busy time (ns, /proc/stat) and each of the host's
    engines' run time (ns, bench/proc_cpu.py); None on a real device."""
    if hp.config.device.backend != "emu":
        return None
    cpu = exec_cpu()
    busy = int(cpu_busy_s(cpu) * 1e9)
    return busy, {pid: process_cpu_ns(pid) for pid in _engines(hp.proc.pid, cpu)}


def foreign_ns(before: CpuTime | None, after: CpuTime | None) -> int | None:
    """The work that ran on the device's CPU between two readings beside the engines."""
    if before is None or after is None:
        return None
    engines = sum(ns - before[1].get(pid, 0) for pid, ns in after[1].items())
    return after[0] - before[0] - engines


def _engines(host: int, cpu: int) -> list[int]:
    """The host's descendants that run on `cpu` alone (its engines, once started)."""
    kids: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(p))
    out, todo = [], list(kids.get(host, []))
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        with contextlib.suppress(OSError):
            if os.sched_getaffinity(pid) == {cpu}:
                out.append(pid)
    return out
