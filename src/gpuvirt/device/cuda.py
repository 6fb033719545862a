"""The cuda backend: a real NVIDIA GPU through CuPy.

What is the same as emu: one engine process per VF, the status area, the
control socket, the guest's command channel. What differs, and why:

- **No CUDA in the host.** The host process never imports CuPy or creates a
  CUDA context: a context costs device memory and would die with the host's
  own bugs. CuPy's presence is checked with `find_spec`, the GPU with a
  short-lived probe subprocess (which also measures the free device memory
  that `total_fb` reports). Each engine holds its own context.
- **The FB is device memory the host cannot map.** Each VF has one device
  allocation of its configured size, made by its engine. What the host and the
  guest share is the VF's *aperture*, a memfd: the reserved head (PF2VF at
  64 KiB, VF2PF at 65 KiB, as on emu) and after it a staging area that the
  engine registers with the CUDA driver (pinned), so copies between staging
  and the FB are DMA on the engine's stream. The guest moves data with
  COPY_IN/COPY_OUT messages (guest/staging.py). `Copy.staging_offset` is an
  offset in the aperture.
- **Cooperative world switch.** A process in a CUDA kernel cannot be stopped
  the way emu stops one: SIGSTOP would freeze the CPU side while the kernel
  runs on. So IDLE/RUN are commands the engine acknowledges between kernels
  (device/engine_loop.py, CoopEngineLoop); an engine that does not acknowledge
  within its limit (for IDLE: scheduler.coop_idle_timeout_ms) is hung. FLR
  kills the process, and the driver tears down its context, its allocation
  and any kernel still running.
- **Scrub at engine start.** The FB lives in the engine, so a fresh engine
  zeroes its whole allocation before it acknowledges INIT_GPU; the host only
  scrubs the aperture (punching a hole, as emu does). The host always kills
  and restarts the engine after FLR and fini, so every new guest gets zeros.

Nothing here imports CuPy at module import; CudaExecutor, which runs inside
the engine, imports it when it is constructed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from gpuvirt.device.base import (
    CommandTimeout,
    Device,
    Engine,
    EngineDied,
    EngineSpec,
    WSCommand,
)
from gpuvirt.device.budget import EngineMemory, context_cost, fb_room
from gpuvirt.device.ctl import CTL_FAIL, CTL_WAKE
from gpuvirt.device.faults import FAULT_ENV, StartFaults
from gpuvirt.device.memfd import punch_hole, sealed_memfd
from gpuvirt.device.process import ProcessEngine
from gpuvirt.device.sandbox import Sandbox
from gpuvirt.device.spare import ANY, SPARE, Spares
from gpuvirt.device.status import Word
from gpuvirt.errors import DeviceError
from gpuvirt.protocol.info import FEATURE_NETGPU, FEATURE_STAGING, RESERVED_SIZE

# The staging area per VF, after the reserved head of the aperture. Pinned by the
# engine, so it costs this much locked host memory per running engine. 16 MiB is
# two 2 MiB windows for Buffer reads/writes plus 12 MiB for NetGPU's receive chunks.
STAGING_SIZE = 16 << 20
APERTURE_SIZE = RESERVED_SIZE + STAGING_SIZE
# Creating a context and loading CuPy take seconds on a cold machine; a probe that
# takes longer than this is stuck in the driver.
PROBE_TIMEOUT_S = 60.0
# Both spellings: the extra is the project's way, the bare package survives shells and
# terminals that eat square brackets.
INSTALL_HINT = "pip install 'gpuvirt[cuda]'"
PACKAGE_HINT = "pip install cupy-cuda12x"

# Run in a child interpreter: whatever CUDA does (or fails to do) stays there.
_PROBE = r"""
import json, subprocess, sys
out = {}
try:
    import cupy
except Exception as e:
    print(json.dumps({"stage": "import", "error": f"{type(e).__name__}: {e}"}))
    sys.exit(0)
out["cupy"] = cupy.__version__
try:
    rt = cupy.cuda.runtime
    out["count"] = rt.getDeviceCount()
    if out["count"] < 1:
        raise RuntimeError("getDeviceCount() = 0")
    rt.setDevice(0)
    free, total = rt.memGetInfo()
    props = rt.getDeviceProperties(0)
    name = props["name"]
    out.update(
        free=int(free), total=int(total),
        name=name.decode() if isinstance(name, bytes) else str(name),
        driver=rt.driverGetVersion(), runtime=rt.runtimeGetVersion(),
    )
