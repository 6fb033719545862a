"""VF FLR, the guard, and the whole-device reset that a failed FLR escalates to.

VF FLR, in GIM's order (each step an event with its duration):
  1. RESETTING, off the schedule      4. kill the engine
  2. FLR_NOTIFICATION to the guest     5. scrub the whole FB
  3. wait ≤ ready_to_reset_wait for    6. a fresh engine (INIT_GPU)
     READY_TO_RESET (go on regardless) 7. FLR_NOTIFICATION_COMPLETION, AVAIL
If step 6 fails, every VF is reset (device reset); a VF whose engine fails
again is FAILED. The guard counts FLRs per VF in a sliding window; the FLR
past its limit leaves the VF QUARANTINED until an admin clears it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from gpuvirt.errors import DeviceError
from gpuvirt.host.events import Category
from gpuvirt.host.vfmgr import VF, VFState
from gpuvirt.protocol.mailbox import Frame, HostMsg

if TYPE_CHECKING:
    from gpuvirt.host.daemon import Host

S = VFState


class Guard:
    """Sliding-window FLR counter: more than `count` FLRs within `window_s` trips it."""

    def __init__(self, count: int, window_s: float) -> None:
        self.count = count
        self.window_s = window_s

    def record(self, times: deque[float], now: float) -> bool:
        times.append(now)
        while times and times[0] < now - self.window_s:
            times.popleft()
        return len(times) > self.count


class Steps:
    """Times each step of a reset for its events."""

    def __init__(self, host: Host, vf: VF | None, kind: str) -> None:
        self.host, self.vf, self.kind = host, vf, kind
        self.t0 = self.last = time.monotonic()
        self.durations: dict[str, float] = {}

    def done(self, step: str, **data: Any) -> None:
        now = time.monotonic()
        ms = (now - self.last) * 1000
        self.durations[step] = round(ms, 3)
        self.last = now
        self.host.events.emit(
            Category.RESET, f"{self.kind}.{step}", f"{self.kind} {step} in {ms:.1f} ms",
            self.vf.index if self.vf else None, ms=round(ms, 3), **data,
        )  # fmt: skip

    @property
    def total_ms(self) -> float:
        return (time.monotonic() - self.t0) * 1000


class Resetter:
    def __init__(self, host: Host) -> None:
        self.host = host
        cfg = host.config.reset
        self.guard = Guard(cfg.guard_count, cfg.guard_window_s)
        self.ready_wait = cfg.ready_to_reset_wait_ms / 1000
        self._lock = host.lifecycle  # one lifecycle change at a time; a device reset needs all

    async def flr(self, vf: VF, reason: str, detail: str = "") -> None:
        if vf.state in (S.RESETTING, S.UNAVAIL, S.FAILED, S.QUARANTINED):
            return  # already being handled, or nothing to reset
        host = self.host
        async with self._lock:
            if vf.state in (S.RESETTING, S.UNAVAIL, S.FAILED, S.QUARANTINED):
                return  # handled while this request waited
            host.vfm.transition(vf, S.RESETTING, f"FLR: {reason}")
            host.release_fullaccess(vf)
            steps = Steps(host, vf, "flr")
            host.events.emit(
                Category.RESET, "flr.start", f"FLR of VF{vf.index}: {reason} {detail}".strip(),
                vf.index, reason=reason, detail=detail, device_ns=host.device_times(),
            )  # fmt: skip
            await host.off_schedule(vf)
            steps.done("off_schedule")
            answered = await self._notify(vf)
            steps.done("notify", ready_to_reset=answered)
            await host.kill_engine(vf)
            steps.done("kill")
            host.renew_fb(vf)
            steps.done("scrub")
            vf.flr_count += 1
            if self.guard.record(vf.flr_times, time.monotonic()):
                vf.guard_trips += 1
                vf.last_flr = {
                    "reason": reason,
                    "steps": steps.durations,
                    "total_ms": steps.total_ms,
                }
                host.vfm.transition(
                    vf, S.QUARANTINED, f"guard {self.guard.count}/{self.guard.window_s:g}s tripped"
                )
                host.events.emit(
                    Category.GUARD, "guard.trip",
                    f"VF{vf.index} quarantined after {len(vf.flr_times)} FLRs within "
                    f"{self.guard.window_s:g} s; `gpuvirt vf clear-guard {vf.index}` to clear",
                    vf.index, flrs=len(vf.flr_times),
                )  # fmt: skip
                self._send(vf, HostMsg.FLR_NOTIFICATION_COMPLETION)
                return
            try:
                await host.start_engine(vf)
            except DeviceError as e:
                steps.done("engine_start_failed", error=str(e))
                await self.device_reset(f"VF{vf.index} engine did not restart: {e}")
                return
            steps.done("engine_start")
            self._send(vf, HostMsg.FLR_NOTIFICATION_COMPLETION)
            host.vfm.transition(vf, S.AVAIL, "FLR complete")
            vf.last_flr = {"reason": reason, "steps": steps.durations, "total_ms": steps.total_ms}
            host.events.emit(
                Category.RESET, "flr.done", f"FLR of VF{vf.index} done in {steps.total_ms:.1f} ms",
                vf.index, total_ms=round(steps.total_ms, 3), steps=steps.durations, reason=reason,
                device_ns=host.device_times(),
            )  # fmt: skip

    async def device_reset(self, reason: str) -> None:
        """Reset every VF. The caller holds host.lifecycle (an FLR or fini that failed)."""
        host = self.host
        steps = Steps(host, None, "device_reset")
        host.events.emit(Category.RESET, "device_reset.start", f"device reset: {reason}", None)
        vfs = [vf for vf in host.vfm.vfs if vf.state != S.UNAVAIL]
        for vf in vfs:
            if vf.state != S.RESETTING:
                host.vfm.transition(vf, S.RESETTING, "device reset")
                host.release_fullaccess(vf)
            await host.off_schedule(vf)
        await asyncio.gather(*(self._notify(vf) for vf in vfs))
        steps.done("notify")
        for vf in vfs:
            await host.kill_engine(vf)
            host.renew_fb(vf)
        steps.done("kill_scrub")
        for vf in vfs:
            await host.bring_up(vf, "device reset complete")
            self._send(vf, HostMsg.FLR_NOTIFICATION_COMPLETION)
        steps.done("restart")
        host.events.emit(
            Category.RESET, "device_reset.done",
            f"device reset done in {steps.total_ms:.1f} ms", None,
            total_ms=round(steps.total_ms, 3), steps=steps.durations,
        )  # fmt: skip

    async def _notify(self, vf: VF) -> bool:
        """FLR_NOTIFICATION, then wait for READY_TO_RESET up to the configured time."""
        sess = vf.conn
        if sess is None:
            return False
        sess.ready_to_reset.clear()
        if not sess.send(Frame(HostMsg.FLR_NOTIFICATION)):
            return False
        try:
            await asyncio.wait_for(sess.ready_to_reset.wait(), self.ready_wait)
        except TimeoutError:
            return False
        return True

    def _send(self, vf: VF, msg: HostMsg) -> None:
        if vf.conn is not None:
            vf.conn.send(Frame(msg))

    def clear_guard(self, vf: VF) -> None:
        vf.flr_times.clear()
        self.host.events.emit(
            Category.GUARD, "guard.clear", f"guard of VF{vf.index} cleared", vf.index
        )
