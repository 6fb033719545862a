"""What the host needs from a device backend, and the world-switch command order.

GIM keeps what is true of every GPU in its core and what one chip does in a
hw layer; this module is the line between the two. The host drives a Device
and its Engines through these interfaces and never asks which backend it has.

World-switch commands carry GIM's codes and may only follow each other as the
table below says; anything else is a bug and raises StateError naming the VF,
the engine's last command and the one attempted.
"""

from __future__ import annotations

import abc
import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from enum import IntEnum

from gpuvirt.device.budget import EngineMemory
from gpuvirt.device.status import StatusArea, Word
from gpuvirt.errors import DeviceError, StateError


class WSCommand(IntEnum):
    IDLE_GPU = 0x01
    SAVE_GPU_STATE = 0x02
    LOAD_GPU_STATE = 0x03
    RUN_GPU = 0x04
    INIT_GPU = 0x07
    SHUTDOWN_GPU = 0x0D


# command -> the commands it may follow. A fresh engine counts as after SHUTDOWN.
LEGAL_AFTER: dict[WSCommand, frozenset[WSCommand]] = {
    WSCommand.INIT_GPU: frozenset({WSCommand.SHUTDOWN_GPU}),
    WSCommand.RUN_GPU: frozenset({WSCommand.INIT_GPU, WSCommand.LOAD_GPU_STATE}),
    WSCommand.IDLE_GPU: frozenset({WSCommand.RUN_GPU}),
    WSCommand.SAVE_GPU_STATE: frozenset({WSCommand.IDLE_GPU}),
    WSCommand.LOAD_GPU_STATE: frozenset({WSCommand.SAVE_GPU_STATE}),
    WSCommand.SHUTDOWN_GPU: frozenset({WSCommand.SAVE_GPU_STATE}),
}


# command -> the Engine method that carries it out on a backend
_STEP: dict[WSCommand, str] = {
    WSCommand.INIT_GPU: "_do_init",
    WSCommand.RUN_GPU: "_do_run",
    WSCommand.IDLE_GPU: "_do_idle",
    WSCommand.SAVE_GPU_STATE: "_do_save",
    WSCommand.LOAD_GPU_STATE: "_do_load",
    WSCommand.SHUTDOWN_GPU: "_do_shutdown",
}


@dataclass(frozen=True)
class SwitchLimits:
    """How long world-switch commands may take before the VF counts as hung."""

    cmd_s: float  # any command
    # A cooperative engine (cuda) acknowledges IDLE only at a kernel boundary, so its IDLE
    # waits for the running kernel: how far past its slice a kernel may run.
    coop_idle_s: float

    def of(self, cmd: WSCommand, cooperative: bool) -> float:
        return self.coop_idle_s if cooperative and cmd == WSCommand.IDLE_GPU else self.cmd_s


@dataclass(frozen=True)
class SwitchedOut:
    """What switch_out tells the scheduler about the VF it took off the device."""

    # CLOCK_MONOTONIC ns at which the VF stopped holding the device: its slice is charged
    # up to here, the rest of the switch is overhead. A preemptive engine (emu) holds it
    # until the stop is issued; a cooperative one until it acknowledged (its kernel ran on).
    until_ns: int
    # The engine's own device-time counter then (busy_ns()); None: the wall's time is the
    # device's (emu).
    busy_ns: int | None
    # The stop was issued and is not confirmed yet: settle() confirms it, and every later
    # command to the engine settles first.
    posted: bool
    took_ns: dict[str, int]  # per world-switch command, how long it took


class CommandTimeout(DeviceError):
    """A world-switch command was not done within cmd_timeout: the VF hangs."""


class EngineDied(DeviceError):
    """The engine process exited while the host expected it alive."""


@dataclass
class EngineSpec:
    """Everything an engine needs to start: which VF and its FB."""

    vf: int
    fb_size: int


