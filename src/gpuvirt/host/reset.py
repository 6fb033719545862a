"""VF FLR, the guard, and the whole-device reset that a failed FLR escalates to.

VF FLR, in GIM's order (each step an event with its duration):
  1. RESETTING, off the schedule      4. kill the engine
  2. FLR_NOTIFICATION to the guest     5. scrub the whole FB
  3. wait ≤ ready_to_reset_wait for    6. a fresh engine (INIT_GPU)
     READY_TO_RESET (go on regardless) 7. FLR_NOTIFICATION_COMPLETION, AVAIL
If step 5 or 6 fails (or anything else raises), every VF is reset (device
reset); a VF whose engine fails again is FAILED. The guard counts FLRs per VF
in a sliding window; the FLR past its limit leaves the VF QUARANTINED until an
admin clears it, and a device reset leaves a quarantined VF as it is.

The resetter touches only what its constructor is given: the state machine,
the event log, the lifecycle lock and `VFOps`, the host's engine and FB steps.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, Protocol

from gpuvirt.config import ResetSection
from gpuvirt.errors import DeviceError
from gpuvirt.host.events import Category, EventLog
from gpuvirt.host.vfmgr import VF, VFEvent, VFManager
from gpuvirt.protocol.mailbox import Frame, HostMsg

E = VFEvent


class VFOps(Protocol):
    """The host's steps on one VF's engine and FB, as the resetter needs them."""

    async def off_schedule(self, vf: VF) -> None: ...
    async def kill_engine(self, vf: VF) -> None: ...
    def renew_fb(self, vf: VF) -> None: ...
    async def start_engine(self, vf: VF) -> None: ...
    async def bring_up(self, vf: VF, reason: str) -> bool: ...
    def device_times(self) -> dict[str, Any]: ...


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

    def __init__(self, events: EventLog, vf: VF | None, kind: str) -> None:
        self.events, self.vf, self.kind = events, vf, kind
        self.t0 = self.last = time.monotonic()
        self.durations: dict[str, float] = {}

    def done(self, step: str, **data: Any) -> None:
        now = time.monotonic()
        ms = (now - self.last) * 1000
        self.durations[step] = round(ms, 3)
        self.last = now
        self.events.emit(
            Category.RESET, f"{self.kind}.{step}", f"{self.kind} {step} in {ms:.1f} ms",
            self.vf.index if self.vf else None, ms=round(ms, 3), **data,
        )  # fmt: skip

    @property
    def total_ms(self) -> float:
        return (time.monotonic() - self.t0) * 1000


class Resetter:
    def __init__(
        self,
        vfm: VFManager,
        events: EventLog,
        ops: VFOps,
        cfg: ResetSection,
        lifecycle: asyncio.Lock,
    ) -> None:
        self.vfm, self.events, self.ops = vfm, events, ops
        self.guard = Guard(cfg.guard_count, cfg.guard_window_s)
        self.ready_wait = cfg.ready_to_reset_wait_ms / 1000
        self._lock = lifecycle  # one lifecycle change at a time; a device reset needs all

    async def flr(self, vf: VF, reason: str, detail: str = "") -> None:
        if not self.vfm.accepts(vf, E.FLR):
            return  # already being handled, or nothing to reset
        async with self._lock:
            if not self.vfm.accepts(vf, E.FLR):
                return  # handled while this request waited
            self.vfm.send(vf, E.FLR, f"FLR: {reason}")
            try:
                await self._flr(vf, reason, detail)
            except Exception as e:  # no path may leave the VF RESETTING
                self.events.emit(
                    Category.HOST, "bug", f"FLR of VF{vf.index} failed: {e!r}", vf.index,
                    error=repr(e),
                )  # fmt: skip
                await self.device_reset(f"FLR of VF{vf.index} failed: {e!r}")

    async def _flr(self, vf: VF, reason: str, detail: str) -> None:
        ops = self.ops
        steps = Steps(self.events, vf, "flr")
        self.events.emit(
            Category.RESET, "flr.start", f"FLR of VF{vf.index}: {reason} {detail}".strip(),
            vf.index, reason=reason, detail=detail, device_ns=ops.device_times(),
        )  # fmt: skip
        await ops.off_schedule(vf)
        steps.done("off_schedule")
        answered = await self._notify(vf)
        steps.done("notify", ready_to_reset=answered)
        await ops.kill_engine(vf)
        steps.done("kill")
        try:
            ops.renew_fb(vf)
        except OSError as e:
            steps.done("scrub_failed", error=str(e))
            await self.device_reset(f"VF{vf.index} FB could not be renewed: {e}")
            return
        steps.done("scrub")
        vf.flr_count += 1
        if self.guard.record(vf.flr_times, time.monotonic()):
            vf.guard_trips += 1
            vf.last_flr = {"reason": reason, "steps": steps.durations, "total_ms": steps.total_ms}
            self.vfm.send(
                vf, E.GUARD_TRIP, f"guard {self.guard.count}/{self.guard.window_s:g}s tripped"
            )
            self.events.emit(
                Category.GUARD, "guard.trip",
                f"VF{vf.index} quarantined after {len(vf.flr_times)} FLRs within "
                f"{self.guard.window_s:g} s; `gpuvirt vf clear-guard {vf.index}` to clear",
                vf.index, flrs=len(vf.flr_times),
            )  # fmt: skip
            self._send(vf, HostMsg.FLR_NOTIFICATION_COMPLETION)
            return
        try:
            await ops.start_engine(vf)
        except DeviceError as e:
            steps.done("engine_start_failed", error=str(e))
            await self.device_reset(f"VF{vf.index} engine did not restart: {e}")
            return
        steps.done("engine_start")
        self._send(vf, HostMsg.FLR_NOTIFICATION_COMPLETION)
        self.vfm.send(vf, E.ENGINE_UP, "FLR complete")
        vf.last_flr = {"reason": reason, "steps": steps.durations, "total_ms": steps.total_ms}
        self.events.emit(
            Category.RESET, "flr.done", f"FLR of VF{vf.index} done in {steps.total_ms:.1f} ms",
            vf.index, total_ms=round(steps.total_ms, 3), steps=steps.durations, reason=reason,
            device_ns=ops.device_times(),
        )  # fmt: skip

    async def escalate(self, reason: str) -> None:
        """A device reset from outside a lifecycle change (the scheduler's own failure)."""
        async with self._lock:
            await self.device_reset(reason)

    async def device_reset(self, reason: str) -> None:
        """Reset every VF that takes it (not the disabled, not the quarantined). The caller
        holds the lifecycle lock. A step that fails leaves that VF FAILED, never stuck."""
        ops = self.ops
        steps = Steps(self.events, None, "device_reset")
        self.events.emit(Category.RESET, "device_reset.start", f"device reset: {reason}", None)
        vfs = [vf for vf in self.vfm.vfs if self.vfm.accepts(vf, E.DEVICE_RESET)]
        failed: dict[int, Exception] = {}
        for vf in vfs:
            self.vfm.send(vf, E.DEVICE_RESET, "device reset")
            try:
                await ops.off_schedule(vf)
            except Exception as e:  # one VF's failure must not stop the rest
                failed[vf.index] = e
        await asyncio.gather(*(self._notify(vf) for vf in vfs))
        steps.done("notify")
        for vf in vfs:
            try:
                await ops.kill_engine(vf)
                if vf.index not in failed:
                    ops.renew_fb(vf)
            except Exception as e:  # as above
                failed.setdefault(vf.index, e)
        steps.done("kill_scrub")
        for vf in vfs:
            if vf.index in failed:
                self.vfm.send(vf, E.ENGINE_FAILED, f"device reset: {failed[vf.index]!r}")
                continue
            await ops.bring_up(vf, "device reset complete")
            self._send(vf, HostMsg.FLR_NOTIFICATION_COMPLETION)
        steps.done("restart")
        self.events.emit(
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

    async def clear_guard(self, vf: VF) -> None:
        """The caller holds the lifecycle lock."""
        vf.flr_times.clear()
        self.events.emit(Category.GUARD, "guard.clear", f"guard of VF{vf.index} cleared", vf.index)
        if self.vfm.accepts(vf, E.CLEAR_GUARD):
            self.vfm.send(vf, E.CLEAR_GUARD, "guard cleared")
            await self.ops.bring_up(vf, "guard cleared")
