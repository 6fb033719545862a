"""Real-time priority for the host's threads that must preempt engines and guests."""

from __future__ import annotations

import os
import threading

from gpuvirt.defaults import RT_PRIORITY


def raise_priority(priority: int = RT_PRIORITY) -> str:
    """Put the calling thread ahead of the engines and guests it must preempt.

    Engines are CPU-bound; at normal priority the thread that must stop one can
    itself be preempted by the one it just continued and lose milliseconds. A
    SCHED_FIFO thread is never preempted by them. RESET_ON_FORK keeps the
    processes the host spawns (engines) at normal priority. Without the
    privilege, a lower nice value; without that, say so (latency will show it).
    """
    try:
        policy = os.SCHED_FIFO | os.SCHED_RESET_ON_FORK
        os.sched_setscheduler(0, policy, os.sched_param(priority))
        return f"SCHED_FIFO {priority}"
    except (PermissionError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
        return "nice -10"
    except (PermissionError, OSError):
        return "normal priority (no CAP_SYS_NICE): world-switch latency will suffer"
