"""An engine that is an OS process: how both backends spawn, watch and reap one.

The host spawns `python -m gpuvirt.device.engine` with its descriptors (the FB
or aperture, the status area, a control socket, the idle eventfd) and nothing
else, inside the host's sandbox (device/sandbox/), which confines it to its VF.
Backends add how a world-switch command reaches the process (emu: signals;
cuda: acknowledged commands).
"""

from __future__ import annotations

import array
import contextlib
import os
import select
import socket
import sys
from typing import ClassVar

from gpuvirt.device.base import Engine, EngineSpec, WSCommand
from gpuvirt.device.ctl import ADOPT, CTL_ADOPT, CTL_EXIT, CTL_GUEST
from gpuvirt.device.sandbox import Sandbox
from gpuvirt.device.status import StatusArea, Word
from gpuvirt.errors import DeviceError


def send_fd(sock: socket.socket, msg: bytes, fd: int) -> None:
    sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


class ProcessEngine(Engine):
    # What this backend sets in its engines' environment (device/emu.py's, say).
    ENGINE_ENV: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        spec: EngineSpec,
        fb_fd: int | None,
        backend: str,
        extra: list[str],
        fault: bool,
        sandbox: Sandbox,
        identity: EngineSpec | None = None,
    ) -> None:
        """fb_fd None: a spare, which gets its FB later (adopt).

        identity: the VF (and FB size) whose uid and limits the engine gets, where
        that is not spec's: a spare started for the VF it will serve."""
        who = identity or spec
        self.identity = who.vf
        # A spare's is named for the VF it was started for: the one it serves, confined.
        status_fd = StatusArea.create(f"gpuvirt-vf{who.vf}-status")
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
            # Confined, the sandbox kills the engine with the host (bwrap --die-with-parent).
            "--host-pid", str(0 if sandbox.report.confined else os.getpid()),
            *sandbox.engine_args(),
        ]  # fmt: skip
        if fault:
            cmd.append("--fault-exit")
        fds = tuple(
            fd for fd in (fb_fd, status_fd, engine_ctl.fileno(), self._idle) if fd is not None
        )
        try:
            self._proc = sandbox.launch(cmd, fds, who.vf, who.fb_size, self.ENGINE_ENV)
        finally:
            engine_ctl.close()
            os.close(status_fd)
        self._pidfd = os.pidfd_open(self._proc.pid)
        self._reaped = False

    def command(self, cmd: WSCommand, timeout: float) -> float:
        if cmd is not WSCommand.INIT_GPU:
            return super().command(cmd, timeout)
        try:
            took = super().command(cmd, timeout)
        except DeviceError as e:
            # A confined engine's own words on why its start failed (its stderr, through
            # a pipe only the host reads): the VF's FAILED reason and the event say them.
            said = self._proc.output()
            if not said:
                raise
            raise type(e)(f"{e}; engine stderr: {said}") from e
        self._proc.close_stderr()  # started: the engine has let go of the pipe too
        return took

    def _prepare(self) -> None:
        """Set status words the engine must find when it starts (before the spawn)."""

    def _reaped_cleanup(self) -> None:
        """Release what the backend holds for this engine (after it is reaped)."""

    @property
    def pid(self) -> int:
        return self._proc.pid

    def exit_fd(self) -> int:
        return self._pidfd

    def idle_fd(self) -> int:
        return self._idle

    def alive(self) -> bool:
        if self._reaped:
            return False
        # the pidfd turns readable when the engine exits, child of ours or not
        return not select.select([self._pidfd], [], [], 0)[0]

    def spare_ready(self) -> bool:
        """A spare (started with fb_fd None) done starting, waiting to adopt a VF."""
        return self.status[Word.SPARE_READY] == 1

    def adopt(self, spec: EngineSpec, fb_fd: int) -> None:
        """Give a spare (started with fb_fd None) its VF; INIT_GPU then completes as for
        any fresh engine (device/spare.py)."""
        # It stays at its start's low priority until INIT_GPU is done (the host restores it
        # then): what is left of its start must not take the CPU from the neighbours' guests.
        self.spec = spec
        send_fd(self._ctl, CTL_ADOPT + ADOPT.pack(spec.vf, spec.fb_size), fb_fd)

    def attach_guest(self, channel_fd: int) -> None:
        send_fd(self._ctl, CTL_GUEST, channel_fd)

    def kill(self) -> None:
        if self._reaped:
            return
        with contextlib.suppress(OSError):
            self._ctl.send(CTL_EXIT)
        # Returns once the process (and all it started) is gone (on cuda: once the
        # driver tore its context down, a kernel still running on the device with it).
        self._proc.kill()
        self._reaped = True
        self._reaped_cleanup()
        for fd in (self._pidfd, self._idle):
            os.close(fd)
        self._ctl.close()
        self.status.close()
