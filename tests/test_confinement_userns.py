"""A host that is not root confines its engines too (bwrap's user namespace instead of
setpriv): the core checks run for real as an ordinary user (tests/userns_checks.py).

Set up here, as root, with nothing skipped: the user (created once), an interpreter
it can read (a venv of the system's python of our minor version under /opt, which
sees our packages through a .pth), a cgroup delegated to it the way an
administrator would (v1: the group and its cgroup.procs/tasks chowned; v2: a
group below our own delegated tree, with cgroup.procs, cgroup.subtree_control
and cgroup.threads chowned), and the user's process started inside it.
Whatever cannot be set up fails, saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuvirt.defaults import DEFAULT_ENGINE_TASKS
from gpuvirt.device.sandbox import cgroup

pytestmark = pytest.mark.timeout(180)

USER = "gpuvirt-userns-test"
VENV = Path("/opt/gpuvirt-userns-test/venv")
TESTS = Path(__file__).resolve().parent
UID_BASE = 300_000  # inside the engine's user namespace


def _user() -> pwd.struct_passwd:
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(USER)
    cmd = ["useradd", "--system", "--user-group", "--no-create-home",
           "--shell", "/usr/sbin/nologin", USER]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode:
        pytest.fail(f"cannot create the test user {USER}: {r.stderr.strip()}")
    return pwd.getpwnam(USER)


def _interpreter() -> Path:
    """A python the user can run that imports what ours does: our interpreter may live
    under root's 0700 home, the system's of the same minor version does not."""
    minor = f"python3.{sys.version_info.minor}"
    py = VENV / "bin" / "python"
    if not py.exists():
        base = Path("/usr/bin") / minor
        if not base.exists():
            pytest.fail(f"no {base} to build a venv an ordinary user can read")
        cmd = [str(base), "-m", "venv", "--without-pip", str(VENV)]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode:
            pytest.fail(f"{' '.join(cmd)}: {r.stderr.strip()}")
    site = VENV / "lib" / minor / "site-packages"
    ours = sysconfig.get_paths()["purelib"]  # processed as a site dir: its .pth files too
    (site / "gpuvirt-test.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    return py


@contextlib.contextmanager
def _delegated(pw: pwd.struct_passwd) -> Iterator[list[Path]]:
    """A cgroup of the user's own beneath ours; yields the cgroup.procs files its
    process is put in."""
    found = cgroup.detect()  # as root (v2: delegates our own tree first)
    if found.hier is None:
        pytest.fail(f"no cgroup to delegate to the test user: {found.missing}")
    name = f"userns-test-{os.getpid()}"
    if found.hier.version == 1:
        groups = [base / name for base in dict.fromkeys(found.hier.bases.values())]
        files = ("cgroup.procs", "tasks")
    else:
        groups = [found.hier.bases["memory"] / name]
        files = ("cgroup.procs", "cgroup.subtree_control", "cgroup.threads")
    try:
        for g in groups:
            g.mkdir()
            for p in (g, *(g / f for f in files)):
                os.chown(p, pw.pw_uid, pw.pw_gid)
        yield [g / "cgroup.procs" for g in groups]
    finally:
        for g in groups:  # what the user's host left (its exited leaf, on v2), then g
            for d in sorted(g.rglob("*/"), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                g.rmdir()


def test_an_ordinary_users_host_confines_its_engines_with_a_user_namespace() -> None:
    assert os.geteuid() == 0  # the setup needs root; the checks then run without it
    pw = _user()
    py = _interpreter()
    secret = Path(f"/tmp/gpuvirt-userns-secret-{os.getpid()}")
    secret.write_text("the user's own secret\n")
    os.chown(secret, pw.pw_uid, pw.pw_gid)
    secret.chmod(0o600)
    try:
        with _delegated(pw) as procs:
            # the shell joins the user's cgroups as root, then becomes the user for good
            script = 'for p in "$GV_PROCS"; do echo $$ > "$p" || exit 97; done; exec "$@"'
            cmd = ["sh", "-c", script.replace('"$GV_PROCS"', " ".join(map(str, procs))), "sh",
                   "setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups",
                   "--inh-caps=-all", "--", str(py), str(TESTS / "userns_checks.py"),
                   str(UID_BASE), str(secret)]  # fmt: skip
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONPATH": str(TESTS)}
            r = subprocess.run(
                cmd, capture_output=True, text=True, timeout=150, env=env, cwd="/", check=False
            )
    finally:
        secret.unlink()
    assert r.returncode == 0, (
        f"checks as {USER} failed (exit {r.returncode}; it must be able to read "
        f"{sysconfig.get_paths()['purelib']}, the checkout and {TESTS}): {r.stderr[-3000:]}"
    )
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["host_euid"] == pw.pw_uid != 0
    rep = out["report"]
    assert rep["mode"] == "required" and rep["missing"] == {}, rep
    assert rep["active"]["identity"].startswith("user namespace")
    assert {"bwrap", "seccomp", "cgroup", "landlock"} <= set(rep["active"]), rep
    me = out["identity"]
    assert (me["uid"], me["gid"]) == (UID_BASE + 3,) * 2  # its uid inside the namespace
    assert me["cap_eff"] == "0000000000000000" and me["no_new_privs"] == "1"
    assert me["seccomp"] == "2" and me["pid"] == 2
    assert out["engine_host_uid"] == pw.pw_uid  # outside: the ordinary user, never root
    sc = out["syscalls"]
    for call in ("fork", "vfork", "clone", "os.fork", "ptrace", "mount", "unshare", "bpf"):
        assert sc[call] == "EPERM", (call, sc)
    assert sc["thread"] == "ok"
    assert set(out["read"].values()) == {"ENOENT"}, out["read"]  # own /tmp, own /proc
    assert "ok" not in out["write"].values(), out["write"]
    assert set(out["signal"].values()) == {"ESRCH"}, out["signal"]
    threads = out["threads"]  # the delegated cgroup's task limit holds
    assert threads["started"] < DEFAULT_ENGINE_TASKS and "thread" in threads["error"], threads
