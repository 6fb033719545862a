"""A hostile tenant's kernels, and the neighbour it attacks (tests/test_confinement*.py).

Each kernel tries one escape for real inside its engine and returns what the
kernel answered (an errno name, or "ok" when the call succeeded), so the tests
judge by what the kernel returned. Kernels are tenant code: the guest library
ships this module's functions by value, as it would any tenant's.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

import gpuvirt

SECRET = 0x5A


def attempt(fn: Any, *args: Any) -> str:
    """'ok', or the errno name of the OSError the call raised."""
    try:
        fn(*args)
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e))
    return "ok"


def syscall(nr: int, *args: int) -> str:
    libc = ctypes.CDLL(None, use_errno=True)  # here: kernels travel by value, a CDLL cannot
    ctypes.set_errno(0)
    r = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
    return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")


# x86_64 syscall numbers
SYS = {
    "ptrace": 101, "process_vm_readv": 310, "mount": 165, "keyctl": 250, "bpf": 321,
    "perf_event_open": 298, "kexec_load": 246, "unshare": 272, "setns": 308, "fork": 57,
    "vfork": 58, "clone": 56, "clone3": 435, "sched_setattr": 314,
}  # fmt: skip
SIGCHLD = 17
CLONE_NEWUSER = 0x10000000


def k_identity(xp: Any) -> dict[str, Any]:
    with open("/proc/self/status") as f:
        status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
    return {
        "uid": os.getuid(), "gid": os.getgid(), "euid": os.geteuid(), "groups": os.getgroups(),
        "cap_eff": status["CapEff"].strip(), "cap_bnd": status["CapBnd"].strip(),
        "no_new_privs": status["NoNewPrivs"].strip(), "seccomp": status["Seccomp"].strip(),
        "pid": os.getpid(), "rlimit_core": __import__("resource").getrlimit(4),
        "env": dict(os.environ),
        "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
    }  # fmt: skip


def k_proc_fds(xp: Any, pids: list[int]) -> dict[str, Any]:
    """Every memfd any visible process holds, and what opening the host-side pids gives."""
    seen = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError as e:
            seen[pid] = errno.errorcode[e.errno or 0]
            continue
        for fd in fds:
            try:
                seen[f"{pid}/{fd}"] = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError as e:
                seen[f"{pid}/{fd}"] = errno.errorcode[e.errno or 0]
    direct = {pid: attempt(os.listdir, f"/proc/{pid}/fd") for pid in pids}
    # control: the VF's own FB, opened again through /proc, reads as any file does
    own = [f for f in os.listdir("/proc/self/fd") if "gpuvirt-vf1-fb" in _link(f)]
    own_read = attempt(_read1, f"/proc/self/fd/{own[0]}") if own else "none"
    return {"seen": seen, "direct": direct, "own_read": own_read}


def _read1(path: str) -> None:
    with open(path, "rb") as f:
        f.read(1)


def _link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def k_read_files(xp: Any, paths: list[str]) -> dict[str, str]:
    return {p: attempt(_read1, p) for p in paths}


def k_write_files(xp: Any, paths: list[str]) -> dict[str, str]:
    def write(p: str) -> None:
        with open(p, "w") as f:
            f.write("import os  # planted by a tenant\n")

    return {p: attempt(write, p) for p in paths}


def k_signal(xp: Any, pids: list[int]) -> dict[str, str]:
    out = {str(pid): attempt(os.kill, pid, 15) for pid in pids}
    out["-1"] = attempt(os.kill, -1, 9)  # everything this uid may signal
    return out


def k_connect(xp: Any, unix_paths: list[str], port: int) -> dict[str, str]:
    def unix(p: str) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(p)

    def tcp() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass

    out = {p: attempt(unix, p) for p in unix_paths}
    out["tcp"] = attempt(tcp)
    return out


def k_syscalls(xp: Any) -> dict[str, str]:
    out = {
        "ptrace": syscall(SYS["ptrace"], 16, 1, 0, 0),  # PTRACE_ATTACH to the sandbox's init
        "process_vm_readv": syscall(SYS["process_vm_readv"], 1, 0, 0, 0, 0, 0),
        "mount": syscall(SYS["mount"], 0, 0, 0, 0, 0),
        "keyctl": syscall(SYS["keyctl"], 0, 0, 0, 0, 0),
        "bpf": syscall(SYS["bpf"], 0, 0, 0),
        "perf_event_open": syscall(SYS["perf_event_open"], 0, 0, -1, -1, 0),
        "kexec_load": syscall(SYS["kexec_load"], 0, 0, 0, 0),
        "unshare": syscall(SYS["unshare"], CLONE_NEWUSER),
        "setns": syscall(SYS["setns"], 0, 0),
        "fork": syscall(SYS["fork"]),
        "vfork": syscall(SYS["vfork"]),
        "clone": syscall(SYS["clone"], SIGCHLD, 0, 0, 0, 0),
        "clone3": syscall(SYS["clone3"], 0, 0),
        "os.fork": attempt(os.fork),
        "subprocess": attempt(lambda: __import__("subprocess").run(["/usr/bin/true"])),
        # off the device's CPU it would run beside the next VF while its stop is posted
        "sched_setaffinity": attempt(os.sched_setaffinity, 0, set(range(os.cpu_count() or 1))),
        # back to SCHED_OTHER's wake-up preemption on the device's CPU
        "sched_setscheduler": attempt(os.sched_setscheduler, 0, os.SCHED_OTHER, os.sched_param(0)),
        "sched_setattr": syscall(SYS["sched_setattr"], 0, 0, 0),
    }
    # threads are allowed: numpy and CuPy need them
    done = threading.Event()
    t = threading.Thread(target=done.set)
    t.start()
    t.join()
    out["thread"] = "ok" if done.is_set() else "failed"
    return out


def k_fork_bomb(xp: Any, n: int) -> dict[str, int]:
    """n forks; any child that came to be would exit at once (and be counted)."""
    out: dict[str, int] = {}
    for _ in range(n):
        try:
            pid = os.fork()
        except OSError as e:
            name = errno.errorcode.get(e.errno or 0, "?")
            out[name] = out.get(name, 0) + 1
            continue
        if pid == 0:
            os._exit(0)
        out["forked"] = out.get("forked", 0) + 1
        os.waitpid(pid, 0)
    return out


def k_threads(xp: Any, n: int) -> dict[str, Any]:
    """As many threads as it can, up to n (a process fork bomb's stand-in: the task limit)."""
    release = threading.Event()
    started, error = [], ""
    for _ in range(n):
        t = threading.Thread(target=release.wait, daemon=True)
        try:
            t.start()
        except RuntimeError as e:
            error = str(e)
            break
        started.append(t)
    release.set()
    for t in started:
        t.join()
    return {"started": len(started), "error": error}


def k_allocate(xp: Any, nbytes: int) -> int:
    a = np.ones(nbytes, np.uint8)  # touches every page
    return int(a[:: 1 << 20].sum())


def k_spinner(xp: Any) -> int:
    """Leave a thread behind that spins forever: it must stop and die with the engine."""

    def spin() -> None:
        while True:
            pass

    threading.Thread(target=spin, daemon=True).start()
    return threading.active_count()


def k_scratch(xp: Any, name: str, write: bool) -> dict[str, Any]:
    path = os.path.join(os.environ["TMPDIR"], name)
    if write:
        with open(path, "w") as f:
            f.write("left by the last tenant")
    return {"exists": os.path.exists(path), "listing": sorted(os.listdir(os.environ["TMPDIR"]))}


def k_sum(xp: Any, b: Any) -> int:
    return int(b.sum())


def _spin_for(xp: Any, seconds: float) -> int:
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += 1
    return n


STAMP_NS = 10_000  # stamp_for's grain: far finer than any slice or CPU timeslice


def stamp_for(xp: Any, out: Any, seconds: float) -> int:
    """Compute for `seconds` of wall time, writing CLOCK_MONOTONIC into `out` every
    STAMP_NS while this kernel runs (until it is full): a gap is time it was stopped."""
    end = time.monotonic_ns() + int(seconds * 1e9)
    n, last = 0, 0
    while (now := time.monotonic_ns()) < end:
        if now - last >= STAMP_NS and n < out.size:
            out[n], last, n = now, now, n + 1
    return n


def k_looks_idle(xp: Any, out: Any, seconds: float) -> int:
    """Say this launch completed and nothing runs (its engine's own words, as any kernel
    can write them), then compute on, stamping as it goes."""
    import gc

    from gpuvirt.device.status import StatusArea, Word

    st = next(o for o in gc.get_objects() if isinstance(o, StatusArea))
    st[Word.COMPLETED] += 1
    st[Word.CURRENT_SEQ] = 0
    return stamp_for(xp, out, seconds)


def neighbour(conn: Connection, sock: str, token: str, nbytes: int) -> None:
    """VF 0's tenant: a secret in its FB; answers 'check' (secret intact and a launch
    through), 'busy S' (a kernel that computes for S seconds), 'stamps S' (the same,
    returning stamp_for's stamps) and 'close'."""
    gpu = gpuvirt.attach(vf=0, socket=sock, token=token)
    buf = gpu.alloc(nbytes, np.uint8)
    buf.write(np.full(nbytes, SECRET, np.uint8))
    conn.send(os.getpid())
    while True:
        cmd = conn.recv()
        if cmd == "check":
            data = buf.read()
            total = gpu.launch(k_sum, buf).result(30)
            conn.send(bool((data == SECRET).all()) and total == SECRET * nbytes)
        elif isinstance(cmd, tuple) and cmd[0] == "busy":
            conn.send(gpu.launch(_spin_for, cmd[1]).result(60) > 0)
        elif isinstance(cmd, tuple) and cmd[0] == "stamps":
            out = gpu.alloc(int(cmd[1] * 1e9) // STAMP_NS, np.int64)
            n = gpu.launch(stamp_for, out, cmd[1]).result(60)
            conn.send(out.read()[:n])
            out.free()
        else:
            gpu.close()
            conn.send("closed")
            return


# x86_64: socket, socketpair, io_uring_setup/enter/register
SYS_NET = {"socket": 41, "socketpair": 53, "io_uring_setup": 425, "io_uring_enter": 426,
           "io_uring_register": 427}  # fmt: skip


def _fd_call(nr: int, *args: Any) -> str:
    """'ok' (and the new fd closed) or the errno name: for calls that return a descriptor."""
    libc = ctypes.CDLL(None, use_errno=True)
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    if r < 0:
        return errno.errorcode.get(ctypes.get_errno(), "?")
    os.close(r)
    return "ok"


def k_io_uring(xp: Any) -> dict[str, str]:
    """io_uring_setup with a zeroed io_uring_params (120 bytes), SQPOLL asked or not; and
    enter/register on a descriptor that is no ring (EBADF unless the filter answers first)."""
    params = ctypes.create_string_buffer(120)
    sqpoll = ctypes.create_string_buffer(120)
    sqpoll[8:12] = (2).to_bytes(4, "little")  # flags = IORING_SETUP_SQPOLL
    return {
        "io_uring_setup": _fd_call(SYS_NET["io_uring_setup"], 8, ctypes.addressof(params)),
        "io_uring_setup_sqpoll": _fd_call(SYS_NET["io_uring_setup"], 8, ctypes.addressof(sqpoll)),
        "io_uring_enter": syscall(SYS_NET["io_uring_enter"], 0, 0, 0, 0, 0, 0),
        "io_uring_register": syscall(SYS_NET["io_uring_register"], 0, 0, 0, 0),
    }


def k_socket_families(xp: Any, families: dict[str, int]) -> dict[str, str]:
    """socket() and socketpair() of each family as the raw syscall passes it (64 bits), so a
    family with bits above the low 32 is tried as the kernel (which reads 32) would see it."""
    libc = ctypes.CDLL(None, use_errno=True)
    out = {}
    for name, family in families.items():
        kind = socket.SOCK_RAW if family & 0xFFFFFFFF == socket.AF_NETLINK else socket.SOCK_STREAM
        out[f"socket {name}"] = _fd_call(SYS_NET["socket"], family, kind, 0)
        pair = (ctypes.c_int * 2)()
        ctypes.set_errno(0)
        r = libc.syscall(ctypes.c_long(SYS_NET["socketpair"]), ctypes.c_long(family),
                         ctypes.c_long(socket.SOCK_STREAM), ctypes.c_long(0), pair)  # fmt: skip
        if r < 0:
            out[f"socketpair {name}"] = errno.errorcode.get(ctypes.get_errno(), "?")
        else:
            os.close(pair[0])
            os.close(pair[1])
            out[f"socketpair {name}"] = "ok"
    return out
