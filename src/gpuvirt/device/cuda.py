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
  (device/engine.py, CoopEngineLoop); an engine that does not acknowledge
  within cmd_timeout is hung. FLR kills the process, and the driver tears
  down its context, its allocation and any kernel still running.
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
import mmap
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuvirt.device.base import (
    CommandTimeout,
    Device,
    Engine,
    EngineDied,
    EngineSpec,
    WSCommand,
)
from gpuvirt.device.emu import FAULT_ENV, _Faults, punch_hole
from gpuvirt.device.engine import CTL_FAIL, CTL_WAKE
from gpuvirt.device.memfd import sealed_memfd
from gpuvirt.device.process import ProcessEngine
from gpuvirt.device.status import Word
from gpuvirt.errors import DeviceError
from gpuvirt.protocol.command import BufDesc, Copy
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
import json, sys
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
            [sys.executable, "-c", _PROBE],
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
    found: dict[str, Any] = json.loads(lines[-1])
    if found.get("stage") == "import":
        raise DeviceError(
            f"CuPy is installed but does not import: {found['error']}; reinstall it with "
            f"`{INSTALL_HINT}` matching your CUDA version"
        )
    if "error" in found:
        raise DeviceError(
            f"no usable NVIDIA GPU: {found['error']}. CuPy {found.get('cupy', '?')} is "
            "installed; check that an NVIDIA GPU and its driver are present (nvidia-smi) and "
            "that CUDA_VISIBLE_DEVICES does not hide it"
        )
    return GpuInfo(
        name=found["name"], free=found["free"], total=found["total"], count=found["count"],
        cupy=found["cupy"], driver=found["driver"], runtime=found["runtime"],
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
        self, spec: EngineSpec, fb_fd: int, backend: str = "cuda", fault: bool = False
    ) -> None:
        self.failure: str | None = None  # what the engine said when it could not start
        super().__init__(spec, fb_fd, backend, ["--switch", "coop"], fault)
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
            # another cmd_timeout would only delay the FLR that is coming.
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

    def __init__(self, probe_timeout: float = PROBE_TIMEOUT_S) -> None:
        self.gpu = probe_gpu(probe_timeout)
        self._apertures: dict[int, tuple[int, int]] = {}  # vf -> (aperture fd, FB size)
        self._engines: dict[int, CoopEngine] = {}
        self._faults = _Faults(os.environ.get(FAULT_ENV, ""))

    def total_fb(self) -> int | None:
        # The config takes pf_fb off this itself (HostConfig.vf_layout).
        return self.gpu.free

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
        fd = self._apertures[spec.vf][0]
        engine = CoopEngine(spec, fd, "cuda", self._faults.should_fail(spec.vf))
        self._engines[spec.vf] = engine
        return engine

    def guest_fds(self, vf: int) -> list[int]:
        return [self._apertures[vf][0]]

    def feature_flags(self) -> int:
        return FEATURE_STAGING | FEATURE_NETGPU

    def destroy_fb(self, vf: int) -> None:
        self._engines.pop(vf, None)
        fd, _ = self._apertures.pop(vf)
        os.close(fd)

    def close(self) -> None:
        for vf in list(self._apertures):
            self.destroy_fb(vf)


def _fmt(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n} B"


