"""Memory files shared with engines and guests: how both backends zero one."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from gpuvirt.errors import DeviceError

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def punch_hole(fd: int, size: int) -> None:
    """Zero [0, size) of a memfd: every mapping reads zeros, the pages go back to the host."""
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, size) != 0:
        err = ctypes.get_errno()
        raise DeviceError(f"scrub failed: fallocate(PUNCH_HOLE): {os.strerror(err)}")
