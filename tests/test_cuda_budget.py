"""The cuda backend's arithmetic and structure, checked without a GPU or CuPy.

- the device-memory budget (device/budget.py): contexts and scratch outside the FBs,
  so that with the default fb_total every engine's allocation fits;
- the CuPy pool limit (cuda_executor.pool_limit), the result conversion
  (cuda_executor.map_arrays) on real namedtuples of numpy arrays, the probe's
  result parsing (cuda.gpu_info) and the IDLE limit selection (base.SwitchLimits);
- the spare engine (device/spare.py) on the cooperative path, for real over an emu FB.
"""

from __future__ import annotations

import collections
import os
import sys
import typing
from typing import Any

import cloudpickle
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuvirt.config import (
    DEFAULT_COOP_IDLE_TIMEOUT_MS,
    DEFAULT_KERNEL_SCRATCH,
    HostConfig,
    config_from_dict,
)
from gpuvirt.device.base import EngineSpec, SwitchLimits, WSCommand
from gpuvirt.device.budget import (
    CONTEXT_ALIGN,
    SPARES,
    EngineMemory,
    context_cost,
    engines_overhead,
    fb_room,
)
from gpuvirt.device.cuda import CoopEngine, gpu_info
from gpuvirt.device.cuda_executor import map_arrays, pool_limit
from gpuvirt.device.spare import ANY, SPARE, Spares
from gpuvirt.device.status import Word
from gpuvirt.errors import ConfigError, DeviceError
from gpuvirt.guest.queue import kernel
from gpuvirt.protocol.command import BufDesc
from helpers import guest_queue, wait_until

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MiB = 1 << 20
GiB = 1 << 30
FB_SIZE = 4 * MiB


# ---- the budget ---------------------------------------------------------------------


def test_context_cost_adds_the_margin_and_rounds_to_driver_pages() -> None:
    assert context_cost(10 * GiB, 10 * GiB - 400 * MiB) == 500 * MiB
    odd = context_cost(10 * GiB, 10 * GiB - 1)
    assert odd == CONTEXT_ALIGN


def test_context_cost_refuses_a_measurement_that_went_the_wrong_way() -> None:
    with pytest.raises(DeviceError, match="another process is using the GPU"):
        context_cost(10 * GiB, 10 * GiB + MiB)


def test_overhead_counts_the_spare_context() -> None:
    mem = EngineMemory(context=500 * MiB, scratch=256 * MiB)
    assert engines_overhead(mem, 4) == (4 + SPARES) * 500 * MiB + 4 * 256 * MiB
    assert fb_room(80 * GiB, mem, 4) == 80 * GiB - engines_overhead(mem, 4)


def test_overhead_beyond_the_device_names_what_to_lower() -> None:
    mem = EngineMemory(context=500 * MiB, scratch=256 * MiB)
    with pytest.raises(
        DeviceError, match=r"32 CUDA contexts.*sriov\.vf_num or device\.kernel_scratch"
    ):
        fb_room(8 * GiB, mem, 31)


def test_emu_budgets_nothing() -> None:
    assert fb_room(2 * GiB, EngineMemory(), 31) == 2 * GiB


def _cuda_config(vf_num: int, scratch: int, fb_total: int | None = None) -> HostConfig:
    device: dict[str, Any] = {"backend": "cuda", "kernel_scratch": scratch}
    if fb_total is not None:
        device["fb_total"] = fb_total
    return config_from_dict({"device": device, "sriov": {"vf_num": vf_num}})


@settings(max_examples=200, deadline=None)
@given(
    free=st.integers(1 * GiB, 200 * GiB),
    context=st.integers(1, 1 * GiB),
    scratch=st.integers(0, 2 * GiB),
    vf_num=st.integers(1, 31),
)
def test_with_default_fb_total_every_engine_fits(
    free: int, context: int, scratch: int, vf_num: int
) -> None:
    """Whatever the device and the measured context: FBs + PF reserve + every engine's
    context and scratch + the spare's context never exceed the device's free memory."""
    mem = EngineMemory(context=context_cost(free, free - context), scratch=scratch)
    cfg = _cuda_config(vf_num, scratch)
    try:
        room = fb_room(free, mem, vf_num)
        plans = cfg.vf_layout(room)
    except (DeviceError, ConfigError):
        return  # refused with a message: nothing is started that could fail later
    fbs = sum(p.fb for p in plans)
    caps = sum(pool_limit(mem.scratch) for _ in plans)
    device_use = fbs + cfg.device.pf_fb + (vf_num + SPARES) * mem.context + caps
    assert device_use <= free + vf_num  # pool_limit(0) is 1 byte per engine


