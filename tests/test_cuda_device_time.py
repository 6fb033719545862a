"""Device time measured by the device, on a real NVIDIA GPU (skipped without one;
GPUVIRT_REQUIRE_CUDA=1 makes that a failure, as in test_cuda_gpu.py).

- the device-bound bench kernel (bench/wait.py): its progress comes from the device's
  %globaltimer, turned into CLOCK_MONOTONIC, and it runs its own time;
- a cuda engine's BUSY_NS (CUDA events around each launch, device/cuda_executor.py
  BusyClock) holds at least the kernels' own device time and at most the wall time of
  the launches. Bounds, not timings: each holds on any GPU however loaded.
"""

from __future__ import annotations

import os
import time

import pytest

from gpuvirt.bench.wait import wait_log
from gpuvirt.device.base import WSCommand
from gpuvirt.device.cuda import probe_gpu
from gpuvirt.errors import DeviceError
from gpuvirt.guest.queue import kernel
from helpers import coop_engine

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]
KERNEL_S = 0.005
FB_SIZE = 64 << 20


@pytest.fixture(scope="module")
def gpu() -> None:
    try:
        probe_gpu()
    except DeviceError as e:
        if os.environ.get("GPUVIRT_REQUIRE_CUDA") == "1":
            pytest.fail(f"GPUVIRT_REQUIRE_CUDA=1 but: {e}")
        pytest.skip(str(e))


def test_wait_kernel_runs_its_own_time_and_logs_it_from_the_device(gpu: None) -> None:
    import cupy

    wait_log(cupy, 0.0001)  # compile and calibrate outside the bracket
    t0 = time.monotonic_ns()
    log = wait_log(cupy, KERNEL_S)
    t1 = time.monotonic_ns()
    stamps = [t for t, _ in log]
    work = [n for _, n in log]
    assert stamps == sorted(stamps) and work == sorted(work)
    assert work[-1] >= KERNEL_S * 1e9  # it ends once it has run its budget
    assert len(log) >= KERNEL_S * 1e9 // 100_000  # a checkpoint every 0.1 ms of its time
    # the device's clock, mapped: inside the CPU's bracket (to the calibration's error)
    assert t0 - 1_000_000 <= stamps[0] and stamps[-1] <= t1 + 1_000_000


def test_busy_ns_holds_the_launches_device_time(gpu: None) -> None:
    with coop_engine(backend="cuda", fb_size=FB_SIZE, init_timeout=120) as (engine, queue):
        k = kernel(wait_log)
        queue.launch(k, (0.0001,), {}).result(timeout=120)  # compile, calibrate
        engine.command(WSCommand.IDLE_GPU, 5)
        engine.command(WSCommand.SAVE_GPU_STATE, 5)
        engine.command(WSCommand.LOAD_GPU_STATE, 5)
        before = engine.busy_ns()
        assert before is not None
        t0 = time.monotonic_ns()
        engine.command(WSCommand.RUN_GPU, 5)
        logs = [queue.launch(k, (KERNEL_S,), {}).result(timeout=60) for _ in range(3)]
        engine.command(WSCommand.IDLE_GPU, 5)  # IDLE publishes the last launch's time
        wall = time.monotonic_ns() - t0
        busy = engine.busy_ns() - before
        own = sum(log[-1][1] for log in logs)
        assert own <= busy <= wall