class Engine(abc.ABC):
    """One VF's executor. Subclasses implement the _do_* steps; ordering is enforced here."""

    # The two kinds of world switch differ only inside switch_out(), which the host calls;
    # it never reads these. Cooperative engines stop at kernel boundaries: the wait for
    # IDLE's acknowledgement is the outgoing VF's own time (its kernel is still running),
    # not switch overhead, and has its own limit.
    cooperative = False
    # IDLE may be posted: issued, with its stop confirmed later. Only a backend whose
    # engines cannot execute before the stop has landed says so (emu: device/emu.py).
    can_post = False

    def __init__(self, spec: EngineSpec, status: StatusArea) -> None:
        self.spec = spec
        self.status = status
        self.last = WSCommand.SHUTDOWN_GPU
        self.deadline: float | None = None  # set while a command is in flight
        self.limit = 0.0  # that command's timeout, in seconds
        self.timed_out = False  # the watchdog killed it for overrunning a command
        self.posted = False  # an IDLE posted and its stop not yet confirmed (settle)

    def command(self, cmd: WSCommand, timeout: float) -> float:
        """Run one world-switch command; return its duration in seconds."""
        self._check_order(cmd)
        t0 = time.monotonic()
        self.settle()
        self.deadline, self.limit = t0 + timeout, timeout
        getattr(self, _STEP[cmd])(timeout)
        self.deadline = None
        self.last = cmd
        return time.monotonic() - t0

    def switch_out(self, limits: SwitchLimits, post: bool = False) -> SwitchedOut:
        """IDLE then SAVE: take the VF off the device.

        post: the caller hands the device to another VF at once and confirms this stop
        later (settle()); a backend that cannot post (can_post) waits for it here. A
        posted stop keeps its deadline meanwhile: the watchdog kills an engine that
        overruns it. A backend may wait for it all the same (emu: EmuEngine._post_idle).
        """
        t0 = time.monotonic_ns()
        if post and self.can_post:
            self._check_order(WSCommand.IDLE_GPU)
            self.settle()
            self.deadline, self.limit = t0 / 1e9 + limits.cmd_s, limits.cmd_s
            self.posted = not self._post_idle()
            if not self.posted:
                self.deadline = None
            self.last = WSCommand.SAVE_GPU_STATE  # SAVE copies nothing on a backend that posts
            took = {WSCommand.IDLE_GPU.name: time.monotonic_ns() - t0}
            return SwitchedOut(t0, self.busy_ns(), self.posted, took)
        idle = self._timed(WSCommand.IDLE_GPU, limits)
        until = t0 + idle if self.cooperative else t0
        busy = self.busy_ns()
        save = self._timed(WSCommand.SAVE_GPU_STATE, limits)
        took = {WSCommand.IDLE_GPU.name: idle, WSCommand.SAVE_GPU_STATE.name: save}
        return SwitchedOut(until, busy, False, took)

    def switch_in(self, limits: SwitchLimits) -> dict[str, int]:
        """LOAD (after a SAVE) then RUN; how long each took, in ns."""
        took = {}
        if self.last == WSCommand.SAVE_GPU_STATE:
            took[WSCommand.LOAD_GPU_STATE.name] = self._timed(WSCommand.LOAD_GPU_STATE, limits)
        took[WSCommand.RUN_GPU.name] = self._timed(WSCommand.RUN_GPU, limits)
        return took

    def _timed(self, cmd: WSCommand, limits: SwitchLimits) -> int:
        return int(self.command(cmd, limits.of(cmd, self.cooperative)) * 1e9)

    def settle(self, block: bool = True) -> bool:
        """Confirm a posted IDLE: True once the engine has stopped (at once if none is
        posted), False while it has not (block=False). Raises as IDLE would."""
        if not self.posted:
            return True
        try:
            if not self._idle_landed(block):
                return False
        except DeviceError:
            self.posted, self.deadline = False, None
            raise
        self.posted, self.deadline = False, None
        return True

    def _check_order(self, cmd: WSCommand) -> None:
        if self.last not in LEGAL_AFTER[cmd]:
            raise StateError(
                f"VF{self.spec.vf}: world-switch {cmd.name} is illegal after {self.last.name}"
            )

    @property
    def running(self) -> bool:
        return self.last == WSCommand.RUN_GPU

    def notify_idle(self, on: bool) -> None:
        """Ask the engine to signal idle_fd() when its queue drains, or stop asking."""
        self.status[Word.NOTIFY_IDLE] = int(on)

    @property
    def notifies_idle(self) -> bool:
        return bool(self.status[Word.NOTIFY_IDLE])

    def busy_ns(self) -> int | None:
        """Device time the engine's work has used so far, in ns, as the device measured it;
        None where the device's time is the host's wall clock (emu). Written by the
        engine, so untrusted: a scheduler that charges it bounds it by wall time."""
        return None

    @property
    @abc.abstractmethod
    def pid(self) -> int: ...

    @abc.abstractmethod
    def alive(self) -> bool:
        """False once the engine process has exited (does not reap it)."""

    @abc.abstractmethod
    def exit_fd(self) -> int:
        """A file descriptor that becomes readable when the engine process exits."""

    @abc.abstractmethod
    def idle_fd(self) -> int:
        """An eventfd the engine signals when its queue drains (if NOTIFY_IDLE is set)."""

    @abc.abstractmethod
    def attach_guest(self, channel_fd: int) -> None:
        """Install a new guest's command channel, dropping any previous guest's."""

    @abc.abstractmethod
    def kill(self) -> None:
        """SIGKILL the engine and reap it. Idempotent; legal in any state."""

    @abc.abstractmethod
    def _do_init(self, timeout: float) -> None: ...

    @abc.abstractmethod
    def _do_run(self, timeout: float) -> None: ...

    @abc.abstractmethod
    def _do_idle(self, timeout: float) -> None: ...

    def _post_idle(self) -> bool:
        """Issue IDLE (only where can_post); True if it had to be waited for instead."""
        raise NotImplementedError

    def _idle_landed(self, block: bool) -> bool:
        """Whether a posted IDLE has landed, waiting for it if `block` (where can_post)."""
        raise NotImplementedError

    def _do_save(self, timeout: float) -> None:
        """Contexts live in the engine process; nothing to copy out on these backends."""

    def _do_load(self, timeout: float) -> None:
        """See _do_save."""

    @abc.abstractmethod
    def _do_shutdown(self, timeout: float) -> None: ...


