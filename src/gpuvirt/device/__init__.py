"""Device backends behind one interface (base.py): `emu` everywhere, `cuda` on NVIDIA GPUs."""

from __future__ import annotations

from gpuvirt.device.base import Device
from gpuvirt.device.sandbox import Sandbox
from gpuvirt.errors import ConfigError


def make_device(backend: str, sandbox: Sandbox | None = None) -> Device:
    """sandbox None: unconfined engines (device tests); the host passes its own."""
    if backend == "emu":
        from gpuvirt.device.emu import EmuDevice

        return EmuDevice(sandbox)
    if backend == "cuda":
        from gpuvirt.device.cuda import CudaDevice

        return CudaDevice(sandbox)
    raise ConfigError(f"device.backend = {backend!r}: unknown backend (emu | cuda)")
