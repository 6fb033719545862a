"""The device-bound workload: kernels that wait on the device, not spin on the CPU.

A GPU kernel, as the engine sees it, is wall time without CPU: the engine
launches it and waits. Shares must hold for such kernels as for the CPU-bound
`spin_log` (DESIGN.md, "World switch"), so the benches run both.

- **emu**: `wait_log` sleeps in steps of STEP_NS (no CPU) and logs its progress
  after each: (CLOCK_MONOTONIC ns, own device ns so far). A step counts the wall
  time it took, its wake-up late included: a waiting kernel holds the device for
  all of it, as a GPU kernel does, and what the host's timer adds is not time the
  scheduler lost. (Counting nominal steps instead, as until 2026-12-07, left the
  VM's 20-50 us of wake-up per 0.1 ms step out of every figure, more of it with 8
  VFs than with one; docs/benchmarks-log.md.) A stopped engine's sleep runs out
  meanwhile, so a step that took over EMU_GAP_NS was cut by a stop and counts
  nothing: per slice, the part of one step before the stop and the wake-up after
  it go uncounted, alike for every VF. A stop shorter than EMU_GAP_NS would count
  (only beside a neighbour whose slice ends under 1 ms: a 1 ms slice cut by the
  overrun rule, or one that ran dry; the benches' VFs are busy, their slices 6 ms).
- **cuda**: a one-thread RawKernel spins on `%globaltimer` until it has run
  `seconds` of its *own* time, writing (timer, own ns) checkpoints into device
  memory every STEP_NS: progress comes from the device, never a CPU loop. A jump of
  the timer over GAP_NS between two reads is time the kernel did not run (the
  driver's time-slicing switched its context out) and is not counted, as a
  stopped engine's time is not. The device's timer is turned into CLOCK_MONOTONIC
  by an offset measured around a kernel that reads it (refreshed every
  CALIBRATE_S), so logs line up with the scheduler's snapshots.

Work is the kernels' own device ns on both: every VF's ns is the same device
time, so shares of work are shares of the device. `native_guest` runs the same CUDA
kernel from a plain process (no gpuvirt), for the driver's time-slicing baseline.
"""

from __future__ import annotations

import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

STEP_NS = 100_000  # one step of progress: emu's sleep, cuda's checkpoint interval
GAP_NS = 10_000  # a timer jump longer than this between two reads: the kernel was off
EMU_GAP_NS = 1_000_000  # emu: a step this long was cut by a stop (a slice is 1 ms or more)
CALIBRATE_S = 1.0  # how often the device timer's offset to CLOCK_MONOTONIC is re-measured
CALIBRATE_TRIES = 5  # the tightest bracket of these gives the offset

WAIT_SRC = r"""
extern "C" __global__ void wait_log(unsigned long long budget, unsigned long long every,
                                    unsigned long long gap, unsigned long long *log, int cap) {
    unsigned long long t, d, last, own = 0, next = every;
    int n = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(last));
    log[0] = last; log[1] = 0; n = 1;
    while (own < budget) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        d = t - last;
        last = t;
        if (d < gap) own += d;  /* longer: switched out, not this kernel's time */
        if (own >= next && n < cap - 1) { log[2 * n] = t; log[2 * n + 1] = own; n++; next += every; }
    }
    log[2 * n] = last; log[2 * n + 1] = own; n++;
    log[2 * cap] = n;
}
extern "C" __global__ void read_timer(unsigned long long *out) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    out[0] = t;
}
"""

# Per process (an engine or a native worker): the compiled kernels and the timer offset.
_gpu: dict[str, Any] = {}


def wait_log(xp: Any, seconds: float) -> list[tuple[int, int]]:
    """A kernel that waits on the device for `seconds` of its own device time; returns
    its progress: (CLOCK_MONOTONIC ns, own device ns so far), as spin_log's log."""
    if xp.__name__ == "cupy":
        return collect(xp, launch(xp, seconds))
    budget = max(1, round(seconds * 1e9))
    last = time.monotonic_ns()
    log, own = [(last, 0)], 0
    while own < budget:
        time.sleep(min(STEP_NS, budget - own) / 1e9)
        now = time.monotonic_ns()
        if now - last < EMU_GAP_NS:  # longer: the engine was stopped meanwhile
            own += now - last
        last = now
        log.append((now, own))
    return log


