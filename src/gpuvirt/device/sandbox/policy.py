"""What confinement the host can give its engines, and what it requires.

Checked once at host start: each protection is either in force (with what
took effect) or missing (with why). `required` refuses to start a host with a
protection missing, `best-effort` starts with what there is and says so, `off`
(development only) confines nothing and says so everywhere.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from gpuvirt import defaults as D
from gpuvirt.device.sandbox import cgroup, landlock, seccomp
from gpuvirt.device.sandbox.bwrap import tool
from gpuvirt.errors import DeviceError

INSTALL_HINT = "apt-get install -y bubblewrap libseccomp2 util-linux"
# Engines alive at once under one VF's uid: its engine and that engine's spare.
ENGINES_PER_UID = 2


class Mode(StrEnum):
    REQUIRED = "required"
    BEST_EFFORT = "best-effort"
    OFF = "off"


@dataclass(frozen=True)
class Settings:
    """`[engine]` as the device layer needs it (the host's config validates the values
    and builds this: host/confinement.py)."""

    mode: Mode = Mode.REQUIRED  # as config.DEFAULT_SANDBOX
    uid_base: int = D.DEFAULT_UID_BASE
    memory: int | None = None  # None: the VF's FB plus memory_allowance
    memory_allowance: int = D.DEFAULT_MEMORY_ALLOWANCE
    tasks: int = D.DEFAULT_ENGINE_TASKS
    nofile: int = D.DEFAULT_ENGINE_NOFILE
    scratch: int = D.DEFAULT_ENGINE_SCRATCH
    backend: str = "emu"


@dataclass
class Report:
    """Protection name -> what took effect; missing name -> why not."""

    mode: Mode
    active: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)

    @property
    def confined(self) -> bool:
        return "bwrap" in self.active

    def line(self) -> str:
        if self.mode is Mode.OFF:
            return 'engine sandbox OFF (engine.sandbox = "off"): engines run unconfined as the host'
        have = ", ".join(f"{k}: {v}" for k, v in self.active.items())
        text = f"engine sandbox {self.mode}: {have or 'nothing in force'}"
        if self.missing:
            text += "; MISSING " + "; ".join(f"{k}: {v}" for k, v in self.missing.items())
        return text

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": str(self.mode),
            "confined": self.confined,
            "active": dict(self.active),
            "missing": dict(self.missing),
        }


def _bwrap_works(bwrap: str, userns: bool) -> str | None:
    """None when bwrap can make the namespaces here, else its complaint."""
    cmd = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--die-with-parent"]
    if userns:
        cmd += ["--unshare-user"]
    cmd += ["--ro-bind", "/", "/", "--", "/usr/bin/true"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


def probe(s: Settings) -> tuple[Report, cgroup.Hierarchy | None]:
    rep = Report(s.mode)
    if s.mode is Mode.OFF:
        return rep, None
    root = os.geteuid() == 0
    bwrap = tool("bwrap")
    if bwrap is None:
        rep.missing["bwrap"] = f"bubblewrap not installed (as root: {INSTALL_HINT})"
    elif (err := _bwrap_works(bwrap, not root)) is not None:
        rep.missing["bwrap"] = f"{bwrap} cannot create namespaces here: {err}"
    else:
        rep.active["bwrap"] = f"{bwrap} (mount, pid, ipc, net, uts namespaces)"
    if root:
        if tool("setpriv") is None:
            rep.missing["identity"] = "setpriv (util-linux) not installed"
        else:
            rep.active["identity"] = f"uid/gid {s.uid_base} + VF index, no capabilities"
    elif "bwrap" in rep.active:
        rep.active["identity"] = "user namespace (host is not root), no capabilities"
    else:
        rep.missing["identity"] = "needs bwrap"
    why = seccomp.available()
    if why is None:
        rep.active["seccomp"] = seccomp.summary()
    else:
        rep.missing["seccomp"] = (
            f"{why}: processes an engine starts would escape the world switch "
            f"(as root: {INSTALL_HINT})"
        )
    found = cgroup.detect()
    cgroup_findings(rep, found, per_vf_uid=root and "identity" in rep.active, tasks=s.tasks)
    abi, why = landlock.abi()
    if abi:
        rep.active["landlock"] = f"ABI {abi}"
    else:
        # Landlock is the second wall; the mount namespace is the first.
        rep.missing["landlock"] = why or "kernel without Landlock"
    rep.active["rlimits"] = f"nofile {s.nofile}, core 0"
    return rep, found.hier


def nproc(tasks: int) -> int:
    """RLIMIT_NPROC standing in for pids.max: it counts the tasks of a uid, and a VF's
    uid runs its engine and that engine's spare (device/spare.py)."""
    return tasks * ENGINES_PER_UID


def cgroup_findings(rep: Report, found: cgroup.Found, per_vf_uid: bool, tasks: int) -> None:
    """What the cgroups give, into the report: a controller not in force is named as
    missing unless a stated fallback covers it. The pids controller's is RLIMIT_NPROC,
    where every VF has a uid of its own (a root host: setpriv); the memory limit has
    none; on v2 the freezer is cgroup.freeze, in every cgroup's core."""
    if found.hier is None:
        rep.missing["cgroup"] = "; ".join(found.missing.values())
        return
    rep.active["cgroup"] = found.hier.describe()
    for c, why in found.missing.items():
        if c == "pids" and per_vf_uid:
            rep.active["tasks"] = f"RLIMIT_NPROC {nproc(tasks)} per VF uid (pids: {why})"
        else:
            rep.missing[c] = why


def enforce(rep: Report) -> None:
    """`required` with any protection missing: refuse to start, naming each."""
    essential = {k: v for k, v in rep.missing.items() if k != "landlock"}
    if rep.mode is Mode.REQUIRED and essential:
        raise DeviceError(
            'engine.sandbox = "required" but engines cannot be confined here: '
            + "; ".join(f"{k}: {v}" for k, v in essential.items())
            + '. Install what is missing, or set engine.sandbox = "best-effort" '
            '(start with what there is) or "off" (development only)'
        )
