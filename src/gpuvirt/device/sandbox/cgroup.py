"""One cgroup per engine: memory and task limits, and a kill nothing escapes.

Both hierarchies are supported, whichever the machine mounts: cgroup v2 (one
tree, `memory.max`, `pids.max`, `cgroup.freeze`, `cgroup.kill`) and v1 (a tree
per controller: `memory`, `pids`, `freezer`); a hybrid machine whose v2 tree
offers no memory controller uses v1.

cgroup v2 is used the way container runtimes use it (DESIGN.md, "Tenant
confinement"). What counts is what the host's OWN cgroup is offered (its
`cgroup.controllers`), not the root's. A cgroup that holds processes cannot
hand controllers to children ("no internal processes"; the real root cgroup is
exempt), so the host moves every process of its cgroup into a leaf
(`<own>/gv-host`), then enables each offered controller with a write of its own
in `<own>/cgroup.subtree_control` (one write naming a controller that is not
offered fails whole, with ENOENT), and engines live below `<own>/gv-engines`,
in a directory per host instance. What took effect is then tried on a trial
group, so a controller is reported in force only once a limit was written.

Every access goes through a CgroupFs (device/sandbox/cgroupfs.py): the tests
put a stand-in that enforces v2's rules behind it, and give the root path.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuvirt.device.sandbox.cgroupfs import REAL, CgroupFs

ROOT = Path("/sys/fs/cgroup")
SELF = Path("/proc/self/cgroup")
V1_CONTROLLERS = ("memory", "pids", "freezer")
# What engines need handed down on v2. The freezer is no controller there:
# cgroup.freeze is in every non-root cgroup.
V2_CONTROLLERS = ("memory", "pids")
HOST_LEAF = "gv-host"
ENGINES = "gv-engines"
# Processes of the host's cgroup may start others while they are moved; each round
# moves what is there, and a cgroup still not empty after these is given up on.
MOVE_ROUNDS = 5
LIMIT_FILE = {"memory": "memory.max", "pids": "pids.max"}


class Undelegated(Exception):
    """v2 cannot be delegated here; the message says at which step and why."""


@dataclass(frozen=True)
class Hierarchy:
    """Where engine cgroups go: v2's tree, or one v1 tree per controller."""

    version: int
    # controller (and "freezer") -> the directory beneath which host instances go
    bases: dict[str, Path]
    fs: CgroupFs = field(default=REAL, compare=False)

    def describe(self) -> str:
        text = f"v{self.version} ({', '.join(sorted(self.bases))})"
        if self.version == 2:
            text += f" beneath {self.bases['memory']}"
        return text

    @property
    def handed_down(self) -> list[str]:
        """v2: the controllers each level below the engines' base enables for the next."""
        return [c for c in V2_CONTROLLERS if c in self.bases] if self.version == 2 else []


@dataclass
class Found:
    """What detect() found: the hierarchy (None: no memory limit can be had) and, per
    controller not in force (or "cgroup" when none is), why not."""

    hier: Hierarchy | None
    missing: dict[str, str]


def own_paths(fs: CgroupFs = REAL) -> dict[str, str]:
    """controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out: dict[str, str] = {}
    for line in fs.read(SELF).splitlines():
        _id, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def detect(root: Path = ROOT, fs: CgroupFs = REAL) -> Found:
    """The hierarchy engines can use here, delegated (v2) and tried."""
    try:
        own = own_paths(fs)
    except OSError as e:
        return Found(None, {"cgroup": f"cannot read {SELF}: {e}"})
    why: list[str] = []
    if "" in own:
        v2 = root / "unified" if fs.exists(root / "unified" / "cgroup.controllers") else root
        if fs.exists(v2 / "cgroup.controllers"):
            found = _v2(v2 / own[""].lstrip("/"), fs)
            if found.hier is not None:
                return found
            named = (v if k == "cgroup" else f"{k} {v}" for k, v in found.missing.items())
            why.append(f"v2: {'; '.join(named)}")
    found = _v1(root, own, fs)
    if found.hier is None:
        why.append(f"v1: {found.missing['cgroup']}")
        return Found(None, {"cgroup": "; ".join(why)})
    return found


def _v2(own: Path, fs: CgroupFs) -> Found:
    try:
        offered = fs.read(own / "cgroup.controllers").split()
    except OSError as e:
        return Found(None, {"cgroup": f"cannot read {own}/cgroup.controllers: {e}"})
    missing = {
        c: f"not offered to the host's cgroup {own} (its cgroup.controllers: "
        f"{' '.join(offered) or 'none'})"
        for c in V2_CONTROLLERS
        if c not in offered
    }
    if "memory" in missing:  # nothing stands in for a memory limit: do not touch the tree
        return Found(None, missing)
    try:
        base = _delegate(own, [c for c in V2_CONTROLLERS if c in offered], missing, fs)
        freeze = _try_limits(base, [c for c in V2_CONTROLLERS if c not in missing], fs)
    except Undelegated as e:
        return Found(None, {"cgroup": str(e)})
    bases = {c: base for c in V2_CONTROLLERS if c not in missing}
    if freeze is None:
        bases["freezer"] = base
    else:
        missing["freezer"] = freeze
    return Found(Hierarchy(2, bases, fs), missing)


def _delegate(own: Path, offered: list[str], missing: dict[str, str], fs: CgroupFs) -> Path:
    """Move the host's cgroup's processes into a leaf, enable each offered controller
    in it, and make the engines' base; return the base. A controller the kernel refuses
    goes into `missing` with the kernel's answer."""
    if own.name == HOST_LEAF:  # a host started from a leaf an earlier one made
        own = own.parent
    if fs.exists(own / "cgroup.type"):  # not the real root: no internal processes
        leaf = own / HOST_LEAF
        _step(f"creating {leaf}", _mkdir, leaf, fs)
        _step(f"moving the processes of {own} into {leaf}", _move_all, own, leaf, fs)
    for c in offered:
        try:
            fs.write(own / "cgroup.subtree_control", f"+{c}")
        except OSError as e:
            missing[c] = f"+{c} in {own}/cgroup.subtree_control: {e}"
    if "memory" in missing:
        raise Undelegated(missing["memory"])
    base = own / ENGINES
    _step(f"creating {base}", _mkdir, base, fs)
    _step(
        f"enabling controllers in {base}",
        enable,
        base,
        [c for c in offered if c not in missing],
        fs,
    )
    return base