def test_default_layout_on_an_h200_leaves_room_for_the_contexts() -> None:
    cfg = _cuda_config(4, DEFAULT_KERNEL_SCRATCH)
    free, mem = 139 * GiB, EngineMemory(context=600 * MiB, scratch=DEFAULT_KERNEL_SCRATCH)
    plans = cfg.vf_layout(fb_room(free, mem, 4))
    assert len({p.fb for p in plans}) == 1
    left = free - sum(p.fb for p in plans) - cfg.device.pf_fb
    assert left >= 5 * mem.context + 4 * mem.scratch


def test_explicit_fb_total_beyond_the_room_is_refused() -> None:
    cfg = _cuda_config(4, DEFAULT_KERNEL_SCRATCH, fb_total=80 * GiB)
    room = fb_room(80 * GiB, EngineMemory(context=500 * MiB, scratch=256 * MiB), 4)
    with pytest.raises(ConfigError, match=r"device\.fb_total = 80 GiB.*CUDA contexts"):
        cfg.vf_layout(room)


def test_new_keys_have_defaults_and_appear_in_the_dump() -> None:
    cfg = config_from_dict({})
    assert cfg.device.kernel_scratch == DEFAULT_KERNEL_SCRATCH
    assert cfg.scheduler.coop_idle_timeout_ms == DEFAULT_COOP_IDLE_TIMEOUT_MS
    dump = cfg.dump_toml()
    assert 'kernel_scratch = "256 MiB"' in dump
    assert f"coop_idle_timeout_ms = {DEFAULT_COOP_IDLE_TIMEOUT_MS}" in dump


def test_bad_coop_idle_timeout_is_named() -> None:
    with pytest.raises(ConfigError, match=r"scheduler\.coop_idle_timeout_ms"):
        config_from_dict({"scheduler": {"coop_idle_timeout_ms": 0}})


# ---- pool limit, result conversion, probe parsing, limit selection ---------------------


def test_pool_limit_is_the_scratch_and_zero_is_not_unlimited() -> None:
    assert pool_limit(256 * MiB) == 256 * MiB
    assert pool_limit(0) == 1  # CuPy reads 0 as "no limit"
    with pytest.raises(ValueError, match="must be >= 0"):
        pool_limit(-1)


Point = collections.namedtuple("Point", ["x", "y"])


class Pair(typing.NamedTuple):
    first: Any
    second: Any


def test_map_arrays_keeps_namedtuples_lists_and_dicts() -> None:
    a, b = np.arange(4), np.ones(3)
    value = {"p": Point(a, b), "pair": Pair([a, 1], (b, "s")), "n": 5}
    out = map_arrays(value, lambda v: isinstance(v, np.ndarray), lambda v: v.tolist())
    assert type(out["p"]) is Point and out["p"] == Point([0, 1, 2, 3], [1.0, 1.0, 1.0])
    assert type(out["pair"]) is Pair
    assert out["pair"] == Pair([[0, 1, 2, 3], 1], ([1.0, 1.0, 1.0], "s"))
    assert type(out["pair"].second) is tuple
    assert out["n"] == 5


PROBED = {
    "cupy": "14.0.0", "count": 1, "free": 140 * GiB, "total": 141 * GiB, "name": "NVIDIA H200",
    "driver": 12080, "runtime": 12080, "free_with_engine": 140 * GiB - 400 * MiB,
}  # fmt: skip


def test_probe_result_gives_the_budgeted_context() -> None:
    info = gpu_info(dict(PROBED))
    assert info.context == 500 * MiB and info.free == 140 * GiB


@pytest.mark.parametrize(
    ("stage", "says"),
    [("import", "does not import"), ("device", "no usable NVIDIA GPU"),
     ("context", "measuring one engine's CUDA context on NVIDIA H200 failed")],
)  # fmt: skip
def test_probe_failure_names_its_stage(stage: str, says: str) -> None:
    with pytest.raises(DeviceError, match=says):
        gpu_info({**PROBED, "stage": stage, "error": "RuntimeError: boom"})


def test_idle_limit_applies_to_idle_of_cooperative_engines_only() -> None:
    limits = SwitchLimits(cmd_s=0.5, coop_idle_s=2.0)
    assert limits.of(WSCommand.IDLE_GPU, cooperative=True) == 2.0
    assert limits.of(WSCommand.RUN_GPU, cooperative=True) == 0.5
    assert limits.of(WSCommand.IDLE_GPU, cooperative=False) == 0.5


