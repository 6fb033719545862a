"""The cuda backend on a real NVIDIA GPU: the behaviours a tenant relies on.

Every test here needs CuPy and a GPU and skips with the reason where either is
missing. GPUVIRT_REQUIRE_CUDA=1 (scripts/gpu-check sets it) turns those skips
into failures, so a GPU run cannot pass by skipping.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import DefragResult

import cloudpickle
import numpy as np
import pytest

import gpuvirt
from gpuvirt.bench.common import scratch_host
from gpuvirt.device.cuda import GpuInfo
from gpuvirt.errors import GpuvirtError, KernelError, VFResetError
from gpuvirt.protocol.info import FEATURE_FB_MAPPED, FEATURE_STAGING, RESERVED_SIZE
from helpers import wait_event, wait_until

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

# volatile: without it the compiler may assume the loop ends (or delete it).
SPIN_FOREVER = r"""
extern "C" __global__ void spin_forever(volatile int *flag) {
    while (*flag == 0) { }
}
"""
CUDA_HOST = {
    "device": {"backend": "cuda", "fb_total": "2GiB", "pf_fb": "64MiB"},
    "sriov": {"vf_num": 2},
    "scheduler": {"policy": "liquid", "cmd_timeout_ms": 500, "job_timeout_s": 3},
}


@pytest.fixture(scope="module")
def host(gpu_info: GpuInfo) -> Iterator[Any]:
    # Module-scoped: it holds device memory until this module ends. A test that sizes a
    # host from the device's free memory lives in test_cuda_gpu_whole.py, where no
    # other host of the suite is alive.
    with scratch_host(**CUDA_HOST) as hp:
        yield hp


@pytest.fixture
def gpu(host: Any) -> Iterator[Any]:
    with gpuvirt.attach(vf=0, socket=host.socket, token=host.token(0)) as g:
        yield g


# ---- kernels (they run in the engine, xp = cupy) ------------------------------------


def _scale(xp: Any, a: Any, factor: float) -> str:
    a *= factor
    return xp.__name__


def _total(xp: Any, a: Any) -> Any:
    return xp.sum(a), [a[:2]]


def _hang(xp: Any) -> None:
    flag = xp.zeros(1, dtype=xp.int32)
    xp.RawKernel(SPIN_FOREVER, "spin_forever")((1,), (1,), (flag,))
    # returns at once; the engine's stream synchronize after the kernel never does


def _timed_work(xp: Any, a: Any, reps: int) -> tuple[int, int]:
    t0 = time.monotonic_ns()
    for _ in range(reps):
        a[...] = (a @ a.T) / a.shape[0]
    xp.cuda.get_current_stream().synchronize()
    return t0, time.monotonic_ns()


# ---- the tests ------------------------------------------------------------------------


def test_probe_sees_the_device(gpu_info: GpuInfo) -> None:
    assert gpu_info.count >= 1 and 0 < gpu_info.free <= gpu_info.total


def test_guest_gets_a_staged_fb(gpu: Any) -> None:
    assert gpu.info.feature_flags & FEATURE_STAGING
    assert not gpu.info.feature_flags & FEATURE_FB_MAPPED
    buf = gpu.alloc(16, np.float32)
    with pytest.raises(GpuvirtError, match="mapped"):
        buf.view()


@pytest.mark.parametrize("n", [1, 1000, (2 << 20) // 4 + 1, (5 << 20) // 4 + 3])
def test_write_then_read_returns_the_data(gpu: Any, n: int) -> None:
    data = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    buf = gpu.alloc(n, np.float32)
    buf.write(data)
    assert np.array_equal(buf.read(), data)


def test_kernel_gets_cupy_and_works_on_the_fb(gpu: Any) -> None:
    data = np.arange(1 << 20, dtype=np.float32)
    buf = gpu.alloc(data.shape, np.float32)
    buf.write(data)
    assert gpu.launch(_scale, buf, factor=2.0).result(timeout=60) == "cupy"
    assert np.array_equal(buf.read(), data * 2)


def test_device_arrays_in_a_result_come_back_as_numpy(gpu: Any) -> None:
    buf = gpu.alloc(100, np.int64)
    buf.write(np.arange(100))
    total, (head,) = gpu.launch(_total, buf).result(timeout=60)
    assert isinstance(total, np.ndarray) and int(total) == 4950
    assert isinstance(head, np.ndarray) and head.tolist() == [0, 1]


def test_a_new_guest_finds_the_fb_zeroed(host: Any) -> None:
    with gpuvirt.attach(vf=1, socket=host.socket, token=host.token(1)) as g:
        buf = g.alloc(1 << 20, np.uint8)
        assert buf.offset == RESERVED_SIZE
        buf.write(np.full(1 << 20, 0xAB, np.uint8))
    with gpuvirt.attach(vf=1, socket=host.socket, token=host.token(1)) as g:
        buf = g.alloc(1 << 20, np.uint8)
        assert buf.offset == RESERVED_SIZE
        assert not buf.read().any()


def test_two_vfs_kernels_never_overlap(host: Any) -> None:
    spans: dict[int, list[tuple[int, int]]] = {0: [], 1: []}

    def tenant(vf: int) -> None:
        with gpuvirt.attach(vf=vf, socket=host.socket, token=host.token(vf)) as g:
            a = g.alloc((1024, 1024), np.float32)
            a.write(np.eye(1024, dtype=np.float32))
            for _ in range(40):
                spans[vf].append(g.launch(_timed_work, a, reps=20).result(timeout=60))

    threads = [threading.Thread(target=tenant, args=(vf,)) for vf in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert len(spans[0]) == len(spans[1]) == 40
    for a0, a1 in spans[0]:
        for b0, b1 in spans[1]:
            assert a1 <= b0 or b1 <= a0, "kernels of two VFs ran at the same time"


def test_hung_cuda_kernel_resets_only_its_vf(gpu_info: GpuInfo) -> None:
    with scratch_host(**CUDA_HOST) as hp:
        stop = threading.Event()
        neighbour: dict[str, Any] = {"done": 0, "errors": []}

        def busy() -> None:
            with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)) as g:
                a = g.alloc((256, 256), np.float32)
                a.write(np.eye(256, dtype=np.float32))
                while not stop.is_set():
                    try:
                        g.launch(_timed_work, a, reps=5).result(timeout=60)
                        neighbour["done"] += 1
                    except GpuvirtError as e:
                        neighbour["errors"].append(repr(e))

        t = threading.Thread(target=busy)
        t.start()
        try:
            with gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as g:
                buf = g.alloc(1 << 20, np.uint8)
                buf.write(np.full(1 << 20, 7, np.uint8))
                t0 = time.monotonic()
                fut = g.launch(_hang)
                with pytest.raises(VFResetError):
                    fut.result(timeout=60)
                detected = time.monotonic() - t0
                g.wait_ready(60)
                before = neighbour["done"]
                fresh = g.alloc(1 << 20, np.uint8)
                assert fresh.offset == buf.offset
                assert not fresh.read().any(), "FB not scrubbed after the FLR"
                vf0 = next(v for v in hp.status()["vfs"] if v["index"] == 0)
                assert vf0["flr_count"] >= 1
            wait_until(lambda: neighbour["done"] > before, 30, "the neighbour completing kernels")
        finally:
            stop.set()
            t.join(120)
        assert not neighbour["errors"], neighbour["errors"]
        # cmd_timeout (or job_timeout), then kill and a fresh engine: seconds, not minutes.
        assert detected < 30


def test_killed_engine_is_reset_and_the_vf_comes_back(gpu_info: GpuInfo) -> None:
    with (
        scratch_host(**CUDA_HOST) as hp,
        gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as g,
    ):
        buf = g.alloc(10, np.float32)
        buf.write(np.ones(10, np.float32))
        pid = next(v for v in hp.status()["vfs"] if v["index"] == 0)["engine_pid"]
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: g.resets, 60, "the guest hearing of the reset", every=0.05)
        g.wait_ready(60)
        fresh = g.alloc(10, np.float32)
        fresh.write(np.arange(10, dtype=np.float32))
        g.launch(_scale, fresh, factor=3.0).result(timeout=60)
        assert np.array_equal(fresh.read(), np.arange(10, dtype=np.float32) * 3)


def test_fb_total_beyond_the_device_is_refused(gpu_info: GpuInfo) -> None:
    too_big = f"{gpu_info.total * 2}"
    cfg = {**CUDA_HOST, "device": {"backend": "cuda", "fb_total": too_big, "pf_fb": "64MiB"}}
    with pytest.raises(GpuvirtError, match="free"), scratch_host(**cfg):
        pass


# ---- #16: the context budget, namedtuple results, a kernel on its own stream, NetGPU ----


def _stats(xp: Any, a: Any) -> DefragResult:
    # A namedtuple both sides import (pickle sends its class by reference): any such
    # result must come back with its type and its device arrays as numpy arrays.
    return DefragResult(xp.sum(a), a[:2])


def _spin_on_own_stream(xp: Any, flag: Any) -> None:
    # A stream of the tenant's own: the engine's device synchronize must wait for it too.
    with xp.cuda.Stream(non_blocking=True):
        xp.RawKernel(SPIN_FOREVER, "spin_forever")((1,), (1,), (flag,))


def test_probe_measures_one_engine_context(gpu_info: GpuInfo) -> None:
    assert 0 < gpu_info.context < gpu_info.total // 4


def test_namedtuple_results_come_back_as_numpy(gpu: Any) -> None:
    a = gpu.alloc(8, np.float32)
    a.write(np.arange(8, dtype=np.float32))
    out = gpu.launch(_stats, a).result(timeout=60)
    assert type(out) is DefragResult and isinstance(out.fragment, np.ndarray)
    assert float(out.url) == 28.0 and out.fragment.tolist() == [0.0, 1.0]


def test_a_kernel_spinning_on_its_own_stream_is_a_hang(gpu_info: GpuInfo) -> None:
    with (
        scratch_host(**CUDA_HOST) as hp,
        gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as g,
    ):
        flag = g.alloc(1, np.int32)
        fut = g.launch(_spin_on_own_stream, flag)
        with pytest.raises(VFResetError):
            fut.result(timeout=120)
        # The guest hears of the reset at the FLR's notify step; flr_count is counted after
        # the kill and the scrub, so it is read once the host says the FLR is done.
        done = wait_event(hp, lambda e: e["kind"] == "flr.done" and e["vf"] == 0, 60)
        assert done["data"]["reason"] in ("job_timeout", "idle_failed")
        assert hp.admin.vf(0)["flr_count"] >= 1


def _poke_bad_pointer(xp: Any) -> None:
    # A write through a pointer to nothing: cudaErrorIllegalAddress, a sticky error
    # that leaves this context unusable; the engine says so and exits.
    src = 'extern "C" __global__ void poke(unsigned long long p) { *(volatile int *)p = 1; }'
    xp.RawKernel(src, "poke")((1,), (1,), (xp.uint64(16),))


def test_an_illegal_address_resets_only_its_vf(gpu_info: GpuInfo) -> None:
    with (
        scratch_host(**CUDA_HOST) as hp,
        gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)) as n,
    ):
        a = n.alloc(1 << 10, np.float32)
        a.write(np.ones(1 << 10, np.float32))
        with gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as g:
            with pytest.raises(KernelError, match="context is lost"):
                g.launch(_poke_bad_pointer).result(timeout=60)
            done = wait_event(hp, lambda e: e["kind"] == "flr.done" and e["vf"] == 0, 60)
            assert done["data"]["reason"] == "engine_died"
            g.wait_ready(60)
            b = g.alloc(16, np.float32)
            b.write(np.arange(16, dtype=np.float32))
            g.launch(_scale, b, factor=2.0).result(timeout=60)
            assert np.array_equal(b.read(), np.arange(16, dtype=np.float32) * 2)
        # the neighbour's context, FB and data never noticed
        n.launch(_scale, a, factor=3.0).result(timeout=60)
        assert np.array_equal(a.read(), np.full(1 << 10, 3, np.float32))
        assert n.resets == 0 and hp.admin.vf(1)["flr_count"] == 0