except Exception as e:
    out.update(stage="device", error=f"{type(e).__name__}: {e}")
    print(json.dumps(out))
    sys.exit(0)
# One engine's context, measured: free device memory with a warmed-up engine context
# beside ours, opened exactly as engines open theirs.
try:
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE_CONTEXT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )
    line = engine.stdout.readline()
    if line.strip() != "ready":
        err = engine.communicate()[1].strip()[-1500:]
        raise RuntimeError(f"the engine context did not open (exit {engine.returncode}): {err}")
    out["free_with_engine"] = int(rt.memGetInfo()[0])
    engine.stdin.close()
    engine.wait()
except Exception as e:
    out.update(stage="context", error=f"{type(e).__name__}: {e}")
print(json.dumps(out))
"""
_PROBE_ENGINE = r"""
import sys
from gpuvirt.device.cuda_executor import CudaContext
CudaContext.open()
print("ready", flush=True)
sys.stdin.read()
"""


@dataclass(frozen=True)
class GpuInfo:
    """What the probe found: device 0 as CUDA_VISIBLE_DEVICES presents it."""

    name: str
    free: int
    total: int
    count: int
    cupy: str
    driver: int
    runtime: int
    context: int  # one engine's CUDA context as budgeted (device/budget.py)


def cupy_installed() -> bool:
    """Whether `import cupy` can find a package, without importing it."""
    try:
        return importlib.util.find_spec("cupy") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["cupy"] is None
        return False


def probe_gpu(timeout: float = PROBE_TIMEOUT_S) -> GpuInfo:
    """Find device 0 and its free memory in a child process; DeviceError says what is missing."""
    if not cupy_installed():
        raise DeviceError(
            'device.backend = "cuda" needs CuPy, which is not installed in this Python '
            f"({sys.executable}); install it with `{INSTALL_HINT}` or `{PACKAGE_HINT}` "
            '(CuPy for CUDA 12), or use device.backend = "emu"'
        )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", f"ENGINE_CONTEXT = {_PROBE_ENGINE!r}\n{_PROBE}"],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise DeviceError(
            f"the CUDA probe (import cupy, open device 0) did not finish within {timeout:g} s; "
            "the NVIDIA driver may be hung (try nvidia-smi)"
        ) from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (proc.stderr or proc.stdout).strip()[-1500:]
        raise DeviceError(f"the CUDA probe failed (exit {proc.returncode}):\n{tail}")
    return gpu_info(json.loads(lines[-1]))


def gpu_info(found: dict[str, Any]) -> GpuInfo:
    """What the probe printed, as GpuInfo; DeviceError for the stage that failed."""
    if found.get("stage") == "import":
        raise DeviceError(
            f"CuPy is installed but does not import: {found['error']}; reinstall it with "
            f"`{INSTALL_HINT}` matching your CUDA version"
        )
    if found.get("stage") == "device":
        raise DeviceError(
            f"no usable NVIDIA GPU: {found['error']}. CuPy {found.get('cupy', '?')} is "
            "installed; check that an NVIDIA GPU and its driver are present (nvidia-smi) and "
            "that CUDA_VISIBLE_DEVICES does not hide it"
        )
    if found.get("stage") == "context":
        raise DeviceError(
            f"measuring one engine's CUDA context on {found['name']} failed: {found['error']}"
        )
    return GpuInfo(
        name=found["name"], free=found["free"], total=found["total"], count=found["count"],
        cupy=found["cupy"], driver=found["driver"], runtime=found["runtime"],
        context=context_cost(found["free"], found["free_with_engine"]),
    )  # fmt: skip


class CoopEngine(ProcessEngine):
    """Host side of an engine that world-switches by acknowledged commands.

    The cuda backend's engine. `backend="emu"` runs the same protocol over an emu
    FB (`--switch coop`), which is how the cooperative path is tested without a GPU.

    A command: write CMD_CODE, then CMD_SERIAL (host-written words), send CTL_WAKE,
    and wait until ACK_SERIAL reaches the serial. The wait sleeps in epoll on the
    control socket (the engine answers CTL_ACK) and on the process's pidfd (an engine
    that dies is noticed at once, not at the timeout).
    """

    # The scheduler charges the wait for IDLE's acknowledgement to the outgoing VF: it
    # kept the device until its kernel ended (see docs/cuda.md).
    cooperative = True

    def __init__(
        self,
        spec: EngineSpec,
        fb_fd: int | None,
        backend: str = "cuda",
        fault: bool = False,
        scratch: int = 0,
        sandbox: Sandbox | None = None,
        identity: EngineSpec | None = None,
    ) -> None:
        """fb_fd None: a spare (device/spare.py); scratch: the cap on kernel temporaries."""
        self.failure: str | None = None  # what the engine said when it could not start
        extra = ["--switch", "coop", "--scratch", str(scratch)]
        super().__init__(spec, fb_fd, backend, extra, fault, sandbox or Sandbox.off(), identity)
        # Only a cuda engine measures the device (its executor's BusyClock); over an emu FB
        # the word stays 0 and the device's time is the host's wall clock.
        self._measures = backend == "cuda"
        self._poll = select.epoll()
        self._poll.register(self._ctl.fileno(), select.EPOLLIN)
        self._poll.register(self._pidfd, select.EPOLLIN)

    def _prepare(self) -> None:
        # INIT_GPU is waiting for the engine before it starts: it acknowledges it once
        # its executor is up, which is how _do_init learns the start is done.
        self._serial = 1
        self._pending = WSCommand.INIT_GPU
        self.status[Word.CMD_CODE] = WSCommand.INIT_GPU
        self.status[Word.CMD_SERIAL] = self._serial

    def _reaped_cleanup(self) -> None:
        self._poll.close()

    def busy_ns(self) -> int | None:
        """BUSY_NS: the device time of the engine's launches and copies, by the device's
        own clock (CUDA events; docs/cuda.md, "Device time"). The engine writes it."""
        return self.status[Word.BUSY_NS] if self._measures else None

    def holds_fb(self) -> bool:
        """True while the engine process has its FB allocated (INIT done, not dead)."""
        return not self._reaped and self.alive() and bool(self.status[Word.READY])

    def _do_init(self, timeout: float) -> None:
        self._await(timeout)

    def _do_idle(self, timeout: float) -> None:
        self._issue(WSCommand.IDLE_GPU, timeout)

    def _do_run(self, timeout: float) -> None:
        self._issue(WSCommand.RUN_GPU, timeout)

    def _do_shutdown(self, timeout: float) -> None:
        self.kill()

    def _issue(self, cmd: WSCommand, timeout: float) -> None:
        if self._reaped:
            raise EngineDied(f"VF{self.spec.vf}: engine pid {self.pid} is gone")
        self._drain_ctl()
        if self.status[Word.ACK_SERIAL] < self._serial:
            # Still inside whatever kept it from acknowledging the last command. Waiting
            # another limit would only delay the FLR that is coming.
            raise CommandTimeout(
                f"VF{self.spec.vf}: engine pid {self.pid} has still not acknowledged "
                f"{self._pending.name}; it is stuck in a kernel"
            )
        self._serial += 1
        self._pending = cmd
        self.status[Word.CMD_CODE] = cmd
        self.status[Word.CMD_SERIAL] = self._serial
        try:
            self._ctl.send(CTL_WAKE)
        except BlockingIOError:
            pass  # earlier wakes unread: the engine is not looking; the wait will time out
        except OSError:
            raise EngineDied(f"VF{self.spec.vf}: engine pid {self.pid} is gone") from None
        self._await(timeout)

    def _await(self, timeout: float) -> None:
        """Wait for ACK_SERIAL to reach the serial of the pending command."""
        deadline = time.monotonic() + timeout
        while True:
            self._drain_ctl()
            if self.status[Word.ACK_SERIAL] >= self._serial:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommandTimeout(
                    f"VF{self.spec.vf}: engine pid {self.pid} did not acknowledge "
                    f"{self._pending.name} within {timeout * 1000:.0f} ms"
                )
            for fd, _ in self._poll.poll(left):
                if fd == self._pidfd:
                    self._drain_ctl()
                    if self.status[Word.ACK_SERIAL] >= self._serial:
                        return  # it answered, then exited; the exit fd reports the death
                    why = f": {self.failure}" if self.failure else ""
                    raise EngineDied(
                        f"VF{self.spec.vf}: engine pid {self.pid} exited during "
                        f"{self._pending.name}{why}"
                    )

    def _drain_ctl(self) -> None:
        """Read what the engine sent: acks (the status word is the record) or its failure."""
        while True:
            try:
                msg = self._ctl.recv(8192)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                msg = b""
            if not msg:
                # The engine's end closed: it exited. Stop watching the socket, or epoll
                # would report the hang-up until the pidfd does.
                with contextlib.suppress(OSError, ValueError):
                    self._poll.unregister(self._ctl.fileno())
                return
            if msg.startswith(CTL_FAIL):
                self.failure = msg[len(CTL_FAIL) :].decode(errors="replace")


class CudaDevice(Device):
    """One NVIDIA GPU (device 0 of what CUDA_VISIBLE_DEVICES shows)."""

    backend = "cuda"

    def __init__(
        self,
        sandbox: Sandbox | None = None,
        *,
        kernel_scratch: int,
        probe_timeout: float = PROBE_TIMEOUT_S,
    ) -> None:
        """sandbox None: unconfined engines (device tests); the host passes its own."""
        self.sandbox = sandbox or Sandbox.off()
        self.gpu = probe_gpu(probe_timeout)
        self.memory = EngineMemory(context=self.gpu.context, scratch=kernel_scratch)
        self._apertures: dict[int, tuple[int, int]] = {}  # vf -> (aperture fd, FB size)
        self._engines: dict[int, CoopEngine] = {}
        self._faults = StartFaults(os.environ.get(FAULT_ENV, ""))
        self._spares: Spares[CoopEngine] = Spares(
            lambda identity: CoopEngine(
                SPARE, None, "cuda", scratch=kernel_scratch, sandbox=self.sandbox,
                identity=identity,
            )
        )  # fmt: skip

    def total_fb(self, vf_num: int) -> int | None:
        # The config takes pf_fb off this itself (HostConfig.vf_layout).
        return fb_room(self.gpu.free, self.memory, vf_num)

    def engine_memory(self) -> EngineMemory:
        return self.memory

    def create_fb(self, vf: int, size: int) -> int:
        # sparse until the engine pins the staging area
        fd = sealed_memfd(f"gpuvirt-vf{vf}-aperture", APERTURE_SIZE)
        self._apertures[vf] = (fd, size)
        return fd

    def scrub(self, vf: int) -> None:
        """Zero the aperture; the device FB is zeroed by the next engine before INIT_GPU.

        Every host path that scrubs kills the VF's engine first (FLR, fini, disable) and
        starts a fresh one after, so no guest ever sees a FB the fresh engine did not
        zero. clear-fb on an AVAIL VF finds an engine that has zeroed its FB at start and
        has had no guest since.
        """
        fd, _size = self._apertures[vf]
        punch_hole(fd, APERTURE_SIZE)

    def fb_resident(self, vf: int) -> int:
        engine = self._engines.get(vf)
        if engine is None or not engine.holds_fb():
            return 0
        return self._apertures[vf][1]

    def fb_size(self, vf: int) -> int:
        return self._apertures[vf][1]

    def new_engine(self, spec: EngineSpec) -> Engine:
        """The spare when one is ready (its interpreter, CuPy and warmed-up context are
        there already: the FLR waits only for the FB's allocation and scrub), and a new
        spare behind it."""
        fd = self._apertures[spec.vf][0]
        fault = self._faults.should_fail(spec.vf)
        key = spec.vf if self.sandbox.per_vf_identity else ANY  # as emu's spares
        engine = self._spares.take(key, spec, fd, fault)
        if engine is None:
            engine = CoopEngine(spec, fd, "cuda", fault, self.memory.scratch, self.sandbox)
        self._spares.refill(key, spec)
        self._engines[spec.vf] = engine
        return engine

    def spares(self) -> dict[str, int]:
        return self._spares.counts()

    def guest_fds(self, vf: int) -> list[int]:
        return [self._apertures[vf][0]]

    def feature_flags(self) -> int:
        return FEATURE_STAGING | FEATURE_NETGPU

    def destroy_fb(self, vf: int) -> None:
        self._engines.pop(vf, None)
        fd, _ = self._apertures.pop(vf)
        os.close(fd)

    def close(self) -> None:
        self._spares.close()
        for vf in list(self._apertures):
            self.destroy_fb(vf)
        self.sandbox.close()
