"""Which provider serves a pool, and why the others do not.

``select_provider(gpu)`` tries the providers best first (devmem, io_uring
zcrx, userspace) and returns the first that can serve the VF, with the
reason for every one it passed over, so a person can see why data is not
taking the path they expected. devmem and zcrx are listed for their reasons
only: gpuvirt has no implementation of them yet, and never pretends to.
cuda-staging serves VFs of a cuda host (device memory, through the staging
area), userspace those of an emu host (a mapped FB).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpuvirt.netgpu.errors import NetGPUError
from gpuvirt.netgpu.providers.base import Provider
from gpuvirt.netgpu.providers.cuda_staging import CudaStagingProvider
from gpuvirt.netgpu.providers.userspace import UserspaceProvider

if TYPE_CHECKING:
    from gpuvirt.guest.api import Gpu

__all__ = [
    "PROVIDERS",
    "CudaStagingProvider",
    "Provider",
    "Selection",
    "UserspaceProvider",
    "select_provider",
]

PROVIDERS: dict[str, type[Provider]] = {
    "cuda-staging": CudaStagingProvider,
    "userspace": UserspaceProvider,
}
# Best first. The names without a class are the kernel zero-copy paths to come. The two
# with one serve different backends: cuda-staging a device-memory FB, userspace a mapped one.
ORDER = ("devmem", "io_uring-zcrx", "cuda-staging", "userspace")
DEVMEM_KERNEL = (6, 12)  # devmem TCP rx merged in Linux 6.12
ZCRX_KERNEL = (6, 15)  # io_uring zero-copy rx merged in Linux 6.15


@dataclass
class Selection:
    provider: Provider
    skipped: dict[str, str] = field(default_factory=dict)  # name → why not

    def describe(self) -> str:
        lines = [f"provider: {self.provider.name}"]
        lines += [f"  not {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def select_provider(gpu: Gpu, want: str = "auto") -> Selection:
    """The provider for `gpu`'s pools: `want` by name, or the best available with "auto"."""
    if want != "auto" and want not in ORDER:
        raise NetGPUError(f"unknown NetGPU provider {want!r}; one of: auto, {', '.join(ORDER)}")
    skipped: dict[str, str] = {}
    for name in ORDER if want == "auto" else (want,):
        why = _why_not(name, gpu)
        if why is None:
            return Selection(PROVIDERS[name](), skipped)
        skipped[name] = why
    if want != "auto":
        raise NetGPUError(f"NetGPU provider {want!r} cannot serve VF{gpu.vf}: {skipped[want]}")
    raise NetGPUError(
        f"no NetGPU provider can serve VF{gpu.vf}: "
        + "; ".join(f"{n}: {w}" for n, w in skipped.items())
    )


def _why_not(name: str, gpu: Gpu) -> str | None:
    if name == "devmem":
        return _kernel_path_reason(
            "devmem TCP", DEVMEM_KERNEL, "netlink bind-rx, recvmsg(MSG_SOCK_DEVMEM), "
            "SO_DEVMEM_DONTNEED",
        )  # fmt: skip
    if name == "io_uring-zcrx":
        return _kernel_path_reason("io_uring zcrx", ZCRX_KERNEL, "a zcrx ifq and refill ring")
    return PROVIDERS[name].probe(gpu)


def _kernel_path_reason(what: str, since: tuple[int, int], api: str) -> str:
    release = os.uname().release
    kernel = _kernel_version(release)
    parts = [
        f"{what} ({api}) needs the FB as a dma-buf bound to a NIC rx queue that does "
        "header split and flow steering; this VF's FB is a memfd on the emu backend, "
        "which no NIC can DMA into, and loopback has no rx queues"
    ]
    if kernel is not None and kernel < since:
        parts.append(f"kernel {release} also predates it (needs {since[0]}.{since[1]})")
    parts.append("gpuvirt has no provider for it yet")
    return "; ".join(parts)


def _kernel_version(release: str) -> tuple[int, int] | None:
    try:
        major, minor = release.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return None
