"""Where a `bench netgpu` trial's CPU goes, process by process.

The judged figure is the receiver's own CPU: user + system time of this process
(getrusage). Beside it, so that docs/netgpu.md ("The staged path") can say where
the time goes from the bench's own output: the sender's and the engine's CPU time
(every thread's, from /proc/PID/task/*/schedstat, in nanoseconds; readable for a
sandboxed engine too), how often the receiver was preempted (its involuntary
context switches: on emu the engine that copies staged bytes runs on a CPU the
receiver may share), and how many of the machine's CPUs were busy meanwhile
(/proc/stat: all but idle and iowait, over the trial's wall time; in clock
ticks, so a trial's figure is good to about a tick over its length).
"""

from __future__ import annotations

import resource
from typing import NamedTuple

from gpuvirt.bench.proc_cpu import cpu_busy_s, process_cpu_ns


class Usage(NamedTuple):
    rx_cpu_s: float  # this process: user + system
    rx_preempted: int  # this process: involuntary context switches
    others_ns: dict[str, int]  # the watched processes' CPU time, by name
    machine_busy_s: float  # every CPU's busy time so far


def sample(watch: dict[str, int]) -> Usage:
    """Now, for this process and the watched ones ({name: pid})."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return Usage(
        r.ru_utime + r.ru_stime,
        r.ru_nivcsw,
        {k: process_cpu_ns(p) for k, p in watch.items()},
        cpu_busy_s(),
    )


def per_gb(before: Usage, after: Usage, gb: float, seconds: float) -> dict[str, float]:
    """The trial's figures per GB received: `cpu_s_per_gb` (the receiver's: judged),
    `rx_preempted_per_gb`, and `<name>_cpu_s_per_gb` for each watched process; and
    `busy_cpus`, the machine's busy CPUs on average over the trial's `seconds`."""
    out = {
        "cpu_s_per_gb": (after.rx_cpu_s - before.rx_cpu_s) / gb,
        "rx_preempted_per_gb": (after.rx_preempted - before.rx_preempted) / gb,
        "busy_cpus": (after.machine_busy_s - before.machine_busy_s) / seconds,
    }
    for name, ns in after.others_ns.items():
        out[f"{name}_cpu_s_per_gb"] = (ns - before.others_ns[name]) / 1e9 / gb
    return out
