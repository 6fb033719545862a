"""Where libraries built on the guest library hang per-VF state (NetGPU: `gpu.netgpu`).

NetGPU sits above the guest library (it uses its buffers and staging), so the
guest layer cannot import it. Instead NetGPU registers its factory here when it
is imported, and `Gpu.netgpu` asks for it; `gpuvirt.attach` imports NetGPU, so
a tenant never has to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from gpuvirt.errors import GpuvirtError

if TYPE_CHECKING:
    from gpuvirt.guest.client import Gpu


class NetExtension(Protocol):
    """What the guest library needs from NetGPU's per-VF object."""

    rx_bytes: int  # reported in VF2PF

    def vf_lost(self) -> None:
        """The VF is being reset or detached: stop every receive into its FB now."""


_netgpu_factory: Callable[[Gpu], NetExtension] | None = None


def register_netgpu(factory: Callable[[Gpu], NetExtension]) -> None:
    global _netgpu_factory
    _netgpu_factory = factory


def make_netgpu(gpu: Gpu) -> NetExtension:
    if _netgpu_factory is None:
        raise GpuvirtError(
            "gpu.netgpu needs the NetGPU library, which is not loaded: `import gpuvirt.netgpu` "
            "(gpuvirt.attach does this for you)"
        )
    return _netgpu_factory(gpu)
