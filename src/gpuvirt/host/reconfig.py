"""VFs reconfigured at run time (`gpuvirt vf set N --fb SIZE --weight W`).

The FB changes only while the VF has no guest: it is re-carved and scrubbed
(the whole FB goes, a new one of the new size replaces it, a fresh engine
starts on it), and every VF's FB together with the PF's reserve must still fit
the device. The weight changes at any time; the scheduler uses it from the
VF's next slice. Each change is one ADMIN event carrying old and new values.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Protocol

from gpuvirt.config import HostConfig, VFSettings, format_size
from gpuvirt.errors import ConfigError, StateConflictError
from gpuvirt.host.events import Category, EventLog
from gpuvirt.host.vfmgr import VF, AdminOp, VFEvent, VFManager, admin_refusal, enabled


class ReconfigHost(Protocol):
    """Everything `vf set` may touch on the host."""

    lifecycle: asyncio.Lock  # held for the whole change: one lifecycle step at a time
    events: EventLog
    vfm: VFManager
    config: HostConfig  # device.pf_fb, the PF's reserve
    fb_total: int

    async def reweigh(self, vf: VF, weight: float) -> None: ...
    async def off_schedule(self, vf: VF) -> None: ...
    async def kill_engine(self, vf: VF) -> None: ...
    def renew_fb(self, vf: VF, size: int | None = None) -> None: ...
    async def bring_up(self, vf: VF, reason: str) -> bool: ...


async def set_vf(host: ReconfigHost, vf: VF, settings: VFSettings, caller: str = "admin") -> None:
    """Apply `settings` to `vf`. ConfigError: a value that does not fit (400).
    StateConflictError: the VF's state forbids the change now (409)."""
    async with host.lifecycle:
        fb = settings.fb if settings.fb is not None and settings.fb != vf.fb else None
        weight = (
            settings.weight
            if settings.weight is not None and settings.weight != vf.plan.weight
            else None
        )
        if fb is not None:
            _check_fb(host, vf, fb)
        if fb is None and weight is None:
            return
        old = vf.plan
        vf.plan = dataclasses.replace(
            old,
            fb=fb if fb is not None else old.fb,
            weight=weight if weight is not None else old.weight,
        )
        changed: dict[str, Any] = {}
        if weight is not None:
            changed["weight"] = [old.weight, weight]
            await host.reweigh(vf, weight)
        if fb is not None:
            changed["fb"] = [old.fb, fb]
            await _recarve(host, vf, fb)
        text = ", ".join(
            f"fb {format_size(a)} → {format_size(b)}" if k == "fb" else f"weight {a:g} → {b:g}"
            for k, (a, b) in changed.items()
        )
        host.events.emit(
            Category.ADMIN, "set", f"{caller}: VF{vf.index} {text}", vf.index,
            caller=caller, **changed,
        )  # fmt: skip


def _check_fb(host: ReconfigHost, vf: VF, fb: int) -> None:
    if (why := admin_refusal(AdminOp.SET_FB, vf)) is not None:
        raise StateConflictError(f"fb = {format_size(fb)}: VF{vf.index}: {why}")
    others = sum(v.fb for v in host.vfm.vfs if v is not vf)
    pf_fb = host.config.device.pf_fb
    room = host.fb_total - pf_fb - others
    if fb > room:
        raise ConfigError(
            f"fb = {format_size(fb)}: does not fit the device: fb_total "
            f"{format_size(host.fb_total)} less device.pf_fb {format_size(pf_fb)} and the "
            f"other VFs' {format_size(others)} leaves {format_size(max(room, 0))} for VF{vf.index}"
        )


async def _recarve(host: ReconfigHost, vf: VF, fb: int) -> None:
    if not enabled(vf):
        return  # no FB now; `vf enable` carves the new size
    if not host.vfm.accepts(vf, VFEvent.RECARVE):
        host.renew_fb(vf, fb)  # QUARANTINED or FAILED: no engine holds the FB
        return
    host.vfm.send(vf, VFEvent.RECARVE, f"FB re-carved to {format_size(fb)}")
    await host.off_schedule(vf)
    await host.kill_engine(vf)
    host.renew_fb(vf, fb)
    await host.bring_up(vf, f"FB re-carved to {format_size(fb)} and scrubbed")
