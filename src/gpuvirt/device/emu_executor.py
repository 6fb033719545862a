"""Inside an emu engine: the FB is a shared mapping and buffers are numpy views of it."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from gpuvirt.protocol.command import BufDesc, Copy
from gpuvirt.protocol.info import PF2VF_OFFSET, RESERVED_SIZE


class EmuExecutor:
    """Inside the engine: the FB is a shared mapping and buffers are numpy views of it."""

    xp: Any = np

    def __init__(self, fb_fd: int, fb_size: int) -> None:
        self.fb = mmap.mmap(fb_fd, fb_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.size = fb_size

    def view(self, desc: BufDesc) -> np.ndarray:
        if desc.offset < 0 or desc.offset + desc.nbytes > self.size:
            raise ValueError(
                f"buffer at offset {desc.offset} of {desc.nbytes} bytes is outside the "
                f"{self.size}-byte FB"
            )
        count = desc.nbytes // np.dtype(desc.dtype).itemsize
        flat = np.frombuffer(self.fb, dtype=desc.dtype, count=count, offset=desc.offset)
        return flat.reshape(desc.shape)

    # The guest maps an emu FB and needs no staging; these copies let the staged path
    # (guest/staging.py, the cuda backend's) run on emu too. The staging area is the
    # unused first 64 KiB of the FB's reserved head (the info blocks start at 64 KiB),
    # or part of the FB the guest took for it (Gpu.add_staging): its own memory either way.
    def copy_in(self, copy: Copy) -> None:
        fb = self._copy_range(copy)
        fb[copy.fb_offset : copy.fb_offset + copy.nbytes] = fb[
            copy.staging_offset : copy.staging_offset + copy.nbytes
        ]

    def copy_out(self, copy: Copy) -> None:
        fb = self._copy_range(copy)
        fb[copy.staging_offset : copy.staging_offset + copy.nbytes] = fb[
            copy.fb_offset : copy.fb_offset + copy.nbytes
        ]

    def _copy_range(self, copy: Copy) -> np.ndarray:
        start, end = copy.staging_offset, copy.staging_offset + copy.nbytes
        if start < 0 or not (end <= PF2VF_OFFSET or RESERVED_SIZE <= start <= end <= self.size):
            raise ValueError(
                f"copy of {copy.nbytes} bytes at staging offset {start} is outside emu's "
                f"staging areas: [0, {PF2VF_OFFSET}) or the FB past its reserved head "
                f"[{RESERVED_SIZE}, {self.size})"
            )
        if copy.fb_offset < RESERVED_SIZE or copy.fb_offset + copy.nbytes > self.size:
            raise ValueError(
                f"copy of {copy.nbytes} bytes at FB offset {copy.fb_offset} is outside the "
                f"FB past its reserved head [{RESERVED_SIZE}, {self.size})"
            )
        return np.frombuffer(self.fb, dtype=np.uint8)

    def synchronize(self) -> None:
        pass