def test_probe_engine_snippet_opens_the_context_the_engines_open() -> None:
    """The probe measures a context opened by cuda_executor.CudaContext, as engines do;
    without CuPy that import is where it stops, with a clear ModuleNotFoundError."""
    from gpuvirt.device.cuda import _PROBE_ENGINE
    from gpuvirt.device.cuda_executor import CudaContext

    assert "CudaContext.open()" in _PROBE_ENGINE
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ModuleNotFoundError, match="cupy"):
            CudaContext.open()


# ---- the spare, on the cooperative path -----------------------------------------------


def _fill(xp: Any, a: Any, value: float) -> float:
    a[...] = value
    return float(a.sum())


def test_cooperative_spare_adopts_a_vf_and_runs_its_kernels() -> None:
    fb = os.memfd_create("test-spare-fb", os.MFD_CLOEXEC)
    os.ftruncate(fb, FB_SIZE)
    spare: Spares[CoopEngine] = Spares(lambda identity: CoopEngine(SPARE, None, "emu"))
    spare.refill(ANY, EngineSpec(3, FB_SIZE))
    engine = spare.take(ANY, EngineSpec(3, FB_SIZE), fb, fault=False)
    assert engine is not None and engine.spec.vf == 3
    queue = guest_queue(engine)
    try:
        engine.command(WSCommand.INIT_GPU, 30)
        assert engine.status[Word.READY] == 1
        engine.command(WSCommand.RUN_GPU, 30)
        desc = BufDesc(1 << 20, (16,), "<f4")
        total = queue.launch(kernel(_fill), (desc, 2.0), {})
        assert total.result(timeout=30) == 32.0
        view = np.frombuffer(os.pread(fb, 64, 1 << 20), dtype=np.float32)
        assert (view == 2.0).all()  # it ran on the adopted FB
    finally:
        queue.close()
        engine.kill()
        spare.close()
        os.close(fb)


def test_a_spare_says_when_it_is_done_starting() -> None:
    spare: Spares[CoopEngine] = Spares(lambda identity: CoopEngine(SPARE, None, "emu"))
    try:
        spare.refill(ANY, EngineSpec(0, FB_SIZE))
        assert spare.counts()["kept"] == 1
        # its own status word, written once its imports are done and it waits for a VF
        wait_until(lambda: spare.counts() == {"kept": 1, "ready": 1}, what="the spare ready")
    finally:
        spare.close()
    assert spare.counts() == {"kept": 0, "ready": 0}


def test_spare_is_not_given_when_a_fault_wants_a_fresh_start_or_it_died() -> None:
    fb = os.memfd_create("test-spare-fb", os.MFD_CLOEXEC)
    os.ftruncate(fb, FB_SIZE)
    started: list[CoopEngine] = []

    def start(identity: EngineSpec) -> CoopEngine:
        started.append(CoopEngine(SPARE, None, "emu"))
        return started[-1]

    spare: Spares[CoopEngine] = Spares(start)
    vf0 = EngineSpec(0, FB_SIZE)
    try:
        spare.refill(0, vf0)
        assert spare.take(1, EngineSpec(1, FB_SIZE), fb, fault=False) is None  # VF0's only
        assert spare.take(0, vf0, fb, fault=True) is None
        assert not started[0].alive()  # reaped, not left behind
        spare.refill(0, vf0)
        started[1].kill()
        assert spare.take(0, vf0, fb, fault=False) is None
        assert spare.take(0, vf0, fb, fault=False) is None  # none left
    finally:
        spare.close()
        os.close(fb)


# ---- shown in `vf list` -----------------------------------------------------------------


def test_vf_list_shows_what_each_engine_takes_outside_its_fb() -> None:
    from rich.console import Console

    from gpuvirt.bench.common import scratch_host
    from gpuvirt.cli.vf import vf_table

    with scratch_host(sriov={"vf_num": 1}) as hp:
        row = hp.admin.vf(0)
    assert (row["context_bytes"], row["scratch_bytes"]) == (0, 0)  # emu: no CUDA context

    def render(v: dict[str, Any]) -> str:
        console = Console(width=200, record=True)
        console.print(vf_table([v]))
        return console.export_text()

    assert "ctx" in render(row)
    cuda_row = {**row, "context_bytes": 500 * MiB, "scratch_bytes": DEFAULT_KERNEL_SCRATCH}
    assert "500 MiB" in render(cuda_row)
