"""The guest's view of its VF's FB: an allocator and Buffers.

The allocator is first-fit over the FB past the reserved head, with blocks
aligned to 256 bytes (what GPU allocators commonly promise). A Buffer is a
descriptor (offset, shape, dtype) plus the VF generation it was made in; a
reset bumps the generation and every older Buffer refuses to be used.
"""

from __future__ import annotations

import bisect
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from gpuvirt.errors import BufferLostError, OutOfMemoryError
from gpuvirt.protocol.command import BufDesc
from gpuvirt.protocol.info import RESERVED_SIZE

if TYPE_CHECKING:
    from gpuvirt.guest.client import Gpu

ALIGN = 256


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class Allocator:
    """First-fit over [start, end); free blocks are kept sorted and coalesced."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self._free: list[tuple[int, int]] = [(start, end - start)]  # (offset, size), sorted
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return sum(self._used.values())

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    @property
    def largest_free(self) -> int:
        return max((size for _, size in self._free), default=0)

    def alloc(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise ValueError(f"allocation of {nbytes} bytes: size must be positive")
        need = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        with self._lock:
            for i, (off, size) in enumerate(self._free):
                if size >= need:
                    if size == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, size - need)
                    self._used[off] = need
                    return off
            raise OutOfMemoryError(
                f"out of FB memory: requested {_fmt(nbytes)}, {_fmt(self.free_bytes)} free, "
                f"largest free block {_fmt(self.largest_free)}; free buffers you no longer need "
                "or ask the operator for a VF with a larger FB"
            )

    def free(self, offset: int) -> None:
        with self._lock:
            size = self._used.pop(offset)
            i = bisect.bisect(self._free, (offset, 0))
            self._free.insert(i, (offset, size))
            # coalesce with the neighbours
            if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
                self._free[i] = (offset, size + self._free.pop(i + 1)[1])
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
                prev = self._free.pop(i - 1)
                self._free[i - 1] = (prev[0], prev[1] + self._free[i - 1][1])

    @classmethod
    def for_fb(cls, fb_size: int) -> Allocator:
        return cls(RESERVED_SIZE, fb_size)


class Buffer:
    """An array in the VF's FB. `write` and `read` copy; `view` (emu) is the memory itself."""

    def __init__(self, gpu: Gpu, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self._gpu = gpu
        self.offset = offset
        self.shape = shape
        self.dtype = dtype
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.generation = gpu.generation
        self.freed = False

    def __repr__(self) -> str:
        return f"<Buffer {self.shape} {self.dtype} at FB+0x{self.offset:x}>"

    def check(self) -> None:
        """Raise unless the buffer can be used: attached, not freed, not lost to a reset.
        Every use of it asks; a subclass adds its own conditions (netgpu's FragBuffer)."""
        self._gpu._check_attached()
        if self.freed:
            raise BufferLostError(f"{self!r} was freed; allocate a new buffer")
        if self.generation != self._gpu.generation:
            raise BufferLostError(
                f"{self!r} was lost when VF{self._gpu.vf} was reset (generation "
                f"{self.generation}, now {self._gpu.generation}); allocate it again and "
                "rewrite its contents"
            )

    @property
    def desc(self) -> BufDesc:
        self.check()
        return BufDesc(self.offset, tuple(self.shape), self.dtype.str)

    def write(self, data: Any) -> None:
        self.check()
        arr = np.ascontiguousarray(data, dtype=self.dtype)
        if arr.shape != self.shape and arr.size != int(np.prod(self.shape)):
            raise ValueError(
                f"cannot write an array of shape {arr.shape} into a buffer of shape {self.shape}"
            )
        self._gpu._fb.write(self.offset, arr.reshape(-1).view(np.uint8))

    def read(self) -> np.ndarray:
        self.check()
        out = np.empty(self.shape, self.dtype)
        self._gpu._fb.read(self.offset, out.reshape(-1).view(np.uint8))
        return out

    def view(self) -> np.ndarray:
        """The FB memory itself as a numpy array (backends with a mapped FB only)."""
        self.check()
        raw = self._gpu._fb.view(self.offset, self.nbytes)
        return raw.view(self.dtype).reshape(self.shape)

    def free(self) -> None:
        if self.freed:
            raise BufferLostError(f"{self!r} was already freed")
        self.freed = True
        if self.generation == self._gpu.generation and not self._gpu.closed:
            self._gpu._allocator.free(self.offset)


class MappedFB:
    """FB access where the guest maps the FB itself (emu): plain memory copies."""

    def __init__(self, mem: Any, size: int) -> None:
        self.mem = mem
        self.array = np.frombuffer(mem, dtype=np.uint8, count=size)

    def write(self, offset: int, data: np.ndarray) -> None:
        self.array[offset : offset + data.size] = data

    def read(self, offset: int, out: np.ndarray) -> None:
        out[:] = self.array[offset : offset + out.size]

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.array[offset : offset + nbytes]

    def close(self) -> None:
        del self.array
