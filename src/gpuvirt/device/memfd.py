"""Shared memory the host hands to guests or engines: sealed memfds, and their scrub.

A guest or an engine that could shrink a memfd the host maps would kill the
host with SIGBUS at its next access to the missing pages (the host reads the
VF2PF block and the status words from such mappings). So every memfd that
leaves the host is sized once and then sealed against shrinking, growing and
further sealing. Writes stay allowed, and so does punching holes (the scrub,
for both backends).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os

from gpuvirt.errors import DeviceError

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def sealed_memfd(name: str, size: int) -> int:
    """A memfd of exactly `size` bytes (sparse) whose size no holder can change."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
            raise DeviceError(f"memfd {name}: the kernel did not apply its seals")
    except OSError as e:
        os.close(fd)
        raise DeviceError(f"memfd {name} of {size} bytes: {e.strerror}") from None
    except DeviceError:
        os.close(fd)
        raise
    return fd


def punch_hole(fd: int, size: int) -> None:
    """Zero [0, size) of a memfd: every mapping reads zeros, the pages go back to the host."""
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, size) != 0:
        err = ctypes.get_errno()
        raise DeviceError(f"scrub failed: fallocate(PUNCH_HOLE): {os.strerror(err)}")
