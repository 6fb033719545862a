"""NVIDIA MPS for `bench isolation`: a control daemon of the bench's own, started and stopped
by it, in a private pipe and log directory.

The pipe directory is how MPS clients find their daemon (CUDA_MPS_PIPE_DIRECTORY);
one of the bench's own means its clients use this daemon and no process outside the
bench is touched by it, nor the bench by any other MPS the machine runs. What is
left of it when the bench ends (the control daemon and the server it spawned, which
inherit the environment) is found by that directory in their environment and killed.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from gpuvirt.bench.gpu_runner import processes_with_env

CONTROL = "nvidia-cuda-mps-control"
QUIT_TIMEOUT_S = 10.0
START_TIMEOUT_S = 10.0
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
# MPS's own per-client cap on device memory ("0=2048M": device 0, 2 GiB), set in the
# environment of a client (or of the daemon, for every client).
LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"


def available() -> str | None:
    """None when this machine can run MPS for the bench, else why not."""
    return None if shutil.which(CONTROL) else f"{CONTROL} is not installed"


def mem_limit(nbytes: int) -> dict[str, str]:
    """The client environment that caps its device memory at nbytes (device 0)."""
    return {LIMIT_ENV: f"0={max(1, nbytes >> 20)}M"}


def daemon_env(base: dict[str, str], pipe: Path, logs: Path) -> dict[str, str]:
    """The environment of the daemon and of every client of it."""
    return {**base, PIPE_ENV: str(pipe), LOG_ENV: str(logs)}


@contextlib.contextmanager
def mps_daemon(base: dict[str, str]) -> Iterator[dict[str, str]]:
    """A private MPS control daemon for the block; yields the client environment.

    Started with `-d` (it forks into the background and returns); stopped with `quit`
    on its control pipe, then whatever still carries its pipe directory is killed.
    """
    with tempfile.TemporaryDirectory(prefix="gpuvirt-mps-") as tmp:
        pipe, logs = Path(tmp) / "pipe", Path(tmp) / "log"
        pipe.mkdir()
        logs.mkdir()
        env = daemon_env(base, pipe, logs)
        subprocess.run([CONTROL, "-d"], env=env, check=True, timeout=START_TIMEOUT_S,
                       stdin=subprocess.DEVNULL, capture_output=True)  # fmt: skip
        try:
            _wait_for_control(pipe)
            yield env
        finally:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run([CONTROL], input="quit\n", text=True, env=env,
                               timeout=QUIT_TIMEOUT_S, capture_output=True)  # fmt: skip
            _reap(str(pipe), QUIT_TIMEOUT_S)


def _wait_for_control(pipe: Path) -> None:
    """The daemon is up once its control socket is in the pipe directory."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (pipe / "control").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{CONTROL} -d made no control socket in {pipe}")
        time.sleep(0.05)  # a file appearing has nothing to wait on but its directory


def holders(pipe: str) -> list[int]:
    """Processes whose environment names this pipe directory (the daemon and its server)."""
    return processes_with_env(PIPE_ENV, pipe)


def _reap(pipe: str, timeout: float) -> None:
    """Until nothing of this daemon is left: it exits on `quit` (waited for on pidfds: it
    daemonized, so it is no child of ours); past the timeout, SIGKILL."""
    deadline = time.monotonic() + timeout
    for pid in holders(pipe):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(fd)
    for pid in holders(pipe):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
