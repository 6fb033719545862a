"""cgroup v2 delegated the way container runtimes do it, against a stand-in cgroupfs
that enforces v2's rules (tests/fake_cgroupfs.py): the module's code runs unchanged."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

import pytest

from fake_cgroupfs import FakeCgroupFs
from gpuvirt.device.sandbox import Mode, Report
from gpuvirt.device.sandbox.cgroup import (
    ENGINES,
    HOST_LEAF,
    SELF,
    EngineCgroup,
    detect,
    own_paths,
    remove_instance,
)
from gpuvirt.device.sandbox.cgroup import ROOT as ROOT_REAL
from gpuvirt.device.sandbox.cgroupfs import REAL, CgroupFs
from gpuvirt.device.sandbox.policy import cgroup_findings, enforce, nproc
from gpuvirt.errors import DeviceError

ROOT = Path("/fake/sys/fs/cgroup")
HOST, HELPER, ENGINE = 1000, 1001, 2000
UNIT = "system.slice/gpuvirt.service"


def machine(unit_offers: set[str], **unit: object) -> tuple[FakeCgroupFs, Path]:
    """A pure v2 machine whose host runs (with a helper process) in UNIT, which its
    parent offers `unit_offers`."""
    fs = FakeCgroupFs(ROOT, {"cpu", "io", "memory", "pids"}, HOST)
    fs.groups[ROOT].subtree = {"cpu", "io", "memory", "pids"}
    fs.group("system.slice", subtree=set(unit_offers))
    return fs, fs.group(UNIT, (HOST, HELPER), **unit)


def test_h200_own_cgroup_offers_memory_only_delegated_like_a_container_runtime() -> None:
    fs, own = machine({"memory"})
    sc = own / "cgroup.subtree_control"
    # What was seen by hand on the H200: the rules the module has to live with.
    with pytest.raises(FileNotFoundError):  # pids is not offered: the whole write fails
        fs.write(sc, "+memory +pids")
    with pytest.raises(OSError) as busy:  # processes in it: no controllers for children
        fs.write(sc, "+memory")
    assert busy.value.errno == errno.EBUSY

    found = detect(ROOT, fs)

    assert found.hier is not None and found.hier.version == 2
    base = own / ENGINES
    assert found.hier.bases == {"memory": base, "freezer": base}
    assert found.hier.describe() == f"v2 (freezer, memory) beneath {base}"
    assert set(found.missing) == {"pids"} and "not offered" in found.missing["pids"]
    # the host's processes moved into a leaf; one write per controller, never two at once
    assert fs.read(own / "cgroup.procs") == ""
    assert fs.groups[own / HOST_LEAF].procs == {HOST, HELPER}
    assert fs.read(SELF) == f"0::/{UNIT}/{HOST_LEAF}\n"
    assert fs.groups[own].subtree == {"memory"}
    assert all(len(t.split()) == 1 for p, t in fs.writes if p.name == "cgroup.subtree_control")
    assert not [p for p in fs.groups if p.name.startswith("trial-")]  # the trial is gone

    # an engine's group below: it takes memory.max and cgroup.freeze, and its kill
    fs.group(f"{UNIT}/{HOST_LEAF}", (ENGINE,))  # the sandbox's first process, just spawned
    cg = EngineCgroup(found.hier, "gpuvirt-1-ab", "vf0-0")
    vf = base / "gpuvirt-1-ab" / "vf0-0"
    cg.limit(1 << 30, 64)
    cg.add(ENGINE)
    assert fs.read(vf / "memory.max") == f"{1 << 30}\n"
    assert not fs.exists(vf / "pids.max")  # not in force: RLIMIT_NPROC stands in
    assert cg.pids() == [ENGINE]
    assert cg._set_frozen(True) and fs.read(vf / "cgroup.freeze") == "1\n"
    cg.kill()
    assert cg.pids() == []
    cg.remove()
    remove_instance(found.hier, "gpuvirt-1-ab")
    assert not fs.exists(vf.parent)


def test_pids_not_offered_takes_the_per_vf_uid_rlimit_or_is_named_missing() -> None:
    fs, _own = machine({"memory"})
    found = detect(ROOT, fs)
    rep = Report(Mode.REQUIRED, active={"bwrap": "x", "identity": "uid/gid 200000 + VF"})
    cgroup_findings(rep, found, per_vf_uid=True, tasks=64)
    assert rep.active["tasks"].startswith(f"RLIMIT_NPROC {nproc(64)} per VF uid (pids: ")
    assert "pids" not in rep.missing and "freezer" in rep.active["cgroup"]
    enforce(rep)  # every part in force, or stood in for
    # not root: no uid of its own per VF, so nothing stands in for pids.max
    rep = Report(Mode.REQUIRED, active={"bwrap": "x"})
    cgroup_findings(rep, found, per_vf_uid=False, tasks=64)
    with pytest.raises(DeviceError, match="pids: not offered to the host's cgroup"):
        enforce(rep)


def test_all_offered_all_in_force() -> None:
    fs, own = machine({"memory", "pids", "io"})
    found = detect(ROOT, fs)
    assert found.hier is not None and found.missing == {}
    assert set(found.hier.bases) == {"memory", "pids", "freezer"}
    assert fs.groups[own].subtree == {"memory", "pids"}  # only what engines need
    cg = EngineCgroup(found.hier, "inst", "vf1-0")
    cg.limit(1 << 20, 32)
    assert fs.read(own / ENGINES / "inst" / "vf1-0" / "pids.max") == "32\n"


def test_memory_not_offered_refuses_and_leaves_the_tree_alone() -> None:
    fs, own = machine({"pids"})
    found = detect(ROOT, fs)
    assert found.hier is None
    assert f"v2: memory not offered to the host's cgroup {own}" in found.missing["cgroup"]
    assert fs.writes == [] and fs.groups[own].procs == {HOST, HELPER}
    rep = Report(Mode.REQUIRED, active={"bwrap": "x"})
    cgroup_findings(rep, found, per_vf_uid=True, tasks=64)
    with pytest.raises(DeviceError, match="cgroup: v2: memory not offered"):
        enforce(rep)


def test_a_cgroup_not_delegated_is_refused_with_the_step_and_errno() -> None:
    fs, own = machine({"memory", "pids"}, writable=False)
    found = detect(ROOT, fs)
    assert found.hier is None
    assert f"creating {own / HOST_LEAF}: [Errno 13]" in found.missing["cgroup"]


def test_a_threaded_cgroup_cannot_take_the_memory_controller() -> None:
    fs, own = machine({"memory", "pids"}, type="threaded")
    found = detect(ROOT, fs)
    assert found.hier is None
    assert (
        f"+memory in {own}/cgroup.subtree_control: [Errno {errno.EOPNOTSUPP}]"
        in (found.missing["cgroup"])
    )


def test_the_real_root_keeps_its_processes() -> None:
    """The root cgroup is exempt from "no internal processes": nothing is moved."""
    fs = FakeCgroupFs(ROOT, {"memory", "pids"}, HOST)
    fs.group("", (HOST, HELPER))
    found = detect(ROOT, fs)
    assert found.hier is not None and found.hier.bases["memory"] == ROOT / ENGINES
    assert fs.groups[ROOT].procs == {HOST, HELPER} and ROOT / HOST_LEAF not in fs.groups


def test_a_host_started_from_an_earlier_hosts_leaf_does_not_nest() -> None:
    fs, own = machine({"memory", "pids"})
    first = detect(ROOT, fs)
    second = detect(ROOT, fs)  # now started from <own>/gv-host
    assert first.hier is not None and second.hier is not None
    assert second.hier.bases == first.hier.bases == {c: own / ENGINES for c in first.hier.bases}


def _scenario(fs: CgroupFs, parent: Path, pid: int, absent: str) -> list[str]:
    """The same steps on a cgroup v2 tree, each answered 'ok' or its errno name."""

    def attempt(fn, *args) -> str:  # type: ignore[no-untyped-def]
        try:
            fn(*args)
        except OSError as e:
            return errno.errorcode[e.errno or 0]
        return "ok"

    child = parent / f"gv-agree-{os.getpid()}"
    fs.mkdir(child)
    try:
        return [
            attempt(fs.write, child / "cgroup.subtree_control", f"+{absent}"),
            attempt(fs.write, child / f"{absent}.max", "max"),  # not enabled: no such file
            attempt(fs.write, child / "cgroup.procs", str(pid)),
            attempt(fs.rmdir, child),  # it holds a process
            attempt(fs.write, child / "cgroup.freeze", "1"),
            attempt(fs.write, child / "cgroup.kill", "1"),
        ]
    finally:
        for _ in range(1000):  # the killed process leaves the group as it is torn down
            if not fs.read(child / "cgroup.procs").strip():
                break
            time.sleep(0.01)
        fs.rmdir(child)


def test_the_stand_in_answers_as_this_machines_kernel_does() -> None:
    """The same steps against the kernel's own v2 tree (here: hybrid's empty one, as
    root) and against the stand-in: the same answers, so the stand-in's rules are the
    kernel's, not our idea of them."""
    v2 = ROOT_REAL / "unified" if (ROOT_REAL / "unified" / "cgroup.procs").exists() else ROOT_REAL
    assert (v2 / "cgroup.procs").exists(), "no cgroup v2 tree mounted"
    parent = v2 / own_paths()[""].lstrip("/")
    offered = set(REAL.read(parent / "cgroup.subtree_control").split())
    absent = next(c for c in ("rdma", "misc", "memory") if c not in offered)
    victim = subprocess.Popen(["sleep", "600"])
    try:
        real = _scenario(REAL, parent, victim.pid, absent)
    finally:
        victim.kill()
        victim.wait()
    # the stand-in as this machine's tree: the same controllers, the same offered
    fake = FakeCgroupFs(ROOT, set(REAL.read(v2 / "cgroup.controllers").split()), HOST)
    fake.group("user.slice", (HOST, ENGINE))
    fake.groups[ROOT].subtree = set(fake.offered)
    fake.group("user.slice", subtree=offered)
    assert real == _scenario(fake, ROOT / "user.slice", ENGINE, absent)
    # the first: ENOENT where the tree has the controller but it is not offered (the
    # H200's pids), EINVAL where the tree has no such controller (a hybrid's memory)
    assert real[0] in ("ENOENT", "EINVAL")
    assert real[1:] == ["ENOENT", "ok", "EBUSY", "ok", "ok"]
