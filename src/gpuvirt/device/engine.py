"""The engine process: executes one VF's kernels on its FB.

Started by the device backend as `python -m gpuvirt.device.engine`, with its
descriptors inherited. Two ways to world-switch, chosen by `--switch`:

- `stop` (emu): the engine maps the FB, marks itself ready in the status area
  and stops itself (SIGSTOP): that stop is how the host sees INIT_GPU
  complete. From then on the host runs and idles it with SIGCONT/SIGSTOP; the
  engine never knows whether it is scheduled, it just gets CPU or it does not.
- `coop` (cuda, where a process cannot be stopped mid-kernel): the host
  writes CMD_CODE and CMD_SERIAL in the status area and wakes the engine on
  the control socket (CTL_WAKE); between kernels the engine follows the
  command (IDLE: drain the device, stop taking guest work; RUN: take it
  again), stores ACK_SERIAL and answers CTL_ACK on the control socket. A
  fresh engine finds INIT_GPU with serial 1 already there and acknowledges it
  once its executor is up (on cuda: context, FB allocated and zeroed). An
  engine stuck in a kernel cannot acknowledge: the host's wait times out, and
  that is the hang.

This module starts the process (its sandbox's last steps, the executor, a
spare's adoption); the loop that serves the guest is device/engine_loop.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import traceback

from gpuvirt.device.ctl import ADOPT, CTL_ADOPT, CTL_FAIL, recv_fd
from gpuvirt.device.engine_loop import ContextLost, CoopEngineLoop, EngineLoop, Executor
from gpuvirt.device.status import MAGIC, StatusArea, Word

PR_SET_PDEATHSIG = 1
STARTUP_NICE = 10


def _die_with_host(host_pid: int) -> None:
    """An engine never outlives its host, even while stopped: the kernel SIGKILLs it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != host_pid:  # the host died before the line above
        os._exit(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="gpuvirt-engine")
    p.add_argument("--backend", choices=["emu", "cuda"], required=True)
    p.add_argument(
        "--switch", choices=["stop", "coop"], default=None,
        help="world switch: stop = SIGSTOP/SIGCONT (emu default), coop = acknowledged "
        "commands at kernel boundaries (cuda default)",
    )  # fmt: skip
    p.add_argument("--vf", type=int, required=True)
    p.add_argument("--fb-size", type=int, required=True)
    p.add_argument("--fb-fd", type=int, required=True, help="emu: the FB; cuda: the aperture")
    p.add_argument("--status-fd", type=int, required=True)
    p.add_argument("--ctl-fd", type=int, required=True)
    p.add_argument("--idle-fd", type=int, required=True)
    p.add_argument("--fault-exit", action="store_true", help="test fault: die during start")
    p.add_argument(
        "--scratch", type=int, default=0,
        help="cuda: the cap on kernel temporaries (CuPy's pool), outside the FB",
    )  # fmt: skip
    p.add_argument("--host-pid", type=int, required=True, help="0: the sandbox kills us with it")
    p.add_argument("--landlock", metavar="DIR", help="apply Landlock: write only beneath DIR")
    p.add_argument(
        "--start-stderr", action="store_true",
        help="stderr is the host's pipe for start failures: /dev/null once the start is done",
    )  # fmt: skip
    a = p.parse_args(argv)
    if a.host_pid:
        _die_with_host(a.host_pid)
    if a.landlock:  # before any tenant code, and before the executor's threads start
        from gpuvirt.device.sandbox.landlock import restrict_self

        restrict_self([a.landlock], cuda=a.backend == "cuda")
    # Starting an interpreter and importing numpy is background work: at a low priority
    # it does not take the CPU from the VFs running meanwhile (an FLR's neighbours). The
    # host restores normal priority once INIT_GPU is done.
    os.nice(STARTUP_NICE)
    # The host's terminal signals are the host's business; it tells us when to exit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if a.fault_exit:
        print("gpuvirt engine: test fault (--fault-exit): exiting during start", file=sys.stderr)
        sys.exit(3)
    switch = a.switch or ("stop" if a.backend == "emu" else "coop")
    if switch == "coop":
        _main_coop(a)
        return
    status = StatusArea(a.status_fd)
    ctl = socket.socket(fileno=a.ctl_fd)
    executor = _executor(ctl, a, status)
    if executor is None:
        return
    status[Word.PID] = os.getpid()
    status[Word.MAGIC] = MAGIC
    status[Word.READY] = 1
    _started(a)
    loop = EngineLoop(executor, status, ctl, a.idle_fd)
    os.kill(os.getpid(), signal.SIGSTOP)  # INIT_GPU done: the host sees this stop
    loop.serve()


def _started(a: argparse.Namespace) -> None:
    """The start is done, before any tenant code: stderr leaves the host's pipe, so
    nothing a kernel writes there fills it (the host reads it only on a failed start)."""
    if a.start_stderr:
        sys.stderr.flush()
        null = os.open("/dev/null", os.O_WRONLY | os.O_CLOEXEC)
        os.dup2(null, 2)
        os.close(null)


def _adopt(ctl: socket.socket, a: argparse.Namespace, status: StatusArea) -> bool:
    """A spare engine: started and imported ahead of need, it says so in its status
    words and waits here until the host hands it a VF's FB. False when the host lets it
    go instead."""
    status[Word.SPARE_READY] = 1
    msg, fd = recv_fd(ctl)
    if not msg.startswith(CTL_ADOPT) or fd is None:
        return False
    a.vf, a.fb_size = ADOPT.unpack(msg[len(CTL_ADOPT) :])
    a.fb_fd = fd
    return True


def _executor(ctl: socket.socket, a: argparse.Namespace, status: StatusArea) -> Executor | None:
    """The backend's executor on the VF's FB; a spare first waits to adopt one (None:
    the host let it go). On cuda the context and its warm-up come before the wait, so
    that a spare has done them ahead of need."""
    if a.backend == "emu":
        from gpuvirt.device.emu_executor import EmuExecutor

        if a.fb_fd < 0 and not _adopt(ctl, a, status):
            return None
        return EmuExecutor(a.fb_fd, a.fb_size)
    from gpuvirt.device.cuda_executor import CudaContext, CudaExecutor

    context = CudaContext.open()
    if a.fb_fd < 0 and not _adopt(ctl, a, status):
        return None
    return CudaExecutor(context, a.fb_fd, a.fb_size, a.vf, a.scratch)


def _main_coop(a: argparse.Namespace) -> None:
    status = StatusArea(a.status_fd)
    ctl = socket.socket(fileno=a.ctl_fd)
    status[Word.PID] = os.getpid()
    status[Word.MAGIC] = MAGIC
    try:
        executor = _executor(ctl, a, status)
    except Exception as e:
        # Say why on the control socket: the host turns it into the engine-start error
        # an operator reads, instead of a bare "engine exited".
        why = f"{type(e).__name__}: {e}".encode(errors="replace")[:4000]
        with contextlib.suppress(OSError):
            ctl.send(CTL_FAIL + why)
        traceback.print_exc()
        sys.exit(4)
    if executor is None:
        return
    status[Word.READY] = 1
    _started(a)
    loop = CoopEngineLoop(executor, status, ctl, a.idle_fd)
    loop.follow()  # acknowledges the INIT_GPU the host left in the status area
    try:
        loop.serve()
    except ContextLost as e:
        # The faulting launch has had its answer; the host reads this when it reaps us.
        with contextlib.suppress(OSError):
            ctl.send(CTL_FAIL + str(e).encode(errors="replace")[:4000])
        sys.exit(5)


if __name__ == "__main__":
    main()
