"""Starting an engine inside its sandbox, and the handle the backends drive it by.

The sequence, so that no tenant code ever runs outside the limits: bwrap
starts and blocks (`--block-fd`) inside its new namespaces before it forks the
engine; the host reads the sandbox's pid (`--info-fd`), puts it in the
engine's cgroup and sets its rlimits; then it lets bwrap go on. Everything
the sandbox starts afterwards inherits both.

Under bwrap the engine is the host's great-grandchild (host -> bwrap -> the
sandbox's init -> engine), so waitid cannot confirm its stops. The stop is
read from /proc instead (every thread in state T): the engine cannot create
processes (seccomp), so its threads are all it runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import resource
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Self

from gpuvirt.device.sandbox import bwrap, cgroup, seccomp
from gpuvirt.device.sandbox.policy import Mode, Report, Settings, enforce, nproc, probe
from gpuvirt.errors import DeviceError

# An engine's fixed environment: nothing of the host's. One BLAS thread: an engine
# is one execution context, as a VF is one slice of the device.
BASE_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONNOUSERSITE": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
# The host's tuning of the math libraries (results must not depend on whether an
# engine is confined) and, on cuda, its choice of GPU. Nothing else of its environment.
PASSED_ENV_PREFIXES = ("OPENBLAS_", "NVPL_BLAS_", "CUDA_VISIBLE_DEVICES")
START_TIMEOUT_S = 10.0
# Between reads of a stopping engine's state the waiting (real-time) thread sleeps,
# so the engine gets the CPU it needs to take the signal. Each wake costs a GIL
# hand-over; a stop takes a few tens of µs once the engine has the CPU.
STOP_POLL_S = 20e-6
# A confined engine's stderr is a pipe to the host until its start is done (then the
# engine points it at /dev/null: no tenant code has run by then). The host reads at
# most this much of it, once, when the start failed; the first lines are the reason.
STDERR_KEEP = 4096
STDERR_LINES = 4


class Sandbox:
    """The host's confinement: probed once, then applied to every engine it starts."""

    def __init__(self, settings: Settings, report: Report, hier: cgroup.Hierarchy | None) -> None:
        self.settings = settings
        self.report = report
        self.hier = hier
        self.instance = f"gpuvirt-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._seq = itertools.count()
        self._bwrap = bwrap.tool("bwrap") if report.confined else None
        self._setpriv = bwrap.tool("setpriv")

    @classmethod
    def create(cls, settings: Settings) -> Self:
        report, hier = probe(settings)
        enforce(report)
        return cls(settings, report, hier)

    @classmethod
    def off(cls) -> Self:
        """No confinement: devices driven directly by tests of the device layer."""
        s = Settings(mode=Mode.OFF)
        return cls(s, Report(Mode.OFF), None)

    @property
    def per_vf_identity(self) -> bool:
        return self.report.confined

    def identity(self, vf: int) -> bwrap.Identity:
        uid = self.settings.uid_base + vf
        return bwrap.Identity(uid, uid, setpriv=os.geteuid() == 0)

    def memory_for(self, fb_size: int) -> int:
        s = self.settings
        return s.memory if s.memory is not None else fb_size + s.memory_allowance

    def engine_args(self) -> list[str]:
        """Engine arguments for its sandbox: Landlock applied to itself (where in force),
        and its stderr (the host's pipe) let go once its start is done."""
        if not self.report.confined:
            return []
        landlock = ["--landlock", bwrap.SCRATCH] if "landlock" in self.report.active else []
        return [*landlock, "--start-stderr"]

    def launch(
        self, cmd: list[str], pass_fds: tuple[int, ...], vf: int, fb_size: int,
        backend_env: Mapping[str, str] | None = None,
    ) -> Engined:  # fmt: skip
        """backend_env: what the backend sets in its engines' environment, beside BASE_ENV
        and the host's passed-on tuning (device/emu.py, ENGINE_ENV)."""
        backend_env = backend_env or {}
        if self._bwrap is None:
            return Engined.direct(cmd, pass_fds, backend_env)
        s = self.settings
        info_r, info_w = os.pipe2(os.O_CLOEXEC)
        block_r, block_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        os.set_blocking(err_w, True)  # the engine's end: a full pipe makes it wait, not fail
        sc_fd = seccomp.program_fd() if "seccomp" in self.report.active else None
        env = {k: v for k, v in os.environ.items() if k.startswith(PASSED_ENV_PREFIXES)}
        env.update(BASE_ENV)
        env.update(backend_env)
        args = bwrap.argv(
            self._bwrap, self._setpriv, self.identity(vf),
            info_fd=info_w, block_fd=block_r, seccomp_fd=sc_fd, scratch_size=s.scratch,
            env=env, cuda=s.backend == "cuda",
        )  # fmt: skip
        cg = None
        try:
            if self.hier is not None:
                cg = cgroup.EngineCgroup(self.hier, self.instance, f"vf{vf}-{next(self._seq)}")
                cg.limit(self.memory_for(fb_size), s.tasks)
            extra = (info_w, block_r) + ((sc_fd,) if sc_fd is not None else ())
            # No descriptor of the host's: not even its stderr (a log file the tenant
            # could write to). Its stderr is a pipe only the host reads (Engined.output).
            popen = subprocess.Popen(
                args + cmd, pass_fds=pass_fds + extra, close_fds=True,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err_w,
                start_new_session=True, env={},
            )  # fmt: skip
        except BaseException:
            os.close(err_r)
            if cg is not None:
                cg.remove()
            raise
        finally:
            for fd in (info_w, block_r, sc_fd, err_w):
                if fd is not None:
                    os.close(fd)
        try:
            init = _read_info(info_r, popen)
            if cg is not None:
                cg.add(init)
            limits = [(resource.RLIMIT_NOFILE, s.nofile), (resource.RLIMIT_CORE, 0)]
            if "tasks" in self.report.active:  # no pids controller: the uid's task count
                limits.append((resource.RLIMIT_NPROC, nproc(s.tasks)))
            for res, n in limits:
                resource.prlimit(init, res, (n, n))
            os.write(block_w, b"1")
            pid = _first_child(init, popen)
        except BaseException:
            Engined(popen, popen.pid, cg, err_r).kill()
            raise
        finally:
            os.close(info_r)
            os.close(block_w)
        return Engined(popen, pid, cg, err_r)

    def close(self) -> None:
        if self.hier is not None:
            cgroup.remove_instance(self.hier, self.instance)


