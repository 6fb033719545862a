"""Device backends behind one interface (base.py): `emu` everywhere, `cuda` on NVIDIA GPUs."""

from __future__ import annotations

from gpuvirt.config import DEFAULT_KERNEL_SCRATCH
from gpuvirt.device.base import Device
from gpuvirt.errors import ConfigError


def make_device(backend: str, kernel_scratch: int = DEFAULT_KERNEL_SCRATCH) -> Device:
    """The backend's device; kernel_scratch: each cuda engine's cap on kernel temporaries."""
    if backend == "emu":
        from gpuvirt.device.emu import EmuDevice

        return EmuDevice()
    if backend == "cuda":
        from gpuvirt.device.cuda import CudaDevice

        return CudaDevice(kernel_scratch=kernel_scratch)
    raise ConfigError(f"device.backend = {backend!r}: unknown backend (emu | cuda)")
