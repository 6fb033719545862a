"""gpuvirt: a GPU virtualization host (SR-IOV style VFs) and its guest library."""

from gpuvirt.errors import (
    AuthRefusedError,
    BufferLostError,
    ConfigError,
    DetachedError,
    GpuvirtError,
    HostUnreachableError,
    KernelError,
    OutOfMemoryError,
    StaleBufferError,
    VFResetError,
)
from gpuvirt.version import __version__

__all__ = [
    "AuthRefusedError",
    "BufferLostError",
    "ConfigError",
    "DetachedError",
    "GpuvirtError",
    "HostUnreachableError",
    "KernelError",
    "OutOfMemoryError",
    "StaleBufferError",
    "VFResetError",
    "__version__",
    "attach",
    "kernel",
]


def __getattr__(name: str):
    # The guest library pulls in numpy and cloudpickle; the host CLI should not pay for them.
    if name in ("attach", "kernel"):
        import gpuvirt.netgpu  # noqa: F401  (registers gpu.netgpu with the guest library)
        from gpuvirt.guest import client

        return getattr(client, name)
    raise AttributeError(name)
