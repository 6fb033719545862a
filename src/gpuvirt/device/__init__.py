"""Device backends behind one interface (base.py): `emu` everywhere, `cuda` on NVIDIA GPUs."""

from __future__ import annotations

from gpuvirt.device.base import Device
from gpuvirt.errors import ConfigError


def make_device(backend: str) -> Device:
    if backend == "emu":
        from gpuvirt.device.emu import EmuDevice

        return EmuDevice()
    if backend == "cuda":
        from gpuvirt.device.cuda import CudaDevice

        return CudaDevice()
    raise ConfigError(f"device.backend = {backend!r}: unknown backend (emu | cuda)")