def _try_limits(base: Path, controllers: list[str], fs: CgroupFs) -> str | None:
    """Write each limit (and the freeze) in a trial group, so that nothing is reported
    in force that was not seen to take one. Returns why the freeze did not take, or None."""
    trial = base / f"trial-{os.getpid()}"
    _step(f"creating {trial}", _mkdir, trial, fs)
    try:
        for c in controllers:
            _step(f"a limit in {trial}", fs.write, trial / LIMIT_FILE[c], "max")
        try:
            fs.write(trial / "cgroup.freeze", "0")
        except OSError as e:
            return f"cgroup.freeze in {trial}: {e}"
        return None
    finally:
        with contextlib.suppress(OSError):
            fs.rmdir(trial)


def _step(what: str, fn: Callable[..., object], *args: object) -> None:
    try:
        fn(*args)
    except OSError as e:
        raise Undelegated(f"{what}: {e}") from None


def _mkdir(d: Path, fs: CgroupFs) -> None:
    with contextlib.suppress(FileExistsError):
        fs.mkdir(d)


def _move_all(src: Path, dst: Path, fs: CgroupFs) -> None:
    for _ in range(MOVE_ROUNDS):
        pids = fs.read(src / "cgroup.procs").split()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                fs.write(dst / "cgroup.procs", pid)
    raise OSError(f"{src} still holds processes after {MOVE_ROUNDS} rounds")


def enable(d: Path, controllers: list[str], fs: CgroupFs) -> None:
    """Hand each controller to d's children, a write each (idempotent)."""
    for c in controllers:
        fs.write(d / "cgroup.subtree_control", f"+{c}")


def _v1(root: Path, own: dict[str, str], fs: CgroupFs) -> Found:
    bases: dict[str, Path] = {}
    missing: dict[str, str] = {}
    for c in V1_CONTROLLERS:
        base = root / c / own.get(c, "/").lstrip("/")
        if fs.exists(root / c / "cgroup.procs") and _writable(base):
            bases[c] = base
        else:
            missing[c] = f"v1 {c} not mounted or not writable at {base}"
    if "memory" not in bases:
        return Found(None, {"cgroup": "; ".join(missing.values())})
    return Found(Hierarchy(1, bases, fs), missing)


def _writable(d: Path) -> bool:
    return d.is_dir() and os.access(d, os.W_OK)


class EngineCgroup:
    """The cgroup of one engine: created empty, the sandbox's first process put in
    it before it starts the engine (everything after inherits it), removed at kill."""

    def __init__(self, hier: Hierarchy, instance: str, name: str) -> None:
        self.hier = hier
        self.fs = hier.fs
        self.dirs: dict[str, Path] = {}
        for c, base in hier.bases.items():
            d = base / instance / name
            if d not in self.dirs.values():
                _mkdir(d.parent, self.fs)
                enable(d.parent, hier.handed_down, self.fs)
                self.fs.mkdir(d)
            self.dirs[c] = d

    def limit(self, memory: int, tasks: int) -> None:
        """The memory limit, and the task limit where the pids controller is in force
        (elsewhere the sandbox's RLIMIT_NPROC stands in: device/sandbox/policy.py)."""
        mem, fs = self.dirs["memory"], self.fs
        if self.hier.version == 2:
            fs.write(mem / "memory.max", str(memory))
            with contextlib.suppress(OSError):  # no swap accounting: nothing to cap
                fs.write(mem / "memory.swap.max", "0")
        else:
            fs.write(mem / "memory.limit_in_bytes", str(memory))
            with contextlib.suppress(OSError):
                fs.write(mem / "memory.memsw.limit_in_bytes", str(memory))
        if "pids" in self.dirs:
            fs.write(self.dirs["pids"] / "pids.max", str(tasks))

    def add(self, pid: int) -> None:
        for d in dict.fromkeys(self.dirs.values()):
            self.fs.write(d / "cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        try:
            text = self.fs.read(self.dirs["memory"] / "cgroup.procs")
        except FileNotFoundError:
            return []
        return [int(p) for p in text.split()]

    def kill(self) -> None:
        """SIGKILL everything in the group and wait until it is empty.

        v2 has cgroup.kill. Elsewhere the group is frozen first, so nothing in it can
        fork or move between the listing and the kill, then killed and thawed.
        """
        main = self.dirs["memory"]
        if self.hier.version == 2 and self.fs.exists(main / "cgroup.kill"):
            self.fs.write(main / "cgroup.kill", "1")
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
            self.fs.write(d / "cgroup.freeze", "1" if frozen else "0")
        else:
            self.fs.write(d / "freezer.state", "FROZEN" if frozen else "THAWED")
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
                self.fs.rmdir(d)


def remove_instance(hier: Hierarchy, instance: str) -> None:
    """The host's directory of engine groups, once the host is done with it."""
    for base in dict.fromkeys(hier.bases.values()):
        with contextlib.suppress(OSError):
            hier.fs.rmdir(base / instance)
