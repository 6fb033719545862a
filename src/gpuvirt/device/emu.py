"""The emulated GPU: FBs are memfds, engines are OS processes.

World switch is real preemption: IDLE_GPU stops the engine process with
SIGSTOP and confirms the stop (waitid, or /proc when sandboxed: see
device/sandbox/launch.py), RUN_GPU continues it, so
a kernel is paused mid-instruction. Scrubbing punches a hole over the whole
memfd: every page reads as zero afterwards, for every mapping, and the memory
goes back to the host without being touched page by page.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from typing import ClassVar

from gpuvirt.device.base import (
    CommandTimeout,
    Device,
    Engine,
    EngineDied,
    EngineSpec,
    Watchdog,
)
from gpuvirt.device.faults import FAULT_ENV, StartFaults
from gpuvirt.device.memfd import punch_hole, sealed_memfd
from gpuvirt.device.process import ProcessEngine
from gpuvirt.device.sandbox import Sandbox
from gpuvirt.device.spare import ANY, SPARE, Spares
from gpuvirt.errors import DeviceError
from gpuvirt.protocol.info import FEATURE_FB_MAPPED, FEATURE_NETGPU


class EmuEngine(ProcessEngine):
    # Engines run only on the device's one CPU and cannot move (seccomp): a stop
    # posted to one lands before the next engine's first instruction (host/sched/switch.py).
    can_post = True
    # COPY_IN/COPY_OUT stand in for a copy engine's DMA (emu_executor.py): it writes
    # device memory without passing through the CPU's caches. glibc's memcpy does so
    # (non-temporal stores) only above a threshold it derives from the L3 size, 114 MiB
    # on a VM reporting 300 MiB of L3, so a 1 MiB staging copy allocated every line it
    # wrote: 140-150 µs per MiB there, 87-94 with this threshold (docs/netgpu.md, "Where
    # the time goes"). Only copies this large stream past the cache; other CPUs ignore it.
    ENGINE_ENV: ClassVar[dict[str, str]] = {
        "GLIBC_TUNABLES": "glibc.cpu.x86_non_temporal_threshold=0x40000"
    }

    def __init__(
        self,
        spec: EngineSpec,
        fb_fd: int | None,
        fault: bool,
        watchdog: Watchdog,
        cpus: tuple[set[int], set[int]],
        sandbox: Sandbox,
        identity: EngineSpec | None = None,
    ) -> None:
        """cpus: the device's, where it runs, and the host's others, where it starts
        and exits."""
        super().__init__(spec, fb_fd, "emu", [], fault, sandbox, identity)
        self._watchdog = watchdog
        self._cpus, self._others = cpus
        self.after_init: Callable[[], None] | None = None
        self._boosted = False  # raised to take a stop (_post_idle) and not yet lowered
        watchdog.add(self)
        # Starting (an interpreter, numpy) happens off the device's CPU where there is
        # another: there it would delay the stop of whichever VF is running.
        self._off_device()

    def _off_device(self) -> None:
        if self._others:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(self.pid, self._others)

    def kill(self) -> None:
        # A process's exit (tearing down its address space, uncharging its cgroup's
        # pages) runs on the CPU it last ran on: milliseconds that, on the device's
        # CPU, an FLR would take from the neighbours running meanwhile.
        if not self._reaped:
            self._off_device()
        super().kill()

    def _reaped_cleanup(self) -> None:
        self._watchdog.discard(self)

    def _wait_stopped(self, block: bool = True) -> bool:
        """Whether the stop the last SIGSTOP asked for (or a fresh engine's own) has
        landed; with `block`, wait until it has.

        The deadline is the watchdog's business (device/base.py): it kills an engine
        that overruns, and the exit ends this wait.
        """
        stopped = self._proc.wait_stopped() if block else self._proc.poll_stopped()
        if stopped is None:
            return False
        if stopped:
            return True
        if self.timed_out:
            raise CommandTimeout(
                f"VF{self.spec.vf}: engine pid {self.pid} did not stop within "
                f"{self.limit * 1000:.0f} ms"
            )
        raise EngineDied(f"VF{self.spec.vf}: engine pid {self.pid} exited")

    def _do_init(self, timeout: float) -> None:
        self._wait_stopped()
        # Started anywhere (engines start in parallel), run on the device's CPU, every
        # thread: a posted IDLE (host/sched/switch.py) relies on all engines sharing it.
        for tid in _tasks(self.pid):
            os.sched_setaffinity(tid, self._cpus)
            _set_policy(tid, ENGINE_POLICY, 0)
        if self.after_init is not None:
            self.after_init()
            self.after_init = None

    def _do_idle(self, timeout: float) -> None:
        self._stop()
        self._idle_landed(block=True)

    def _post_idle(self) -> bool:
        # Raised, the engine's one thread takes its stop before the next VF's engine gets
        # the CPU. A tenant's extra threads are not raised: theirs would land only once
        # they next get the CPU, behind the next VF (they could run nothing of their own
        # by then, but the VF would not be stopped), so their stop is waited for, as is
        # one that could not be raised.
        single = self._proc.threads() == 1
        self._stop()
        if self._boosted and single:
            return False
        self._idle_landed(block=True)
        return True

    def _stop(self) -> None:
        # A stop lands only once the engine runs again to take it, and on a CPU shared with
        # other work the engine (which has just had the CPU) queues behind everyone else:
        # milliseconds per switch. Just above every normal task it takes the stop at once;
        # stopped, it gets its normal policy back for when it runs again.
        # RESET_ON_FORK: a thread the tenant starts meanwhile does not inherit the raise
        # (no tenant thread ever runs at a real-time policy).
        policy = os.SCHED_FIFO | os.SCHED_RESET_ON_FORK
        self._boosted = _set_policy(self.pid, policy, STOP_PRIORITY)
        self._signal(signal.SIGSTOP)

    def _idle_landed(self, block: bool) -> bool:
        try:
            landed = self._wait_stopped(block)
            if not landed and self._stop_cancelled():
                raise StopCancelled(
                    f"VF{self.spec.vf}: engine pid {self.pid} cancelled its stop "
                    "(a SIGCONT of its own)"
                )
        except DeviceError:
            self._unboost()
            raise
        if landed:
            self._unboost()
        return landed

    def _stop_cancelled(self) -> bool:
        """Whether the stop last sent is neither pending nor taken: a SIGCONT the tenant
        sent itself discarded it (the kernel drops a pending stop when SIGCONT is sent).
        Left raised, its engine would keep the device's CPU and the next VF's engine
        could not take its own stop in time: the neighbour would be reset for it.

        The pending masks are read first: a stop is dequeued and taken under one lock,
        so once it is not pending the engine is either stopped or it was cancelled."""
        try:
            with open(f"/proc/{self.pid}/status") as f:
                pending = [
                    int(line.split()[1], 16)
                    for line in f
                    if line.startswith(("SigPnd:", "ShdPnd:"))
                ]
        except OSError:
            return False  # gone: the exit is reported as such
        if any(m & _SIGSTOP_BIT for m in pending):
            return False
        # The thread that dequeues a stop enters TASK_STOPPED under the same lock, while
        # its siblings may still be running toward their part of the group stop: so any
        # stopped thread means the stop is under way (a SIGCONT would have woken them all).
        return not any(_task_state(self.pid, t) in "tT" for t in _tasks(self.pid))

    def _unboost(self) -> None:
        if self._boosted:
            _set_policy(self.pid, ENGINE_POLICY, 0)
            self._boosted = False

    def _do_run(self, timeout: float) -> None:
        self._signal(signal.SIGCONT)

    def _do_shutdown(self, timeout: float) -> None:
        self.kill()

    def _signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            raise EngineDied(f"VF{self.spec.vf}: engine pid {self.pid} is gone") from None


STOP_PRIORITY = 1  # SCHED_FIFO, below the scheduler thread's (defaults.RT_PRIORITY)
# An emulated device runs beside the host's work, as a GPU's engines do, and never
# takes the CPU from a host task at its wake-up: SCHED_BATCH has a normal task's
# weight (its fair share, and its slice, when the CPU is contended) but no wake-up
# preemption, so a COPY_IN or a LAUNCH arriving while the guest runs on the device's
# CPU waits for that task to sleep or to finish its slice. At SCHED_OTHER each staged
# NetGPU batch woke the engine into the receiver's recv: 350-560 preemptions per GB,
# 4-110 at SCHED_BATCH (docs/netgpu-staged-log.md, "A fifth look"). SCHED_IDLE would stop them
# too, but starves the device behind any busy host task.
ENGINE_POLICY = os.SCHED_BATCH
_SIGSTOP_BIT = 1 << (signal.SIGSTOP - 1)  # in /proc/<pid>/status's pending masks


class StopCancelled(DeviceError):
    """The engine discarded the stop it was sent: the tenant's fault, reset alone."""


def exec_cpu() -> int:
    """The CPU an emulated GPU executes on: the last this process may use."""
    return max(os.sched_getaffinity(0))


def _tasks(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return [pid]  # gone: the affinity call says so


def _task_state(pid: int, tid: int) -> str:
    """One thread's state letter from /proc (X once it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def _set_policy(pid: int, policy: int, priority: int) -> bool:
    try:
        os.sched_setscheduler(pid, policy, os.sched_param(priority))
    except (PermissionError, ProcessLookupError, OSError):
        return False  # without the privilege the stop just takes its chance
    return True


class EmuDevice(Device):
    backend = "emu"

    def __init__(self, sandbox: Sandbox | None = None, watchdog_tick: float = 0.05) -> None:
        """sandbox None: unconfined engines, for tests that drive the device directly;
        the host always passes its own (see device/sandbox/)."""
        self.sandbox = sandbox or Sandbox.off()
        # The emulated GPU executes on one CPU, the last this host may use: one VF's
        # engine runs at a time anyway, and a stop or continue that stays on one CPU
        # needs no inter-processor interrupt (p50 switch ~145 → ~115 µs measured here).
        self.exec_cpus = {exec_cpu()}
        self.host_cpus = os.sched_getaffinity(0) - self.exec_cpus
        self._fbs: dict[int, tuple[int, int]] = {}  # vf -> (fd, size)
        self._faults = StartFaults(os.environ.get(FAULT_ENV, ""))
        self._watchdog = Watchdog(watchdog_tick)
        self._spares: Spares[EmuEngine] = Spares(
            lambda identity: self._engine(SPARE, None, False, identity=identity)
        )

    def total_fb(self, vf_num: int) -> int | None:
        return None

    def create_fb(self, vf: int, size: int) -> int:
        fd = sealed_memfd(f"gpuvirt-vf{vf}-fb", size)  # sparse: costs memory only where touched
        self._fbs[vf] = (fd, size)
        return fd

    def scrub(self, vf: int) -> None:
        fd, size = self._fbs[vf]
        punch_hole(fd, size)

    def fb_resident(self, vf: int) -> int:
        return os.fstat(self._fbs[vf][0]).st_blocks * 512

    def fb_size(self, vf: int) -> int:
        return self._fbs[vf][1]

    def new_engine(self, spec: EngineSpec) -> Engine:
        """A spare when one is ready (started and imported ahead of need: an FLR then
        waits for no interpreter start), and a new spare behind it."""
        fb_fd = self._fbs[spec.vf][0]
        fault = self._faults.should_fail(spec.vf)
        # Confined, a spare has the identity and limits of the VF it was started for and
        # serves that VF only: one per VF (an idle interpreter each), so that every FLR
        # waits for no interpreter start (DESIGN.md: FLR done within cmd_timeout + 300 ms).
        key = self._spare_key(spec)
        engine = self._spares.take(key, spec, fb_fd, fault)
        if engine is None:
            engine = self._engine(spec, fb_fd, fault)
        # The next spare starts once this engine is up, not beside it: during an FLR the
        # CPU goes to finishing this start and to the neighbours, not to a second start.
        engine.after_init = lambda: self._spares.refill(key, spec)
        return engine

    def prestart(self, specs: list[EngineSpec]) -> None:
        """Each VF's first engine as a spare, all started at once: new_engine adopts it."""
        for spec in specs:
            self._spares.refill(self._spare_key(spec), spec)

    def spares(self) -> dict[str, int]:
        return self._spares.counts()

    def _spare_key(self, spec: EngineSpec) -> int:
        return spec.vf if self.sandbox.per_vf_identity else ANY

    def _engine(
        self, spec: EngineSpec, fb_fd: int | None, fault: bool, identity: EngineSpec | None = None
    ) -> EmuEngine:
        cpus = (self.exec_cpus, self.host_cpus)
        return EmuEngine(spec, fb_fd, fault, self._watchdog, cpus, self.sandbox, identity)

    def guest_fds(self, vf: int) -> list[int]:
        return [self._fbs[vf][0]]

    def feature_flags(self) -> int:
        return FEATURE_FB_MAPPED | FEATURE_NETGPU

    def destroy_fb(self, vf: int) -> None:
        fd, _ = self._fbs.pop(vf)
        os.close(fd)

    def close(self) -> None:
        self._spares.close()
        self._watchdog.stop()
        for vf in list(self._fbs):
            self.destroy_fb(vf)
        self.sandbox.close()
