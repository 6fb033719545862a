"""An engine that is an OS process: how both backends spawn, watch and reap one.

The host spawns `python -m gpuvirt.device.engine` with its descriptors (the FB
or aperture, the status area, a control socket, the idle eventfd) and reaps it
itself with waitid/waitpid; Popen is only the spawner. Backends add how a
world-switch command reaches the process (emu: signals; cuda: acknowledged
commands).
"""

from __future__ import annotations

import array
import contextlib
import os
import signal
import socket
import subprocess
import sys

from gpuvirt.device.base import Engine, EngineSpec
from gpuvirt.device.ctl import ADOPT, CTL_ADOPT, CTL_EXIT, CTL_GUEST
from gpuvirt.device.status import StatusArea

# An engine is one execution context, as a VF is one slice of the device. It also
# stops faster: SIGSTOP is confirmed only once every thread of the process has
# stopped, and an idle BLAS worker thread has to be woken to do so.
ENGINE_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def send_fd(sock: socket.socket, msg: bytes, fd: int) -> None:
    sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


class ProcessEngine(Engine):
    def __init__(
        self, spec: EngineSpec, fb_fd: int | None, backend: str, extra: list[str], fault: bool
    ) -> None:
        """fb_fd None: a spare, which gets its FB later (adopt)."""
        status_fd = StatusArea.create(f"gpuvirt-vf{spec.vf}-status")
        super().__init__(spec, StatusArea(status_fd))
        self._prepare()
        self._ctl, engine_ctl = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._ctl.setblocking(False)
        self._idle = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        cmd = [
            sys.executable, "-m", "gpuvirt.device.engine", "--backend", backend, *extra,
            "--vf", str(spec.vf), "--fb-size", str(spec.fb_size),
            "--fb-fd", str(-1 if fb_fd is None else fb_fd), "--status-fd", str(status_fd),
            "--ctl-fd", str(engine_ctl.fileno()), "--idle-fd", str(self._idle),
            "--host-pid", str(os.getpid()),
        ]  # fmt: skip
        if fault:
            cmd.append("--fault-exit")
        self._popen = subprocess.Popen(
            cmd,
            pass_fds=tuple(
                fd for fd in (fb_fd, status_fd, engine_ctl.fileno(), self._idle) if fd is not None
            ),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **ENGINE_ENV},
        )
        engine_ctl.close()
        os.close(status_fd)
        self._pidfd = os.pidfd_open(self._popen.pid)
        self._reaped = False

    def _prepare(self) -> None:
        """Set status words the engine must find when it starts (before the spawn)."""

    def _reaped_cleanup(self) -> None:
        """Release what the backend holds for this engine (after it is reaped)."""

    @property
    def pid(self) -> int:
        return self._popen.pid

    def exit_fd(self) -> int:
        return self._pidfd

    def idle_fd(self) -> int:
        return self._idle

    def alive(self) -> bool:
        if self._reaped:
            return False
        return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None

    def adopt(self, spec: EngineSpec, fb_fd: int) -> None:
        """Give a spare (started with fb_fd None) its VF; INIT_GPU then completes as for
        any fresh engine (device/spare.py)."""
        self.spec = spec
        with contextlib.suppress(OSError):  # its start was background work; this is not
            os.setpriority(os.PRIO_PROCESS, self.pid, 0)
        send_fd(self._ctl, CTL_ADOPT + ADOPT.pack(spec.vf, spec.fb_size), fb_fd)

    def attach_guest(self, channel_fd: int) -> None:
        send_fd(self._ctl, CTL_GUEST, channel_fd)

    def kill(self) -> None:
        if self._reaped:
            return
        with contextlib.suppress(OSError):
            self._ctl.send(CTL_EXIT)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        # Returns once the process is gone (on cuda: once the driver tore its context
        # down, a kernel still running on the device with it).
        _pid, status = os.waitpid(self.pid, 0)
        self._popen.returncode = os.waitstatus_to_exitcode(status)
        self._reaped = True
        self._reaped_cleanup()
        for fd in (self._pidfd, self._idle):
            os.close(fd)
        self._ctl.close()
        self.status.close()