def _read_info(fd: int, popen: subprocess.Popen[bytes]) -> int:
    """The sandbox's init pid, from bwrap's --info-fd (closed by bwrap once written)."""
    data = b""
    while True:
        chunk = os.read(fd, 4096)  # bwrap writes it whole, then closes the fd
        if not chunk:
            break
        data += chunk
    try:
        return int(json.loads(data)["child-pid"])
    except (ValueError, KeyError) as e:
        code = popen.wait()
        raise DeviceError(f"bwrap did not start the sandbox (exit {code}): {e}") from None


def _first_child(init: int, popen: subprocess.Popen[bytes]) -> int:
    """The engine: the sandbox init's child, forked right after the block fd is written.
    A fork of microseconds, so a short poll; bwrap exiting instead ends it."""
    path = f"/proc/{init}/task/{init}/children"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            with open(path) as f:
                kids = f.read().split()
            if kids:
                return int(kids[0])
        if popen.poll() is not None:
            raise DeviceError(f"bwrap exited with {popen.returncode} before the engine started")
        time.sleep(100e-6)
    raise DeviceError(f"the sandbox (pid {init}) did not start the engine in {START_TIMEOUT_S} s")


@dataclass
class Engined:
    """An engine process: its pid (in the host's pid namespace), the host's own child
    (the engine itself, or bwrap), and its cgroup when confined."""

    popen: subprocess.Popen[bytes]
    pid: int
    cgroup: cgroup.EngineCgroup | None
    stderr: int | None = None  # confined: the read end of the engine's stderr pipe
    _stat_fd: int | None = None

    @classmethod
    def direct(
        cls, cmd: list[str], pass_fds: tuple[int, ...], backend_env: Mapping[str, str]
    ) -> Engined:
        threads = {k: BASE_ENV[k] for k in BASE_ENV if k.endswith("THREADS")}
        env = {**os.environ, **threads, **backend_env}
        popen = subprocess.Popen(
            cmd, pass_fds=pass_fds, close_fds=True, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env,
        )  # fmt: skip
        return cls(popen, popen.pid, None)

    def output(self) -> str:
        """The first lines the engine wrote to stderr, as one line ("" if none): read once
        (a failed start), at most STDERR_KEEP bytes, never waiting. A Python
        traceback's frames are left out: its last line says what went wrong."""
        if self.stderr is None:
            return ""
        try:
            data = os.read(self.stderr, STDERR_KEEP)
        except (BlockingIOError, OSError):
            return ""
        lines = []
        for line in data.decode(errors="replace").splitlines():
            if line.startswith(("Traceback (most recent call last)", " ")) or not line.strip():
                continue
            lines.append("".join(ch if ch.isprintable() else "?" for ch in line))
            if len(lines) == STDERR_LINES:
                break
        return " | ".join(lines)

    @property
    def is_child(self) -> bool:
        return self.popen.pid == self.pid

    def wait_stopped(self) -> bool:
        """Block until the engine is stopped (True) or gone (False)."""
        if self.is_child:
            return bool(self._waitid_stopped())
        if not self._open_stat():
            return False
        _precise_sleeps()
        polls = 0
        while True:
            # It has not stopped before it got the CPU back: sleep first. The first
            # polls keep the GIL (sleep and read through ctypes.PyDLL): every release
            # would be a GIL hand-over to wait for, up to the switch interval each. Past
            # them (a slow stop, a hang the watchdog must see) the GIL is let go.
            if polls < HELD_POLLS:
                _held.nanosleep(ctypes.byref(_POLL_TS), None)
                buf = _thread.buf
                n = _held.pread(self._stat_fd, buf, len(buf), 0)
                stat = buf.raw[:n] if n > 0 else b""
            else:
                time.sleep(STOP_POLL_S)
                stat = _read(self._stat_fd)
            polls += 1
            state = _stopped(self.pid, stat)
            if state is not None:
                return state

    def poll_stopped(self) -> bool | None:
        """Whether the engine is stopped (True), gone (False) or neither yet (None)."""
        if self.is_child:
            return self._waitid_stopped(os.WNOHANG)
        if not self._open_stat():
            return False
        return _stopped(self.pid, _read(self._stat_fd))

    def threads(self) -> int:
        """How many threads the engine has now (0 once it is gone)."""
        if not self._open_stat():
            return 0
        stat = _read(self._stat_fd)
        return _state(stat)[1] if stat else 0

    def _open_stat(self) -> bool:
        if self._stat_fd is None:
            try:
                self._stat_fd = os.open(f"/proc/{self.pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return False
        return True

    def _waitid_stopped(self, flags: int = 0) -> bool | None:
        """As poll_stopped, blocking until stopped or gone unless `flags` has WNOHANG."""
        while True:
            try:
                info = os.waitid(os.P_PID, self.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT | flags)
            except ChildProcessError:
                return False
            if info is None and flags & os.WNOHANG:
                return None
            if info is not None and info.si_code == os.CLD_STOPPED:
                os.waitid(os.P_PID, self.pid, os.WSTOPPED | os.WNOHANG)  # consume it
                return True
            if info is None or info.si_code in (os.CLD_EXITED, os.CLD_KILLED, os.CLD_DUMPED):
                return False
            # CLD_CONTINUED and the like: not what we wait for

    def kill(self) -> int:
        """SIGKILL the engine and everything in its cgroup; reap; the exit code."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        if self.cgroup is not None:
            # No descriptor to be had (EMFILE) for the group's files: the SIGKILL above
            # ends the sandbox and its pid namespace, and with it everything in the group
            # (the engine can start no process). A kill must not fail, or the VF it
            # belongs to would stay RESETTING.
            with contextlib.suppress(OSError):
                self.cgroup.kill()
        code = self.popen.wait()
        if self.cgroup is not None:
            self.cgroup.remove()
        if self._stat_fd is not None:
            os.close(self._stat_fd)
            self._stat_fd = None
        self.close_stderr()
        return code

    def close_stderr(self) -> None:
        """No more reading of the engine's stderr: its start is done, or it is gone."""
        if self.stderr is not None:
            os.close(self.stderr)
            self.stderr = None


_thread = threading.local()
PR_SET_TIMERSLACK = 29
HELD_POLLS = 50  # ~1 ms of polls with the GIL held, then polls that release it


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_POLL_TS = _Timespec(0, int(STOP_POLL_S * 1e9))
_held = ctypes.PyDLL(None, use_errno=True)  # PyDLL: calls that keep the GIL
_held.pread.restype = ctypes.c_ssize_t
_held.pread.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_long]


