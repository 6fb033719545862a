"""The cgroup module's only way to the cgroup filesystem, so that tests can put a
stand-in behind it that enforces the kernel's rules (tests/fake_cgroupfs.py)
while the module's code runs unchanged.

A control file is written with one write(2) on a descriptor opened without
O_CREAT: the kernel answers each write on its own (enabling two controllers in
one write fails whole when one is not offered), and a control file that does
not exist (a controller not enabled) is ENOENT, not cgroupfs's EACCES for a
file it may not create.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol


class CgroupFs(Protocol):
    def read(self, path: Path) -> str: ...

    def write(self, path: Path, text: str) -> None: ...

    def mkdir(self, path: Path) -> None: ...

    def rmdir(self, path: Path) -> None: ...

    def exists(self, path: Path) -> bool: ...


class RealFs:
    def read(self, path: Path) -> str:
        return path.read_text()

    def write(self, path: Path, text: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def mkdir(self, path: Path) -> None:
        path.mkdir()

    def rmdir(self, path: Path) -> None:
        path.rmdir()

    def exists(self, path: Path) -> bool:
        return path.exists()


REAL = RealFs()
