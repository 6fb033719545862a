"""Device backends behind one interface (base.py): `emu` everywhere, `cuda` on NVIDIA GPUs."""

from __future__ import annotations

from gpuvirt.device.base import Device
from gpuvirt.device.sandbox import Sandbox
from gpuvirt.errors import ConfigError


def make_device(
    backend: str, sandbox: Sandbox | None = None, kernel_scratch: int | None = None
) -> Device:
    """The backend's device. sandbox None: unconfined engines (device tests); the host
    passes its own. kernel_scratch: each cuda engine's cap on kernel temporaries, which
    the host passes from its config (this layer does not import the config, which
    would load pydantic).
    """
    if backend == "emu":
        from gpuvirt.device.emu import EmuDevice

        return EmuDevice(sandbox)
    if backend == "cuda":
        from gpuvirt.device.cuda import CudaDevice

        if kernel_scratch is None:
            raise ConfigError("the cuda backend needs device.kernel_scratch")
        return CudaDevice(sandbox, kernel_scratch=kernel_scratch)
    raise ConfigError(f"device.backend = {backend!r}: unknown backend (emu | cuda)")
