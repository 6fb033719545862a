"""The emulated GPU: FBs are memfds, engines are OS processes.

World switch is real preemption: IDLE_GPU stops the engine process with
SIGSTOP and confirms the stop with waitid(WSTOPPED), RUN_GPU continues it, so
a kernel is paused mid-instruction. Scrubbing punches a hole over the whole
memfd: every page reads as zero afterwards, for every mapping, and the memory
goes back to the host without being touched page by page.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import signal
from typing import Any

import numpy as np

from gpuvirt.device.base import (
    CommandTimeout,
    Device,
    Engine,
    EngineDied,
    EngineSpec,
    Watchdog,
)
from gpuvirt.device.engine import ADOPT, CTL_ADOPT
from gpuvirt.device.memfd import sealed_memfd
from gpuvirt.device.process import ProcessEngine, send_fd
from gpuvirt.errors import DeviceError
from gpuvirt.protocol.command import BufDesc, Copy
from gpuvirt.protocol.info import FEATURE_FB_MAPPED, FEATURE_NETGPU, PF2VF_OFFSET, RESERVED_SIZE

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]

# Test-only fault switch, read once by the host: "VF:SKIP:COUNT" makes VF's
# engine starts after the first SKIP fail (the process really exits during
# start), COUNT times, or forever when COUNT is 0. Several specs: comma-separated.
FAULT_ENV = "GPUVIRT_FAULT_ENGINE_START"
SPARE = EngineSpec(vf=-1, fb_size=0)  # a spare's spec until it adopts a VF


def punch_hole(fd: int, size: int) -> None:
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, size) != 0:
        err = ctypes.get_errno()
        raise DeviceError(f"scrub failed: fallocate(PUNCH_HOLE): {os.strerror(err)}")


class _Faults:
    def __init__(self, spec: str) -> None:
        self.plan: dict[int, list[int]] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            vf, skip, count = (int(x) for x in part.split(":"))
            self.plan[vf] = [skip, count if count else -1]
        self.starts: dict[int, int] = {}

    def should_fail(self, vf: int) -> bool:
        n = self.starts.get(vf, 0)
        self.starts[vf] = n + 1
        if vf not in self.plan:
            return False
        skip, left = self.plan[vf]
        if n < skip or left == 0:
            return False
        if left > 0:
            self.plan[vf][1] = left - 1
        return True


class EmuEngine(ProcessEngine):
    def __init__(
        self,
        spec: EngineSpec,
        fb_fd: int | None,
        fault: bool,
        watchdog: Watchdog,
        cpus: set[int],
    ) -> None:
        super().__init__(spec, fb_fd, "emu", [], fault)
        self._watchdog = watchdog
        self._cpus = cpus
        watchdog.add(self)
        # Starting (an interpreter, numpy) happens off the device's CPU where there is
        # another: there it would delay the stop of whichever VF is running.
        others = os.sched_getaffinity(0) - cpus
        if others:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(self.pid, others)

    def _reaped_cleanup(self) -> None:
        self._watchdog.discard(self)

    def adopt(self, spec: EngineSpec, fb_fd: int) -> None:
        """Give a spare its VF; INIT_GPU then completes as for any fresh engine."""
        self.spec = spec
        with contextlib.suppress(OSError):  # its start was background work; this is not
            os.setpriority(os.PRIO_PROCESS, self.pid, 0)
        send_fd(self._ctl, CTL_ADOPT + ADOPT.pack(spec.vf, spec.fb_size), fb_fd)

    def _wait_stopped(self, timeout: float) -> None:
        """Block until the stop the last SIGSTOP asked for (or a fresh engine's own) lands.

        The deadline is the watchdog's business (device/base.py): it kills an engine
        that overruns, and the exit ends this wait.
        """
        while True:
            try:
                info = os.waitid(os.P_PID, self.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                info = None
            if info is not None and info.si_code == os.CLD_STOPPED:
                os.waitid(os.P_PID, self.pid, os.WSTOPPED | os.WNOHANG)  # consume it
                return
            if info is None or info.si_code in (os.CLD_EXITED, os.CLD_KILLED, os.CLD_DUMPED):
                break
            # CLD_CONTINUED and the like: not what we wait for
        if self.timed_out:
            raise CommandTimeout(
                f"VF{self.spec.vf}: engine pid {self.pid} did not stop within "
                f"{timeout * 1000:.0f} ms"
            )
        raise EngineDied(f"VF{self.spec.vf}: engine pid {self.pid} exited")

    def _do_init(self, timeout: float) -> None:
        self._wait_stopped(timeout)
        # Started anywhere (engines start in parallel), run on the device's CPU.
        os.sched_setaffinity(self.pid, self._cpus)

    def _do_idle(self, timeout: float) -> None:
        self._signal(signal.SIGSTOP)
        self._wait_stopped(timeout)

    def _do_run(self, timeout: float) -> None:
        self._signal(signal.SIGCONT)

    def _do_shutdown(self, timeout: float) -> None:
        self.kill()

    def _signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            raise EngineDied(f"VF{self.spec.vf}: engine pid {self.pid} is gone") from None


class EmuDevice(Device):
    backend = "emu"

    def __init__(self, watchdog_tick: float = 0.05) -> None:
        # The emulated GPU executes on one CPU, the last this host may use: one VF's
        # engine runs at a time anyway, and a stop or continue that stays on one CPU
        # needs no inter-processor interrupt (p50 switch ~145 → ~115 µs measured here).
        self.exec_cpus = {max(os.sched_getaffinity(0))}
        self._fbs: dict[int, tuple[int, int]] = {}  # vf -> (fd, size)
        self._faults = _Faults(os.environ.get(FAULT_ENV, ""))
        self._watchdog = Watchdog(watchdog_tick)
        self._spare: EmuEngine | None = None

    def total_fb(self) -> int | None:
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
        spare, self._spare = self._spare, None
        if spare is not None and not fault and spare.alive():
            spare.adopt(spec, fb_fd)
            engine = spare
        else:
            if spare is not None:
                spare.kill()
            engine = EmuEngine(spec, fb_fd, fault, self._watchdog, self.exec_cpus)
        self._spare = EmuEngine(SPARE, None, False, self._watchdog, self.exec_cpus)
        return engine

    def guest_fds(self, vf: int) -> list[int]:
        return [self._fbs[vf][0]]

    def feature_flags(self) -> int:
        return FEATURE_FB_MAPPED | FEATURE_NETGPU

    def destroy_fb(self, vf: int) -> None:
        fd, _ = self._fbs.pop(vf)
        os.close(fd)

    def close(self) -> None:
        if self._spare is not None:
            self._spare.kill()
        self._watchdog.stop()
        for vf in list(self._fbs):
            self.destroy_fb(vf)


class EmuExecutor:
    """Inside the engine: the FB is a shared mapping and buffers are numpy views of it."""

    xp: Any = np

    def __init__(self, fb_fd: int, fb_size: int) -> None:
        self.fb = mmap.mmap(fb_fd, fb_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.size = fb_size

    def view(self, desc: BufDesc) -> np.ndarray:
        if desc.offset < 0 or desc.offset + desc.nbytes > self.size:
            raise ValueError(
                f"buffer at offset {desc.offset} of {desc.nbytes} bytes is outside the "
                f"{self.size}-byte FB"
            )
        count = desc.nbytes // np.dtype(desc.dtype).itemsize
        flat = np.frombuffer(self.fb, dtype=desc.dtype, count=count, offset=desc.offset)
        return flat.reshape(desc.shape)

    # The guest maps an emu FB and needs no staging; these copies let the staged path
    # (guest/staging.py, the cuda backend's) run on emu too. The staging area is the
    # unused first 64 KiB of the FB's reserved head (the info blocks start at 64 KiB).
    def copy_in(self, copy: Copy) -> None:
        fb = self._copy_range(copy)
        fb[copy.fb_offset : copy.fb_offset + copy.nbytes] = fb[
            copy.staging_offset : copy.staging_offset + copy.nbytes
        ]

    def copy_out(self, copy: Copy) -> None:
        fb = self._copy_range(copy)
        fb[copy.staging_offset : copy.staging_offset + copy.nbytes] = fb[
            copy.fb_offset : copy.fb_offset + copy.nbytes
        ]

    def _copy_range(self, copy: Copy) -> np.ndarray:
        if copy.staging_offset + copy.nbytes > PF2VF_OFFSET:
            raise ValueError(
                f"copy of {copy.nbytes} bytes at staging offset {copy.staging_offset} is "
                f"outside emu's staging area [0, {PF2VF_OFFSET})"
            )
        if copy.fb_offset < RESERVED_SIZE or copy.fb_offset + copy.nbytes > self.size:
            raise ValueError(
                f"copy of {copy.nbytes} bytes at FB offset {copy.fb_offset} is outside the "
                f"FB past its reserved head [{RESERVED_SIZE}, {self.size})"
            )
        return np.frombuffer(self.fb, dtype=np.uint8)

    def synchronize(self) -> None:
        pass
