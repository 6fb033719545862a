"""Inside a cuda engine: the FB is one device allocation, buffers are cupy views of it.

Runs only in the engine process (device/engine.py); CuPy is imported when the
executor is constructed, so importing this module needs no GPU.
"""

from __future__ import annotations

import mmap
import os
import sys
from typing import Any

import numpy as np

from gpuvirt.errors import DeviceError
from gpuvirt.protocol.command import BufDesc, Copy
from gpuvirt.protocol.info import RESERVED_SIZE


def _fmt(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n} B"


class CudaExecutor:
    """Inside the engine: the FB is one device allocation, buffers are cupy views of it.

    Everything a tenant's kernel does goes on one non-blocking stream, made current for
    the engine's thread; so do the staging copies. `synchronize` drains that stream,
    and the engine calls it after every launch and copy and before acknowledging IDLE.
    """

    def __init__(self, aperture_fd: int, fb_size: int, vf: int) -> None:
        import cupy

        self.xp: Any = cupy
        self.size = fb_size
        self.vf = vf
        rt = cupy.cuda.runtime
        self._rt = rt
        self.aperture_size = os.fstat(aperture_fd).st_size
        if self.aperture_size <= RESERVED_SIZE:
            raise DeviceError(f"VF{vf}: aperture of {self.aperture_size} bytes has no staging area")
        self.aperture = mmap.mmap(
            aperture_fd, self.aperture_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
        )
        self._host = np.frombuffer(self.aperture, dtype=np.uint8)
        self._host_ptr = int(self._host.ctypes.data)
        cupy.cuda.Device(0).use()
        try:
            # cudaMalloc directly, not the memory pool: the FB is one fixed allocation
            # that lives as long as the engine, and the pool's limit below is for scratch.
            self._mem = cupy.cuda.Memory(fb_size)
        except Exception as e:
            free, total = rt.memGetInfo()
            raise DeviceError(
                f"VF{vf}: cannot allocate its {_fmt(fb_size)} FB on the device ({e}); "
                f"{_fmt(free)} of {_fmt(total)} free now. Each engine's CUDA context also "
                "takes device memory outside the FBs: lower device.fb_total or raise "
                "device.pf_fb"
            ) from None
        self.base = cupy.cuda.MemoryPointer(self._mem, 0)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()
        # The scrub: whatever the previous owner of this device memory left is gone
        # before INIT_GPU is acknowledged.
        self.base.memset_async(0, fb_size, self.stream)
        # Kernel temporaries come from CuPy's pool, outside the FB; capped so one tenant
        # cannot take the device memory other VFs' temporaries need.
        cupy.get_default_memory_pool().set_limit(size=fb_size)
        staging = self.aperture_size - RESERVED_SIZE
        try:
            rt.hostRegister(self._host_ptr + RESERVED_SIZE, staging, 0)
            self.pinned = True
        except Exception as e:
            # Correct without it, only slower (the driver bounces through its own
            # pinned buffers); say so where the operator looks.
            print(f"gpuvirt engine VF{vf}: staging area not pinned ({e})", file=sys.stderr)
            self.pinned = False
        self.stream.synchronize()

    def view(self, desc: BufDesc) -> Any:
        self._check_fb(desc.offset, desc.nbytes, "buffer")
        return self.xp.ndarray(desc.shape, dtype=desc.dtype, memptr=self.base + desc.offset)

    def copy_in(self, copy: Copy) -> None:
        self._check_copy(copy)
        self._rt.memcpyAsync(
            self.base.ptr + copy.fb_offset,
            self._host_ptr + copy.staging_offset,
            copy.nbytes,
            self._rt.memcpyHostToDevice,
            self.stream.ptr,
        )

    def copy_out(self, copy: Copy) -> None:
        self._check_copy(copy)
        self._rt.memcpyAsync(
            self._host_ptr + copy.staging_offset,
            self.base.ptr + copy.fb_offset,
            copy.nbytes,
            self._rt.memcpyDeviceToHost,
            self.stream.ptr,
        )

    def synchronize(self) -> None:
        self.stream.synchronize()

    def to_host(self, value: Any) -> Any:
        """A kernel's result with device arrays turned into numpy arrays, for the guest."""
        xp = self.xp
        if isinstance(value, xp.ndarray):
            return xp.asnumpy(value, stream=self.stream)
        if isinstance(value, tuple | list):
            return type(value)(self.to_host(v) for v in value)
        if isinstance(value, dict):
            return {k: self.to_host(v) for k, v in value.items()}
        return value

    def _check_fb(self, offset: int, nbytes: int, what: str) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(
                f"{what} at FB offset {offset} of {nbytes} bytes is outside the {self.size}-byte FB"
            )

    def _check_copy(self, copy: Copy) -> None:
        self._check_fb(copy.fb_offset, copy.nbytes, "copy")
        end = copy.staging_offset + copy.nbytes
        if copy.staging_offset < RESERVED_SIZE or end > self.aperture_size:
            raise ValueError(
                f"copy of {copy.nbytes} bytes at aperture offset {copy.staging_offset} is "
                f"outside the staging area [{RESERVED_SIZE}, {self.aperture_size})"
            )
