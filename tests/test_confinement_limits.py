"""Hostile tenant, part 3: who the kernel runs as, what it holds, how much it may
take, and that its VF serves the next tenant after it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import gpuvirt
from confine_env import CANARY, hostile_scene, unique_uid_base
from gpuvirt.device.sandbox import Sandbox, Settings, cgroup
from gpuvirt.device.sandbox.policy import cgroup_findings, nproc, probe
from gpuvirt.errors import GpuvirtError
from gpuvirt.guest.queue import kernel
from helpers import MakeHost, coop_engine, last_seq, wait_event
from hostile import k_allocate, k_identity, k_threads

pytestmark = pytest.mark.timeout(180)


def test_a_root_guests_kernel_runs_as_the_vfs_own_unprivileged_identity(
    make_host: MakeHost,
) -> None:
    assert os.geteuid() == 0  # the attacker (this process) is a root guest
    with hostile_scene(make_host) as sc:
        me = sc.gpu.launch(k_identity).result(30)
        assert (me["uid"], me["euid"], me["gid"]) == (sc.uid(1),) * 3
        assert me["groups"] == []
        assert me["cap_eff"] == me["cap_bnd"] == "0000000000000000"
        assert me["no_new_privs"] == "1" and me["seccomp"] == "2"  # 2: a filter
        assert me["rlimit_core"] == (0, 0)
        assert me["pid"] == 2  # its own pid namespace: its sandbox's init is 1
        # its descriptors are exactly its own: stdio on /dev/null, FB and status area
        # (each twice: Python's mmap keeps a dup), control socket, idle eventfd, its
        # guest's channel and its own epoll; what they are, seen from the host:
        engine = sc.engine_pid(1)
        fds = os.listdir(f"/proc/{engine}/fd")
        links = [os.readlink(f"/proc/{engine}/fd/{fd}") for fd in fds]
        kinds = {"socket" if x.startswith("socket:") else x.split(" ")[0] for x in links}
        assert kinds == {
            "/dev/null", "/memfd:gpuvirt-vf1-fb", "/memfd:gpuvirt-vf1-status", "socket",
            "anon_inode:[eventfd]", "anon_inode:[eventpoll]",  # the last: its own selector
        }, links  # fmt: skip
        assert sum(x.startswith("socket:") for x in links) == 2, links  # control + channel
        other = sc.gpu.launch(k_identity).result(30)
        assert other["fds"] == me["fds"]  # nothing accumulates across launches
        # the neighbour's engine is another identity
        assert os.stat(f"/proc/{sc.engine_pid(0)}").st_uid == sc.uid(0) != sc.uid(1)
        assert sc.neighbour_ok()


def test_six_gib_is_refused_and_only_the_attacker_pays(make_host: MakeHost) -> None:
    with hostile_scene(make_host) as sc:
        limit = sc.hp.admin.vf(1)["fb_total"] + sc.hp.config.engine.memory_allowance
        assert limit < 6 << 30
        after = last_seq(sc.hp)
        with pytest.raises(GpuvirtError):
            sc.gpu.launch(k_allocate, 6 << 30).result(120)
        # the cgroup's OOM kill ended the engine; the host reset the VF
        wait_event(sc.hp, lambda e: e["vf"] == 1 and e["kind"] == "flr.done", after=after)
        assert sc.hp.alive()
        assert sc.neighbour_ok()
        sc.gpu.wait_ready()
        assert sc.gpu.launch(k_allocate, 64 << 20).result(60) == 64  # within the limit: fine
    hp = sc.hp
    with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)) as gpu:  # next tenant
        assert gpu.launch(lambda xp: 5).result(30) == 5


def test_the_cuda_backends_engine_is_spawned_confined_too() -> None:
    """The cooperative engine goes through the same confined spawn: its kernels run as
    the VF's uid, filtered, and die with it."""
    sandbox = Sandbox.create(Settings(uid_base=unique_uid_base()))
    with coop_engine(vf=3, sandbox=sandbox) as (engine, queue):
        me = queue.launch(kernel(k_identity), (), {}).result(30)
        assert me["uid"] == sandbox.settings.uid_base + 3
        assert me["seccomp"] == "2" and me["cap_eff"] == "0000000000000000"
        assert CANARY not in me["env"]
        assert os.stat(f"/proc/{engine.pid}").st_uid == me["uid"]


def test_without_a_pids_controller_the_vfs_uid_is_capped_by_rlimit_nproc() -> None:
    """Where the host's cgroup is not offered the pids controller (the H200's was not),
    a root host caps the VF's uid with RLIMIT_NPROC instead, set on the sandbox before
    the engine exists. Here the pids tree is taken out of what was found."""
    settings = Settings(uid_base=unique_uid_base())
    report, hier = probe(settings)
    assert hier is not None and "pids" in hier.bases
    bases = {c: d for c, d in hier.bases.items() if c != "pids"}
    found = cgroup.Found(cgroup.Hierarchy(hier.version, bases), {"pids": "not offered (test)"})
    cgroup_findings(report, found, per_vf_uid=True, tasks=settings.tasks)
    assert "tasks" in report.active and report.missing == {}
    with coop_engine(vf=2, sandbox=Sandbox(settings, report, found.hier)) as (engine, queue):
        limits = Path(f"/proc/{engine.pid}/limits").read_text()
        assert f"Max processes {nproc(settings.tasks)} " in " ".join(limits.split()), limits
        got = queue.launch(kernel(k_threads), (3 * settings.tasks,), {}).result(60)
        assert got["started"] < nproc(settings.tasks) and "thread" in got["error"], got
