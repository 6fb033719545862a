"""Inside a cuda engine: the FB is one device allocation, buffers are cupy views of it.

Runs only in the engine process (device/engine.py). CuPy is imported by
`CudaContext.open`, so importing this module needs neither CuPy nor a GPU;
`pool_limit` and `map_arrays` are plain functions for that reason too.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuvirt.errors import DeviceError
from gpuvirt.protocol.command import BufDesc, Copy
from gpuvirt.protocol.info import RESERVED_SIZE

WARM_UP_N = 1024


def _fmt(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n} B"


def pool_limit(scratch: int) -> int:
    """The size for CuPy's MemoryPool.set_limit that caps kernel temporaries at `scratch`.

    CuPy reads a limit of 0 as "no limit"; no scratch at all is a limit no allocation
    fits (CuPy rounds every allocation up to 512 bytes).
    """
    if scratch < 0:
        raise ValueError(f"kernel scratch of {scratch} bytes: must be >= 0")
    return scratch if scratch > 0 else 1


def map_arrays(value: Any, is_array: Callable[[Any], bool], fetch: Callable[[Any], Any]) -> Any:
    """`value` with every array `is_array` recognises replaced by `fetch(array)`, through
    tuples (namedtuples keep their type and fields), lists and dicts."""
    if is_array(value):
        return fetch(value)
    if isinstance(value, tuple):
        items = [map_arrays(v, is_array, fetch) for v in value]
        # A namedtuple's constructor takes its fields as arguments, not one iterable.
        return type(value)._make(items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [map_arrays(v, is_array, fetch) for v in value]
    if isinstance(value, dict):
        return {k: map_arrays(v, is_array, fetch) for k, v in value.items()}
    return value


class BusyClock:
    """The device time of an engine's work, by the device's own clock (CUDA events).

    An event is recorded on the engine's stream before a launch's (or a copy's) work and
    another after the device synchronize that ends it; their elapsed time is what the
    launch kept the device, from its first work to the last of it on any stream, gaps
    between its kernels included (a cooperative engine holds the device for the whole
    launch). The end event goes on a stream the synchronize has just drained, so the
    device passes it within microseconds; it is read when the next launch begins, or when
    the engine drains for IDLE (take), and waited for only if not passed by then: no
    synchronize of its own on the launch path.

    `cuda` is `cupy.cuda` (anything with its Event and get_elapsed_time).
    """

    def __init__(self, cuda: Any, stream: Any) -> None:
        self._cuda = cuda
        self._stream = stream
        self._start = cuda.Event()
        self._end = cuda.Event()
        self._open = False  # a pair recorded whose time is not yet taken

    def start(self) -> int:
        """Mark where a launch's work begins; return the ns of the last one not yet taken."""
        took = self.take()
        self._start.record(self._stream)
        return took

    def stop(self) -> None:
        """Mark where it ended: call after the device synchronize that ends the launch."""
        self._end.record(self._stream)
        self._open = True

    def take(self) -> int:
        """The ns of the launch marked and not yet taken (0 if none)."""
        if not self._open:
            return 0
        self._open = False
        self._end.synchronize()  # passed already, unless taken right after stop()
        return max(0, round(self._cuda.get_elapsed_time(self._start, self._end) * 1e6))


@dataclass(frozen=True)
class CudaContext:
    """The engine's CUDA context on device 0, warmed up.

    Opened before the engine takes a VF (a spare opens it ahead of need), and measured
    by the host's probe the same way (device/cuda.py), so the budgeted context is the
    one engines really hold.
    """

    xp: Any

    @classmethod
    def open(cls) -> CudaContext:
        import cupy

        cupy.cuda.Device(0).use()
        # What a tenant's first kernel would otherwise pay inside its slice, where the
        # host would take the wait for a hang: the cuBLAS handle and its workspace, the
        # module load (and NVRTC compile, on a cold kernel cache) of an elementwise and a
        # reduction kernel, a first allocation through the pool.
        cupy.cuda.device.get_cublas_handle()
        a = cupy.arange(WARM_UP_N, dtype=cupy.float32)
        float(a @ a)
        float((a * 2).sum())
        cupy.cuda.runtime.deviceSynchronize()
        del a
        cupy.get_default_memory_pool().free_all_blocks()
        return cls(cupy)


class CudaExecutor:
    """Inside the engine: the FB is one device allocation, buffers are cupy views of it.

    Everything a tenant's kernel does goes on one non-blocking stream, made current for
    the engine's thread; so do the staging copies. `synchronize` waits for the whole
    context, and the engine calls it after every launch and copy and before
    acknowledging IDLE; `busy` measures on the device how long each of them kept it
    (BusyClock). The engine's device memory is its FB (one cudaMalloc) and its
    kernels' scratch (CuPy's pool, capped), both budgeted by the host (device/budget.py).
    """

    def __init__(
        self, context: CudaContext, aperture_fd: int, fb_size: int, vf: int, scratch: int
    ) -> None:
        cupy = context.xp
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
        # Capped before anything of the tenant's can allocate: one tenant's temporaries
        # cannot take the device memory a restarting VF's FB needs.
        cupy.get_default_memory_pool().set_limit(size=pool_limit(scratch))
        try:
            # cudaMalloc directly, not the memory pool: the FB is one fixed allocation
            # that lives as long as the engine, and the pool's limit is for scratch.
            self._mem = cupy.cuda.Memory(fb_size)
        except Exception as e:
            free, total = rt.memGetInfo()
            raise DeviceError(
                f"VF{vf}: cannot allocate its {_fmt(fb_size)} FB on the device ({e}); "
                f"{_fmt(free)} of {_fmt(total)} free now. The host budgets every engine's "
                "CUDA context and scratch outside the FBs; something else is using the "
                "GPU's memory: lower device.fb_total or raise device.pf_fb"
            ) from None
        self.base = cupy.cuda.MemoryPointer(self._mem, 0)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()
        self.busy = BusyClock(cupy.cuda, self.stream)  # the engine loop publishes BUSY_NS
        # The scrub: whatever the previous owner of this device memory left is gone
        # before INIT_GPU is acknowledged.
        self.base.memset_async(0, fb_size, self.stream)
        staging = self.aperture_size - RESERVED_SIZE
        try:
            rt.hostRegister(self._host_ptr + RESERVED_SIZE, staging, 0)
            self.pinned = True
        except Exception as e:
            # Correct without it, only slower (the driver bounces through its own
            # pinned buffers); say so where the operator looks.
            print(f"gpuvirt engine VF{vf}: staging area not pinned ({e})", file=sys.stderr)
            self.pinned = False
        self.synchronize()

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
        # The whole context, not only our stream: a tenant's kernel may have used streams
        # of its own, and IDLE must mean nothing of this VF runs on the device.
        self._rt.deviceSynchronize()

    def context_lost(self) -> str | None:
        """After a failed launch: the sticky error that poisons this context for good (an
        illegal address, a trap, an uncorrectable ECC error), or None. CUDA returns such an
        error from every call from then on, so a synchronize that still fails after the
        engine's drain means nothing of this VF can run here again; an error of the
        tenant's own Python code leaves the context as it was."""
        try:
            self._rt.deviceSynchronize()
        except Exception as e:  # CUDARuntimeError: CuPy's type, imported with CuPy
            return f"{type(e).__name__}: {e}"
        return None

    def to_host(self, value: Any) -> Any:
        """A kernel's result with device arrays turned into numpy arrays, for the guest."""
        xp = self.xp
        return map_arrays(
            value,
            lambda v: isinstance(v, xp.ndarray),
            lambda v: xp.asnumpy(v, stream=self.stream),
        )

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