def _precise_sleeps() -> None:
    """The calling thread's sleeps end on time: the default 50 µs timer slack would
    add 50 µs to every stop the scheduler thread waits for. Once per thread, with
    the thread's own read buffer."""
    if hasattr(_thread, "buf"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    _thread.buf = ctypes.create_string_buffer(1024)  # engines start (and wait) in parallel


def _state(stat: bytes) -> tuple[bytes, int]:
    """(state letter, number of threads) from a /proc/<pid>/stat line."""
    rest = stat[stat.rindex(b")") + 2 :].split()
    return rest[0], int(rest[17])


def _read(fd: int) -> bytes:
    try:
        return os.pread(fd, 1024, 0)
    except OSError:
        return b""  # the process is gone


def _stopped(pid: int, stat: bytes) -> bool | None:
    """True: every thread of pid is stopped; False: it is gone; None: still running.

    `stat` is the leader's, read through a descriptor kept open (no path walk per
    read); the other threads' are read only when there are others and the leader
    has stopped."""
    if not stat:
        return False
    state, threads = _state(stat)
    if state in (b"Z", b"X"):
        return False
    if state not in (b"T", b"t"):
        return None
    if threads == 1:
        return True
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                state, _ = _state(f.read())
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that exited meanwhile
        if state not in (b"T", b"t", b"Z", b"X"):
            return None
    return True
