"""Landlock inside the engine: read and execute anywhere it can see, write only scratch.

bwrap's mount namespace already decides what the engine sees; Landlock is the
second, independent wall (a bind mount made writable by mistake, a path bwrap
did not hide) and is applied by the engine to itself before any tenant code
runs, through the `landlock` binding (ctypes over the three syscalls).
"""

from __future__ import annotations

import ctypes
import os

from landlock import FSAccess, LandlockError, Ruleset, landlock_abi_version

READ = FSAccess.READ_FILE | FSAccess.READ_DIR | FSAccess.EXECUTE


def abi() -> tuple[int, str]:
    """The kernel's Landlock ABI version (0 when absent) and why it is absent."""
    try:
        return landlock_abi_version(), ""
    except (LandlockError, OSError, AttributeError, ctypes.ArgumentError) as e:
        return 0, f"Landlock unavailable: {e}"


def restrict_self(writable: list[str]) -> None:
    """From now on this process (and its threads to come) writes only beneath
    `writable` (plus /dev, for /dev/null and the like) and reads what it sees."""
    rules = Ruleset()
    rules.allow("/", rules=READ)
    dev = READ | FSAccess.WRITE_FILE
    if landlock_abi_version() >= 5:  # cuda: the driver is ioctls on /dev/nvidia*
        dev |= FSAccess.IOCTL_DEV
    rules.allow("/dev", rules=dev)
    for path in writable:
        rules.allow(path)
    rules.apply()
    # The binding keeps the ruleset's descriptor open; the engine keeps only its own.
    os.close(rules._fd)