class Watchdog:
    """Enforces cmd_timeout on commands that wait in a blocking call.

    emu confirms a stop with a blocking waitid (the fastest wakeup there is, and
    the waiting thread leaves the CPU to the engine it waits for), which cannot
    time out by itself. The watchdog thread ticks a few times per timeout and
    SIGKILLs an engine whose command is past its deadline; the blocked waitid
    then returns and the command fails as a timeout. A hardware watchdog, in
    software: a periodic check is the mechanism.
    """

    def __init__(self, tick: float) -> None:
        self.tick = tick
        self._engines: dict[int, Engine] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuvirt-watchdog", daemon=True)
        self._thread.start()

    def add(self, engine: Engine) -> None:
        with self._lock:
            self._engines[id(engine)] = engine

    def discard(self, engine: Engine) -> None:
        with self._lock:
            self._engines.pop(id(engine), None)

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            with self._lock:
                late = [e for e in self._engines.values() if e.deadline and e.deadline < now]
            for e in late:
                e.timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(e.pid, signal.SIGKILL)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Device(abc.ABC):
    """One GPU as the host sees it: FBs to carve and engines to run on them."""

    backend: str
    # CPUs the device executes on, where that is the host's own (emu), and the others,
    # where the host's own threads run (the scheduler thread included: beside the device,
    # its work is no VF's device time). None: a real device, which takes no host CPU.
    exec_cpus: set[int] | None = None
    host_cpus: set[int] | None = None

    def keep_host_off(self) -> None:
        """Move every thread of the calling process off the device's CPUs; threads it
        starts later inherit that. Nothing to do where the device has its own."""
        if not self.exec_cpus or not self.host_cpus:
            return
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(task), self.host_cpus)

    @abc.abstractmethod
    def total_fb(self, vf_num: int) -> int | None:
        """Device memory for the PF reserve and the FBs of `vf_num` VFs, after what their
        engines take outside the FBs; None where the config decides (emu)."""

    def engine_memory(self) -> EngineMemory:
        """Device memory each engine takes outside its FB (budgeted in total_fb)."""
        return EngineMemory()

    @abc.abstractmethod
    def create_fb(self, vf: int, size: int) -> int:
        """Create the VF's FB; return the fd of its host-visible aperture (info blocks at 64 KiB)."""

    @abc.abstractmethod
    def scrub(self, vf: int) -> None:
        """Zero the VF's whole FB. Only called while no engine has it mapped for a guest."""

    @abc.abstractmethod
    def fb_size(self, vf: int) -> int:
        """The VF's FB size in bytes."""

    @abc.abstractmethod
    def destroy_fb(self, vf: int) -> None:
        """Drop the VF's FB (the VF is being disabled)."""

    def renew_fb(self, vf: int, size: int | None = None) -> int:
        """Scrub the VF's FB and give it a new identity (fd) for the next tenant.

        numpy views can keep a detached guest's mapping of the old FB alive after it
        closed; that mapping then reaches only the scrubbed old memory, never what the
        next tenant writes. `size` re-carves it (`gpuvirt vf set --fb`). Called only
        while no engine runs on the FB.
        """
        size = self.fb_size(vf) if size is None else size
        self.scrub(vf)
        self.destroy_fb(vf)
        return self.create_fb(vf, size)

    @abc.abstractmethod
    def fb_resident(self, vf: int) -> int:
        """Bytes of the VF's FB that hold memory now (touched and not scrubbed)."""

    @abc.abstractmethod
    def new_engine(self, spec: EngineSpec) -> Engine:
        """Spawn the VF's engine process. It is not usable until INIT_GPU completes."""

    def prestart(self, specs: list[EngineSpec]) -> None:
        """Start, side by side, the engines that these VFs' first `new_engine` will take.
        The host enables its VFs one at a time (under its lifecycle lock); without this,
        each waits for the interpreter start of the one before it. A backend without
        spare engines starts nothing here."""

    def spares(self) -> dict[str, int]:
        """Spare engines alive (`kept`) and done starting (`ready`); device/spare.py."""
        return {"kept": 0, "ready": 0}

    @abc.abstractmethod
    def guest_fds(self, vf: int) -> list[int]:
        """The descriptors a guest of this VF receives besides its command channel."""

    def feature_flags(self) -> int:
        return 0

    def close(self) -> None:
        """Release whatever the device holds."""
