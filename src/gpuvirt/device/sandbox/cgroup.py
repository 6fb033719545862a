"""One cgroup per engine: memory and task limits, and a kill nothing escapes.

Both hierarchies are supported: cgroup v2 (one tree, `memory.max`, `pids.max`,
`cgroup.kill`) and v1 (a tree per controller: `memory`, `pids`, `freezer`),
whichever the machine mounts; a hybrid machine with an empty v2 tree uses v1.
Groups are created beneath the host's own cgroup, in a directory named after
the host instance, so hosts running side by side never share one.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "freezer")


@dataclass(frozen=True)
class Hierarchy:
    """Where engine cgroups go: the v2 tree, or one v1 tree per controller."""

    version: int
    # controller -> the host's own cgroup directory in that controller's tree
    bases: dict[str, Path]

    def describe(self) -> str:
        return f"v{self.version} ({', '.join(sorted(self.bases))})"


def _own_paths() -> dict[str, str]:
    """controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _writable(d: Path) -> bool:
    return d.is_dir() and os.access(d, os.W_OK)


def detect() -> tuple[Hierarchy | None, str]:
    """The hierarchy engines can use here, or None and why not."""
    try:
        own = _own_paths()
    except OSError as e:
        return None, f"cannot read /proc/self/cgroup: {e}"
    v2_root = ROOT / "unified" if (ROOT / "unified" / "cgroup.controllers").exists() else ROOT
    if (v2_root / "cgroup.controllers").exists() and "" in own:
        base = v2_root / own[""].lstrip("/")
        have = set((v2_root / "cgroup.controllers").read_text().split())
        if {"memory", "pids"} <= have and _writable(base):
            return Hierarchy(2, {"memory": base, "pids": base, "freezer": base}), ""
    bases = {}
    why = []
    for c in V1_CONTROLLERS:
        base = ROOT / c / own.get(c, "/").lstrip("/")
        if (ROOT / c / "cgroup.procs").exists() and _writable(base):
            bases[c] = base
        else:
            why.append(f"v1 {c} not mounted or not writable at {base}")
    if {"memory", "pids"} <= set(bases):
        return Hierarchy(1, bases), "; ".join(why)
    return None, "; ".join(why) or "no cgroup v1 memory/pids and no usable v2 tree"


class EngineCgroup:
    """The cgroup of one engine: created empty, the sandbox's first process put in
    it before it starts the engine (everything after inherits it), removed at kill."""

    def __init__(self, hier: Hierarchy, instance: str, name: str) -> None:
        self.hier = hier
        self.dirs: dict[str, Path] = {}
        for c, base in hier.bases.items():
            d = base / instance / name
            if d in self.dirs.values():
                self.dirs[c] = d
                continue
            d.mkdir(parents=True, exist_ok=False)
            self.dirs[c] = d
        if hier.version == 2:
            parent = self.dirs["memory"].parent
            # Controllers reach a child only through the parent's subtree_control.
            with contextlib.suppress(OSError):
                (parent / "cgroup.subtree_control").write_text("+memory +pids")

    def limit(self, memory: int, tasks: int) -> None:
        mem, pids = self.dirs["memory"], self.dirs["pids"]
        if self.hier.version == 2:
            (mem / "memory.max").write_text(str(memory))
            with contextlib.suppress(OSError):  # no swap accounting: nothing to cap
                (mem / "memory.swap.max").write_text("0")
        else:
            (mem / "memory.limit_in_bytes").write_text(str(memory))
            with contextlib.suppress(OSError):
                (mem / "memory.memsw.limit_in_bytes").write_text(str(memory))
        (pids / "pids.max").write_text(str(tasks))

    def add(self, pid: int) -> None:
        for d in dict.fromkeys(self.dirs.values()):
            (d / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        try:
            text = (self.dirs["pids"] / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(p) for p in text.split()]

    def memory_peak(self) -> int:
        mem = self.dirs["memory"]
        name = "memory.peak" if self.hier.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((mem / name).read_text())
        except (OSError, ValueError):
            return 0

    def kill(self) -> None:
        """SIGKILL everything in the group and wait until it is empty.

        v2 has cgroup.kill. On v1 the group is frozen first, so nothing in it can
        fork or move between the listing and the kill, then killed and thawed.
        """
        if self.hier.version == 2 and (self.dirs["pids"] / "cgroup.kill").exists():
            (self.dirs["pids"] / "cgroup.kill").write_text("1")
        else:
            frozen = self._set_frozen(True)
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if frozen:
                self._set_frozen(False)
        self._wait_empty()

    def _set_frozen(self, frozen: bool) -> bool:
        d = self.dirs.get("freezer")
        if d is None:
            return False
        if self.hier.version == 2:
            (d / "cgroup.freeze").write_text("1" if frozen else "0")
        else:
            (d / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
        return True

    def _wait_empty(self) -> None:
        # A pidfd per member: readable once it is gone (killed members die at once;
        # the wait is for the kernel to finish tearing them down).
        for pid in self.pids():
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            try:
                select.select([fd], [], [], 10.0)
            finally:
                os.close(fd)

    def remove(self) -> None:
        for d in dict.fromkeys(self.dirs.values()):
            with contextlib.suppress(OSError):
                d.rmdir()


def remove_instance(hier: Hierarchy, instance: str) -> None:
    """The host's directory of engine groups, once the host is done with it."""
    for base in dict.fromkeys(hier.bases.values()):
        with contextlib.suppress(OSError):
            (base / instance).rmdir()
