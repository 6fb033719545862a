"""What the host reports about itself: status, per-VF status, shares and device times.

Read-only over what its constructor is given (the admin endpoint, metrics and
reset events use it); it changes nothing in the host.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gpuvirt.config import HostConfig
from gpuvirt.defaults import DEVICE_DISAGREE_PP, SHARE_WINDOW
from gpuvirt.device.base import Device
from gpuvirt.device.sandbox.policy import Report
from gpuvirt.host.reset import Guard
from gpuvirt.host.sched.policy import Policy
from gpuvirt.host.sched.scheduler import Scheduler
from gpuvirt.host.vfmgr import GUEST_STATES, VF, VFEvent, VFManager, enabled

PAGE = os.sysconf("SC_PAGE_SIZE")


class StatusReport:
    def __init__(
        self,
        config: HostConfig,
        vfm: VFManager,
        sched: Scheduler,
        device: Device,
        guard: Guard,
        has_fb: Callable[[int], bool],
        sandbox: Report,
    ) -> None:
        self.config, self.vfm, self.sched, self.device = config, vfm, sched, device
        self.guard, self.has_fb, self.sandbox = guard, has_fb, sandbox
        self.admin_where = ""  # set once the admin endpoint listens
        self.started = time.time()
        self.samples: deque[dict[str, Any]] = deque(maxlen=SHARE_WINDOW + 1)

    async def sample_shares(self) -> None:
        while True:
            self.samples.append(self.sched.snapshot())
            await asyncio.sleep(1.0)  # sampling period of the achieved-share window

    def achieved_shares(self) -> dict[int, float]:
        if len(self.samples) < 2:
            return {}
        a, b = self.samples[0], self.sched.snapshot()
        span = b["elapsed_ns"] - a["elapsed_ns"]
        out = {}
        for vf, now in b["vfs"].items():
            before = a["vfs"].get(vf, {"device_ns": now["device_ns"]})["device_ns"]
            out[vf] = max(0.0, (now["device_ns"] - before) / span) if span else 0.0
        return out

    def device_times(self) -> dict[str, Any]:
        """Every VF's device time now (ns); reset events carry it so shares can be cut at them."""
        snap = self.sched.snapshot()
        return {
            "elapsed_ns": snap["elapsed_ns"],
            "monotonic_ns": snap["monotonic_ns"],
            "lost_ns": snap["lost_ns"],
            "idle_ns": snap["idle_ns"],
            "vfs": {str(vf): s["device_ns"] for vf, s in snap["vfs"].items()},
        }

    def configured_shares(self) -> dict[int, float]:
        policy = self.sched.policy
        vfs = [vf for vf in self.vfm.vfs if enabled(vf)]
        # fairness: every enabled VF has its slice; the others: only VFs with a guest.
        fair = policy == Policy.FAIRNESS
        pool = vfs if fair else [vf for vf in vfs if vf.state in GUEST_STATES]
        if not pool:
            return {}
        if policy == Policy.WEIGHTED:
            total = sum(vf.plan.weight for vf in pool)
            return {vf.index: vf.plan.weight / total for vf in pool}
        return {vf.index: 1 / len(pool) for vf in pool}

    def vf_status(self, vf: VF, snap: dict[str, Any] | None = None) -> dict[str, Any]:
        snap = snap or self.sched.snapshot()
        s = snap["vfs"].get(vf.index, {})
        achieved = self.achieved_shares()
        configured = self.configured_shares()
        memory = self.device.engine_memory()
        return {
            "index": vf.index,
            "state": str(vf.state),
            "fb_total": vf.fb,
            # Device memory its engine takes outside the FB (cuda; 0 on emu), budgeted.
            "context_bytes": memory.context,
            "scratch_bytes": memory.scratch,
            "fb_used": vf.vf2pf.get("fb_used", 0),
            "fb_resident": self.device.fb_resident(vf.index) if self.has_fb(vf.index) else 0,
            "weight": vf.plan.weight,
            "token_file": str(vf.plan.token_file),
            "configured_share": round(configured.get(vf.index, 0.0), 4),
            "achieved_share": round(achieved.get(vf.index, 0.0), 4),
            # device_ms: what the scheduler charged (on cuda the device's own measure,
            # BUSY_NS, bounded by wall time); wall_ms: the host's wall-clock view of the
            # same turns; disagree_pp: their gap in points of the device (None on emu).
            "device_ms": round(s.get("device_ns", 0) / 1e6, 3),
            "wall_ms": round(s.get("wall_ns", s.get("device_ns", 0)) / 1e6, 3),
            "disagree_pp": s.get("disagree_pp"),
            "device_disagrees": disagrees(s),
            "running": s.get("running", False),
            "pending": s.get("pending", 0),
            "guest_pid": vf.guest_pid,
            "engine_pid": vf.engine.pid if vf.engine else None,
            "sandbox": "confined" if self.sandbox.confined else "UNCONFINED",
            "launches_completed": vf.vf2pf.get("launches_completed", 0),
            "netgpu_rx_bytes": vf.vf2pf.get("netgpu_rx_bytes", 0),
            "driver_version": vf.vf2pf.get("driver_version"),
            "vf2pf_read_at": vf.vf2pf.get("read_at"),
            "flr_count": vf.flr_count,
            "last_flr": vf.last_flr,
            "guard": {
                "recent_flrs": len(vf.flr_times),
                "limit": self.guard.count,
                "window_s": self.guard.window_s,
                "tripped": self.vfm.accepts(vf, VFEvent.CLEAR_GUARD),  # only a quarantine takes it
                "trips": vf.guard_trips,
            },
            "vf2pf_untrusted": vf.untrusted,
            "since": vf.since,
        }

    def status(self) -> dict[str, Any]:
        snap = self.sched.snapshot()
        elapsed = snap["elapsed_ns"] or 1
        lat = sorted(self.sched.stats.latencies_ns)
        rows = list(snap["vfs"].values())
        return {
            "backend": self.config.device.backend,
            "policy": snap["policy"],
            "time_slice_ms": self.config.scheduler.time_slice_ms,
            "socket": str(self.config.host.socket_path()),
            "admin": self.admin_where,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 3),
            "host_rss_bytes": rss_bytes(os.getpid()),
            "sandbox": self.sandbox.as_dict(),
            # engines started ahead of the next FLR, fini or enable, and how many are done
            # starting: one that is not yet ready makes its FLR wait for its start
            "spares": self.device.spares(),
            "sched": {
                "current": snap["current"],
                "switches": snap["switches"],
                "lost_pct": round(100 * snap["lost_ns"] / elapsed, 3),
                "switch_p50_us": round(lat[len(lat) // 2] / 1e3, 1) if lat else None,
                "switch_p99_us": round(lat[int(len(lat) * 0.99)] / 1e3, 1) if lat else None,
                # the largest device-vs-wall gap of any VF, and whether it is over the limit
                "disagree_pp_max": max((r.get("disagree_pp") or 0.0 for r in rows), default=0.0),
                "device_disagrees": any(disagrees(r) for r in rows),
            },
            "vfs": [self.vf_status(vf, snap) for vf in self.vfm.vfs],
        }


def disagrees(row: dict[str, Any]) -> bool:
    """Whether a scheduler snapshot row's device time (as the device measured it) and the
    host's wall-clock view of it differ by more than DEVICE_DISAGREE_PP. Read with .get:
    rows without the figures (a device whose time is the wall clock) never disagree."""
    return (row.get("disagree_pp") or 0.0) > DEVICE_DISAGREE_PP


def flag_disagreements(snap: dict[str, Any]) -> dict[str, Any]:
    """A scheduler snapshot (GET /sched) with each row's `device_disagrees` flag."""
    for row in snap["vfs"].values():
        row["device_disagrees"] = disagrees(row)
    return snap


def rss_bytes(pid: int) -> int:
    """Resident memory of a process now (not its peak)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0
