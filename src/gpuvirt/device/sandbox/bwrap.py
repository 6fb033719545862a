"""The bubblewrap command line that wraps one engine.

What the engine sees: the system's /usr (and its /bin, /lib symlinks), the
interpreter and its packages read-only at the paths they have on the host, a
fresh /proc of its own pid namespace, a minimal /dev, and a private tmpfs at
SCRATCH (its HOME and TMPDIR, gone with the process, so emptied at every fini
and FLR). Nothing else: no state_dir, no token, no host socket, no host /tmp.

Two ways to a distinct identity (DESIGN.md, "Tenant confinement"):
- host is root: bwrap without a user namespace (a root-only map would make the
  uid drop fail), then `setpriv` drops to the VF's uid and gid, clears groups,
  capabilities and the bounding set and sets no_new_privs before exec. bwrap
  keeps only the three capabilities setpriv needs for that.
- host is not root: `--unshare-user --uid/--gid`, with further user namespaces
  disabled; the kernel gives the sandbox no capabilities outside it.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

SCRATCH = "/tmp"
SETPRIV_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")
# What an interpreter needs of /etc: the dynamic loader's cache (ctypes, CuPy).
ETC_FILES = ("/etc/ld.so.cache",)
NVIDIA_DEVICES = "/dev/nvidia*"


@dataclass(frozen=True)
class Identity:
    uid: int
    gid: int
    # True: the host is root and setpriv drops to uid/gid; False: a user namespace.
    setpriv: bool


# A directory the operator names, searched before the system's: a bubblewrap carried to a
# machine that lacks it (scripts/gpu-check sets it to .gpu-deps/bin). The host's
# environment is the operator's; PATH itself is not searched, being easier to get wrong.
TOOL_PATH_ENV = "GPUVIRT_TOOL_PATH"


def tool(name: str) -> str | None:
    extra = os.environ.get(TOOL_PATH_ENV)
    path = "/usr/bin:/bin:/usr/sbin:/sbin"
    found = shutil.which(name, path=f"{extra}:{path}" if extra else path)
    return os.path.realpath(found) if found else None


def interpreter_paths() -> list[str]:
    """Directories the engine's interpreter reads: prefixes, the real executable's
    home and every sys.path entry (the editable checkout among them), without the
    ones inside another."""
    candidates = [
        sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
        os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))),
        *(p for p in sys.path if p),
    ]  # fmt: skip
    real = sorted({os.path.realpath(p) for p in candidates if os.path.isdir(p)})
    # /usr is bound whole anyway
    real = [p for p in real if p != "/usr" and not p.startswith("/usr/")]
    out: list[str] = []
    for p in real:
        if not any(p == q or p.startswith(q + "/") for q in out):
            out.append(p)
    # sys.prefix itself may be a symlinked path (a venv under a link): bind as named too
    for p in (sys.prefix, os.path.dirname(sys.executable)):
        if os.path.realpath(p) != p and os.path.isdir(p) and p not in out:
            out.append(p)
    return out


def _parents(paths: list[str]) -> list[str]:
    """Every directory above the bound paths, outermost first. bwrap would create
    them with mode 0700 when it runs as root; the engine's uid must cross them."""
    seen: dict[str, None] = {}
    for p in paths:
        parts = Path(p).parts[1:-1]
        for i in range(1, len(parts) + 1):
            seen["/" + "/".join(parts[:i])] = None
    return sorted(seen, key=lambda d: (d.count("/"), d))


def argv(
    bwrap: str,
    setpriv: str | None,
    who: Identity,
    *,
    info_fd: int,
    block_fd: int,
    seccomp_fd: int | None,
    scratch_size: int,
    env: dict[str, str],
    cuda: bool,
) -> list[str]:
    ro = interpreter_paths()
    a = [
        bwrap, "--die-with-parent", "--new-session", "--clearenv",
        "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
        "--unshare-cgroup-try", "--hostname", "gpuvirt-engine",
        "--info-fd", str(info_fd), "--block-fd", str(block_fd),
        "--cap-drop", "ALL",
    ]  # fmt: skip
    if who.setpriv:
        for cap in SETPRIV_CAPS:
            a += ["--cap-add", cap]
    else:
        a += ["--unshare-user", "--disable-userns", "--uid", str(who.uid), "--gid", str(who.gid)]
    if seccomp_fd is not None:
        a += ["--seccomp", str(seccomp_fd)]
    a += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            a += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            a += ["--ro-bind", top, top]
    for f in ETC_FILES:
        if os.path.exists(f):
            a += ["--ro-bind", f, f]
    # The scratch first: a checkout or venv under /tmp (CI's clone, say) is bound on top
    # of it below, where a tmpfs mounted later would hide the interpreter.
    a += ["--perms", "01777", "--size", str(scratch_size), "--tmpfs", SCRATCH]
    for d in _parents(ro):
        if not d.startswith("/usr"):
            a += ["--perms", "0755", "--dir", d]
    for p in ro:
        a += ["--ro-bind", p, p]
    a += ["--proc", "/proc", "--dev", "/dev"]
    if cuda:
        for dev in sorted(glob.glob(NVIDIA_DEVICES)):
            a += ["--dev-bind", dev, dev]
        a += ["--ro-bind", "/sys", "/sys"]  # the driver reads the device's topology
    for k, v in {**env, "HOME": SCRATCH, "TMPDIR": SCRATCH}.items():
        a += ["--setenv", k, v]
    a += ["--chdir", SCRATCH, "--"]
    if who.setpriv:
        assert setpriv is not None
        a += [
            setpriv, f"--reuid={who.uid}", f"--regid={who.gid}", "--clear-groups",
            "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all", "--",
        ]  # fmt: skip
    return a
