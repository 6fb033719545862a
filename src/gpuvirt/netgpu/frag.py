"""A fragment: bytes of one stream that landed in the pool, and how to use them in place.

`frag.array()` is a numpy view of the FB memory itself; `frag.buffer()` is a
Buffer descriptor for `gpu.launch`, so a kernel in the engine reads the same
memory (the descriptor crosses, never the data). Both are valid while the
fragment's token is held; after `pool.release` they refuse to be used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from gpuvirt.guest.api import Buffer
from gpuvirt.netgpu.errors import NetGPUError

if TYPE_CHECKING:
    from gpuvirt.netgpu.pool import Pool


class Frag(NamedTuple):
    """(offset, size, token) in the VF's FB, from `stream`, `seq`-th fragment of that stream.

    Framed mode adds `message` (the header's seq) and `last` (the message's
    final fragment); a message larger than a chunk arrives as several
    fragments with the same `message`. Raw mode: `message` is None, `last` True.
    A tuple, because a receiver makes one per read and tuples are cheap to make.
    """

    offset: int  # in the VF's FB
    size: int
    token: int
    stream: int
    seq: int
    message: int | None
    last: bool
    pool: Pool

    def __repr__(self) -> str:
        msg = "" if self.message is None else f" message={self.message} last={self.last}"
        return (
            f"Frag(offset=0x{self.offset:x}, size={self.size}, token={self.token}, "
            f"stream={self.stream}, seq={self.seq}{msg})"
        )

    def array(self, dtype: Any = np.uint8) -> np.ndarray:
        """The fragment's bytes in device memory as a 1-D array (a view; nothing is copied)."""
        pool = self.pool
        pool.check_token(self.token)
        if pool.memory is None:
            raise NetGPUError(
                f"this fragment is in device memory that this process cannot map "
                f"({pool.provider.name}); use frag.buffer() as a kernel argument, or "
                "frag.buffer().read() for a host copy"
            )
        start = self.offset - pool.offset
        return pool.memory[start : start + self.size].view(_dtype_for(self, dtype))

    def buffer(self, dtype: Any = np.uint8) -> Buffer:
        """A Buffer over the fragment for `gpu.launch`: the kernel sees the FB memory in place."""
        return FragBuffer(self, _dtype_for(self, dtype))


make_frag = (
    tuple.__new__
)  # make_frag(Frag, (offset, size, token, stream, seq, message, last, pool))


def _dtype_for(frag: Frag, dtype: Any) -> np.dtype:
    dt = np.dtype(dtype)
    if frag.size % dt.itemsize:
        raise ValueError(
            f"fragment of {frag.size} bytes is not a whole number of {dt} items "
            f"({dt.itemsize} bytes each); use framed messages sized in whole items"
        )
    return dt


class FragBuffer(Buffer):
    """A Buffer the pool owns: valid while the fragment's token is held, never freed by hand."""

    def __init__(self, frag: Frag, dtype: np.dtype) -> None:
        pool = frag.pool
        pool.check_token(frag.token)
        super().__init__(pool._gpu, frag.offset, (frag.size // dtype.itemsize,), dtype)
        self.generation = pool.generation  # the pool's, not whatever the VF's is now
        self.frag = frag

    def check(self) -> None:
        super().check()
        self.frag.pool.check_token(self.frag.token)

    def free(self) -> None:
        raise NetGPUError(
            f"{self!r} belongs to a NetGPU pool; release its token with "
            f"pool.release([{self.frag.token}]) instead of freeing it"
        )
