"""A stand-in cgroup v2 filesystem behind the cgroup module's seam (CgroupFs), with
the kernel's rules (Documentation/admin-guide/cgroup-v2.rst) enforced, so that
the delegation logic runs unchanged against machines we do not have.

A tree of groups under `root`; each has its processes, its subtree_control and
its limits. What a group may use (its cgroup.controllers) is its parent's
subtree_control (the root's: what the kernel offers). Enforced:
- a controller enabled in subtree_control must be in the group's
  cgroup.controllers, else ENOENT (EINVAL for one this tree does not have at
  all: unknown, or bound to a v1 tree); one write naming several is all or
  nothing;
- no internal processes: a non-root group with processes cannot enable a
  controller (EBUSY), one with controllers enabled cannot take a process
  (EBUSY); the root is exempt;
- a controller cannot be disabled while a child enables it (EBUSY);
- a threaded group cannot enable a domain controller (EOPNOTSUPP);
- a controller's files exist only where it is enabled (ENOENT, no create);
- cgroup.procs moves a process (ESRCH for one that does not exist);
- rmdir of a group with processes or children is EBUSY;
- a group not delegated to the caller refuses every write (EACCES).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

from gpuvirt.device.sandbox.cgroup import SELF

CORE = ("cgroup.controllers", "cgroup.subtree_control", "cgroup.procs")
NON_ROOT_CORE = ("cgroup.type", "cgroup.freeze", "cgroup.kill", "cgroup.events")
FILES = {"memory": ("memory.max", "memory.peak", "memory.swap.max"), "pids": ("pids.max",)}
DOMAIN = {"memory", "io"}


@dataclass
class Group:
    procs: set[int] = field(default_factory=set)
    subtree: set[str] = field(default_factory=set)
    values: dict[str, str] = field(default_factory=dict)
    type: str = "domain"
    writable: bool = True
    frozen: bool = False


def _err(code: int, path: Path) -> OSError:
    return OSError(code, os.strerror(code), str(path))


class FakeCgroupFs:
    def __init__(self, root: Path, offered: set[str], self_pid: int) -> None:
        self.root = root
        self.offered = offered
        self.self_pid = self_pid
        self.groups: dict[Path, Group] = {root: Group()}
        self.writes: list[tuple[Path, str]] = []  # every write that succeeded, in order

    # ---- setting the scene ------------------------------------------------------------

    def group(self, rel: str, procs: tuple[int, ...] = (), **kw: object) -> Path:
        """A group (and any parent missing) as the machine made it, processes moved in."""
        path = self.root / rel.strip("/")
        for p in reversed([path, *path.parents]):
            if p.is_relative_to(self.root) and p not in self.groups:
                self.groups[p] = Group()
        for k, v in kw.items():
            setattr(self.groups[path], k, v)
        for pid in procs:
            self._place(pid, path)
        return path

    def where(self, pid: int) -> Path:
        return next(p for p, g in self.groups.items() if pid in g.procs)

    def _place(self, pid: int, path: Path) -> None:
        for g in self.groups.values():
            g.procs.discard(pid)
        self.groups[path].procs.add(pid)

    # ---- the kernel's view --------------------------------------------------------------

    def controllers(self, path: Path) -> set[str]:
        if path == self.root:
            return set(self.offered)
        return set(self.groups[path.parent].subtree)

    def _split(self, path: Path) -> tuple[Group, str]:
        """(group, file name) of a control file that exists, else ENOENT."""
        g = self.groups.get(path.parent)
        if g is None:
            raise _err(errno.ENOENT, path)
        name = path.name
        ok = name in CORE or (path.parent != self.root and name in NON_ROOT_CORE)
        ok = ok or (
            any(name in FILES.get(c, ()) for c in self.controllers(path.parent))
            and path.parent != self.root
        )
        if not ok:
            raise _err(errno.ENOENT, path)
        return g, name

    def read(self, path: Path) -> str:
        if path == SELF:
            rel = self.where(self.self_pid).relative_to(self.root).as_posix()
            return f"0::/{'' if rel == '.' else rel}\n"
        g, name = self._split(path)
        d = path.parent
        if name == "cgroup.controllers":
            return " ".join(sorted(self.controllers(d))) + "\n"
        if name == "cgroup.subtree_control":
            return " ".join(sorted(g.subtree)) + "\n"
        if name == "cgroup.procs":
            return "".join(f"{p}\n" for p in sorted(g.procs))
        if name == "cgroup.type":
            return g.type + "\n"
        if name == "cgroup.freeze":
            return "1\n" if g.frozen else "0\n"
        return g.values.get(name, "max") + "\n"

    def write(self, path: Path, text: str) -> None:
        g, name = self._split(path)
        d = path.parent
        if not g.writable:
            raise _err(errno.EACCES, path)
        if name == "cgroup.subtree_control":
            self._subtree(d, g, text.split())
        elif name == "cgroup.procs":
            pid = int(text)
            if not any(pid in x.procs for x in self.groups.values()):
                raise _err(errno.ESRCH, path)
            if d != self.root and g.subtree:
                raise _err(errno.EBUSY, path)
            self._place(pid, d)
        elif name == "cgroup.freeze":
            g.frozen = text.strip() == "1"
        elif name == "cgroup.kill":
            g.procs.clear()
        elif name in ("cgroup.controllers", "cgroup.type", "cgroup.events", "memory.peak"):
            raise _err(errno.EACCES, path)  # read-only files
        else:
            value = text.strip()
            if value != "max" and not value.isdigit():
                raise _err(errno.EINVAL, path)
            g.values[name] = value
        self.writes.append((path, text))

    def _subtree(self, d: Path, g: Group, tokens: list[str]) -> None:
        path = d / "cgroup.subtree_control"
        if not tokens or any(t[:1] not in "+-" or len(t) < 2 for t in tokens):
            raise _err(errno.EINVAL, path)
        enable = {t[1:] for t in tokens if t[0] == "+"}
        disable = {t[1:] for t in tokens if t[0] == "-"}
        if not (enable | disable) <= self.offered:  # unknown, or bound to a v1 tree
            raise _err(errno.EINVAL, path)
        if not enable <= self.controllers(d):
            raise _err(errno.ENOENT, path)
        if enable - g.subtree and d != self.root and g.procs:
            raise _err(errno.EBUSY, path)
        if g.type == "threaded" and enable & DOMAIN:
            raise _err(errno.EOPNOTSUPP, path)
        for child in self._children(d):
            if disable & self.groups[child].subtree:
                raise _err(errno.EBUSY, path)
        g.subtree = (g.subtree | enable) - disable

    def _children(self, d: Path) -> list[Path]:
        return [p for p in self.groups if p.parent == d and p != d]

    def mkdir(self, path: Path) -> None:
        parent = self.groups.get(path.parent)
        if parent is None:
            raise _err(errno.ENOENT, path)
        if path in self.groups:
            raise _err(errno.EEXIST, path)
        if not parent.writable:
            raise _err(errno.EACCES, path)
        self.groups[path] = Group(type="threaded" if parent.type == "threaded" else "domain")

    def rmdir(self, path: Path) -> None:
        g = self.groups.get(path)
        if g is None:
            raise _err(errno.ENOENT, path)
        if g.procs or self._children(path):
            raise _err(errno.EBUSY, path)
        del self.groups[path]

    def exists(self, path: Path) -> bool:
        if path in self.groups:
            return True
        try:
            self._split(path)
        except OSError:
            return False
        return True