class CudaExecutor:
    """Inside the engine: the FB is one device allocation, buffers are cupy views of it.

    Everything a tenant's kernel does goes on one non-blocking stream, made current for
    the engine's thread; so do the staging copies. `synchronize` drains that stream,
    and the engine calls it after every launch and copy and before acknowledging IDLE.
    """

    def __init__(self, aperture_fd: int, fb_size: int, vf: int) -> None:
        import cupy

        self.xp: Any = cupy
        self.size = fb_size
        self.vf = vf
        rt = cupy.cuda.runtime
        self._rt = rt
        self.aperture_size = os.fstat(aperture_fd).st_size
        if self.aperture_size <= RESERVED_SIZE:
            raise DeviceError(f"VF{vf}: aperture of {self.aperture_size} bytes has no staging area")
        self.aperture = mmap.mmap(
            aperture_fd, self.aperture_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
        )
        self._host = np.frombuffer(self.aperture, dtype=np.uint8)
        self._host_ptr = int(self._host.ctypes.data)
        cupy.cuda.Device(0).use()
        try:
            # cudaMalloc directly, not the memory pool: the FB is one fixed allocation
            # that lives as long as the engine, and the pool's limit below is for scratch.
            self._mem = cupy.cuda.Memory(fb_size)
        except Exception as e:
            free, total = rt.memGetInfo()
            raise DeviceError(
                f"VF{vf}: cannot allocate its {_fmt(fb_size)} FB on the device ({e}); "
                f"{_fmt(free)} of {_fmt(total)} free now. Each engine's CUDA context also "
                "takes device memory outside the FBs: lower device.fb_total or raise "
                "device.pf_fb"
            ) from None
        self.base = cupy.cuda.MemoryPointer(self._mem, 0)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()
        # The scrub: whatever the previous owner of this device memory left is gone
        # before INIT_GPU is acknowledged.
        self.base.memset_async(0, fb_size, self.stream)
        # Kernel temporaries come from CuPy's pool, outside the FB; capped so one tenant
        # cannot take the device memory other VFs' temporaries need.
        cupy.get_default_memory_pool().set_limit(size=fb_size)
        staging = self.aperture_size - RESERVED_SIZE
        try:
            rt.hostRegister(self._host_ptr + RESERVED_SIZE, staging, 0)
            self.pinned = True
        except Exception as e:
            # Correct without it, only slower (the driver bounces through its own
            # pinned buffers); say so where the operator looks.
            print(f"gpuvirt engine VF{vf}: staging area not pinned ({e})", file=sys.stderr)
            self.pinned = False
        self.stream.synchronize()

    def view(self, desc: BufDesc) -> Any:
        self._check_fb(desc.offset, desc.nbytes, "buffer")
        return self.xp.ndarray(desc.shape, dtype=desc.dtype, memptr=self.base + desc.offset)

    def copy_in(self, copy: Copy) -> None:
        self._check_copy(copy)
        self._rt.memcpyAsync(
            self.base.ptr + copy.fb_offset,
            self._host_ptr + copy.staging_offset,
            copy.nbytes,
            self._rt.memcpyHostToDevice,
            self.stream.ptr,
        )

    def copy_out(self, copy: Copy) -> None:
        self._check_copy(copy)
        self._rt.memcpyAsync(
            self._host_ptr + copy.staging_offset,
            self.base.ptr + copy.fb_offset,
            copy.nbytes,
            self._rt.memcpyDeviceToHost,
            self.stream.ptr,
        )

    def synchronize(self) -> None:
        self.stream.synchronize()

    def to_host(self, value: Any) -> Any:
        """A kernel's result with device arrays turned into numpy arrays, for the guest."""
        xp = self.xp
        if isinstance(value, xp.ndarray):
            return xp.asnumpy(value, stream=self.stream)
        if isinstance(value, tuple | list):
            return type(value)(self.to_host(v) for v in value)
        if isinstance(value, dict):
            return {k: self.to_host(v) for k, v in value.items()}
        return value

    def _check_fb(self, offset: int, nbytes: int, what: str) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(
                f"{what} at FB offset {offset} of {nbytes} bytes is outside the {self.size}-byte FB"
            )

    def _check_copy(self, copy: Copy) -> None:
        self._check_fb(copy.fb_offset, copy.nbytes, "copy")
        end = copy.staging_offset + copy.nbytes
        if copy.staging_offset < RESERVED_SIZE or end > self.aperture_size:
            raise ValueError(
                f"copy of {copy.nbytes} bytes at aperture offset {copy.staging_offset} is "
                f"outside the staging area [{RESERVED_SIZE}, {self.aperture_size})"
            )
