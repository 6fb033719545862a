"""CPU time as /proc counts it, for benches that say where a run's CPU went.

`process_cpu_ns` reads every thread's schedstat (nanoseconds; readable for a
sandboxed engine too); `cpu_busy_s` reads /proc/stat, in clock ticks, so a
figure over a window is good to about a tick.
"""

from __future__ import annotations

import contextlib
import os


def process_cpu_ns(pid: int) -> int:
    """CPU time of every thread of `pid` so far; 0 once it is gone (a thread that ended
    takes its own time along)."""
    total = 0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, IndexError, ValueError):
                continue  # a thread that ended meanwhile
    return total


def cpu_busy_s(cpu: int | None = None) -> float:
    """Busy time so far of one CPU, or of all of them together (None): every state but
    idle and iowait, through steal (a guest's own time is in user)."""
    prefix = "cpu " if cpu is None else f"cpu{cpu} "
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith(prefix):
                ticks = [int(v) for v in line.split()[1:9]]
                return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    raise LookupError(f"/proc/stat has no line for {prefix.strip()}")
