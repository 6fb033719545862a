"""Hostile tenant, part 1: another VF's memory, secrets and the host's files.

Each attack runs as a kernel on VF 1 (a root guest's kernel) and must fail by
what the kernel answers; a control shows the same operation works where it is
the tenant's own.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

import gpuvirt
from confine_env import CANARY, hostile_scene
from gpuvirt.device.emu import EmuEngine
from gpuvirt.device.sandbox.launch import BASE_ENV, PASSED_ENV_PREFIXES
from helpers import MakeHost, bound_under_tmp, fb_fds
from hostile import k_identity, k_proc_fds, k_read_files, k_scratch, k_write_files

pytestmark = pytest.mark.timeout(180)


def test_another_vfs_memory_is_out_of_reach(make_host: MakeHost) -> None:
    with hostile_scene(make_host) as sc:
        host_side = [sc.hp.pid, sc.engine_pid(0), sc.neighbour_pid, os.getpid()]
        # from outside the sandbox VF 0's memfd is plainly there (so the attack is real)
        assert any(
            "gpuvirt-vf0-fb" in os.readlink(f"/proc/{sc.engine_pid(0)}/fd/{fd}")
            for fd in os.listdir(f"/proc/{sc.engine_pid(0)}/fd")
        )
        # the guest side: each guest holds its own VF's memfd, never another's
        assert any("gpuvirt-vf0-fb" in f for f in fb_fds(sc.neighbour_pid))
        assert all("gpuvirt-vf0" not in f for f in fb_fds(os.getpid()))
        got = sc.gpu.launch(k_proc_fds, host_side).result(30)
        leaked = {k: v for k, v in got["seen"].items() if "gpuvirt-vf0" in v}
        assert leaked == {}, leaked
        # the host, VF 0's engine and guest, and this process are not in its pid space
        assert set(got["direct"].values()) == {"ENOENT"}, got["direct"]
        # only the engine itself is visible, and the init of its sandbox (not readable)
        assert set(k.split("/")[0] for k in got["seen"]) <= {"1", "2", "self", "thread-self"}
        assert got["seen"].get("1") == "EACCES"
        assert got["own_read"] == "ok"  # control: its own FB, the same way
        assert sc.neighbour_ok()


def test_tokens_host_environment_and_sockets_are_not_visible(make_host: MakeHost) -> None:
    with hostile_scene(make_host) as sc:
        tokens = sc.token_files()
        assert all(t.read_text() for t in tokens)  # control: there, readable by the host
        paths = [str(t) for t in tokens] + [
            f"/proc/{sc.hp.pid}/environ", f"/proc/{sc.hp.pid}/cmdline",
            str(sc.host_paths()["state"] / "events.jsonl"),
        ]  # fmt: skip
        got = sc.gpu.launch(k_read_files, paths).result(30)
        assert got == {p: "ENOENT" for p in paths}
        me = sc.gpu.launch(k_identity).result(30)
        env = me["env"]
        assert CANARY not in env
        fixed = {**BASE_ENV, **EmuEngine.ENGINE_ENV}  # the backend's own (its copy's tuning)
        assert set(env) <= set(fixed) | {"HOME", "TMPDIR", "PWD", "LC_CTYPE"} | {
            k for k in env if k.startswith(PASSED_ENV_PREFIXES)
        }, env
        assert {k: v for k, v in env.items() if k in fixed} == fixed
        assert sc.neighbour_ok()


def test_nothing_outside_the_scratch_dir_is_writable(make_host: MakeHost) -> None:
    with hostile_scene(make_host) as sc:
        pkg = Path(gpuvirt.__file__).parent
        state = sc.host_paths()["state"]
        name = f"planted-{uuid.uuid4().hex}.py"
        targets = {
            "package": pkg / name,
            "package_init": pkg / "__init__.py",
            "state_dir": state / name,
            "host_tmp_known_dir": Path(sc.hp.workdir) / name,
        }
        got = sc.gpu.launch(k_write_files, [str(p) for p in targets.values()]).result(30)
        # read-only mounts of what the interpreter needs; the rest is not there at all
        assert got[str(targets["package"])] in ("EROFS", "EACCES"), got
        assert got[str(targets["package_init"])] in ("EROFS", "EACCES"), got
        assert got[str(targets["state_dir"])] == "ENOENT", got
        assert got[str(targets["host_tmp_known_dir"])] == "ENOENT", got
        for p in targets.values():
            assert not p.exists() or p.name == "__init__.py"
        assert "planted by a tenant" not in (pkg / "__init__.py").read_text()
        # /tmp inside is the engine's private scratch: writable, and not the host's /tmp
        inside = sc.gpu.launch(k_scratch, name, True).result(30)
        assert inside["exists"]
        assert not (Path("/tmp") / name).exists()
        assert sc.neighbour_ok()


def test_scratch_is_emptied_at_fini_and_flr(make_host: MakeHost) -> None:
    name = f"left-{uuid.uuid4().hex}"
    with hostile_scene(make_host) as sc:
        assert sc.gpu.launch(k_scratch, name, True).result(30)["exists"]
        sc.hp.admin.vf(1, "reset")  # FLR: a fresh engine
        sc.gpu.wait_ready()
        assert sc.gpu.launch(k_scratch, name, False).result(30) == {
            "exists": False, "listing": bound_under_tmp(),
        }  # fmt: skip
        assert sc.gpu.launch(k_scratch, name, True).result(30)["exists"]
    # fini (the tenant detached): the next tenant finds an empty scratch dir
    hp = sc.hp
    with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)) as gpu:
        assert gpu.launch(k_scratch, name, False).result(30) == {
            "exists": False, "listing": bound_under_tmp(),
        }  # fmt: skip