def launch(xp: Any, seconds: float, stream: Any = None) -> tuple[Any, Any, Any]:
    """Queue one cuda wait kernel and the copy of its log to pinned host memory on
    `stream` (the current one if None); collect() reads it once done."""
    kern = _kernels(xp)
    budget = max(1, round(seconds * 1e9))
    cap = budget // STEP_NS + 3
    log = xp.zeros(2 * cap + 1, dtype=xp.uint64)
    stream = xp.cuda.get_current_stream() if stream is None else stream
    with stream:
        kern["wait_log"]((1,), (1,), (xp.uint64(budget), xp.uint64(STEP_NS),
                                      xp.uint64(GAP_NS), log, xp.int32(cap)))  # fmt: skip
    host = _pinned(xp, log.size)
    rt = xp.cuda.runtime
    rt.memcpyAsync(host.ctypes.data, log.data.ptr, log.nbytes, rt.memcpyDeviceToHost, stream.ptr)
    done = xp.cuda.Event(disable_timing=True)
    done.record(stream)
    return log, host, done


def collect(xp: Any, launched: tuple[Any, Any, Any]) -> list[tuple[int, int]]:
    """A launched kernel's log, in CLOCK_MONOTONIC: waits for that kernel only."""
    _log, host, done = launched
    done.synchronize()
    n = int(host[-1])
    off = _offset(xp)
    return [(int(host[2 * i]) + off, int(host[2 * i + 1])) for i in range(n)]


def _kernels(xp: Any) -> dict[str, Any]:
    if "wait_log" not in _gpu:
        mod = xp.RawModule(code=WAIT_SRC)
        _gpu["wait_log"] = mod.get_function("wait_log")
        _gpu["read_timer"] = mod.get_function("read_timer")
    return _gpu


def _pinned(xp: Any, n: int) -> Any:
    import cupyx

    return cupyx.empty_pinned((n,), dtype="uint64")


def _offset(xp: Any) -> int:
    """CLOCK_MONOTONIC minus %globaltimer, ns: from the tightest of a few CPU brackets
    around a kernel that reads the timer, re-measured every CALIBRATE_S."""
    now = time.monotonic()
    if now - _gpu.get("calibrated_at", -CALIBRATE_S) < CALIBRATE_S:
        return int(_gpu["offset"])
    out = xp.zeros(1, dtype=xp.uint64)
    best: tuple[int, int] | None = None
    for _ in range(CALIBRATE_TRIES):
        t0 = time.monotonic_ns()
        _kernels(xp)["read_timer"]((1,), (1,), (out,))
        timer = int(out.get()[0])
        t1 = time.monotonic_ns()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, (t0 + t1) // 2 - timer)
    assert best is not None
    _gpu["offset"], _gpu["calibrated_at"] = best[1], now
    return best[1]


def native_guest(conn: Connection, index: int, kernel_s: float, in_flight: int) -> None:
    """The native baseline: the same cuda wait kernels from a plain process, no gpuvirt,
    `in_flight` queued at a time on one stream, until the parent sends anything; then
    its progress log (as busy_guest's) goes back."""
    import cupy

    cupy.cuda.Device(0).use()
    stream = cupy.cuda.Stream(non_blocking=True)
    collect(cupy, launch(cupy, 0.0001, stream))  # compile, load, calibrate: not measured
    conn.send("ready")
    progress: list[tuple[int, int]] = []
    work = 0
    queued: deque[Any] = deque()
    while True:
        if not conn.poll():
            while len(queued) < in_flight:
                queued.append(launch(cupy, kernel_s, stream))
        if not queued:
            break
        log = collect(cupy, queued.popleft())
        progress += [(t, work + n) for t, n in log]
        work += log[-1][1]
    conn.recv()
    conn.send({"index": index, "work": work, "progress": progress})
