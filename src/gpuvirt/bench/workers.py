"""Guest processes for benchmarks and tests: real tenants doing real work.

Each worker is a top-level function run in its own process (spawn), attaches
to one VF and reports through a multiprocessing Connection that only it and
its parent share (never the host: the host shares nothing with guests but the
mailbox).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import multiprocessing as mp
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any


def spin(xp: Any, seconds: float) -> int:
    """A kernel that keeps the device busy for `seconds` of wall time; returns its work done."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return n


# Fine enough that the work of a slice cut short by a stop is logged within 0.1 ms of
# the stop, not at the next resume: FLR spans are a few ms.
CHECKPOINT_NS = 100_000


def spin_log(xp: Any, seconds: float, checkpoint_ns: int = CHECKPOINT_NS) -> list[tuple[int, int]]:
    """A busy kernel that ends once it has had `seconds` of the device (its own thread's
    CPU time), returning its progress: (CLOCK_MONOTONIC ns, iterations so far), about
    every `checkpoint_ns` of wall time and at the end.

    A kernel is an amount of work, not of wall time: one timed by the wall clock ends
    within nearly every slice of a VF that shares the device, and each end (result back,
    next launch in, the VF yielding meanwhile) would count against sharing what is the
    workload's own cost. While its engine is stopped the kernel writes nothing, so the
    log is a step function of the work the VF really got done: shares and lost time are
    read from it, not from the scheduler's accounting of who was on the device.
    """
    budget = time.thread_time_ns() + int(seconds * 1e9)
    log: list[tuple[int, int]] = []
    n = 0
    nxt = 0
    while True:
        now = time.monotonic_ns()
        if now >= nxt:
            log.append((now, n))
            nxt = now + checkpoint_ns
            if time.thread_time_ns() >= budget:
                return log
        n += 1


def work_between(progress: list[tuple[int, int]], t0: int, t1: int) -> int:
    """Iterations done in [t0, t1] by a worker's cumulative progress log (see spin_log)."""

    def at(t: int) -> int:
        i = bisect.bisect_right(progress, (t, float("inf"))) - 1
        return progress[i][1] if i >= 0 else 0

    return at(t1) - at(t0)


# Checkpoints closer than this ran through: no stop (nor anything long) fell between them.
THROUGH_NS = CHECKPOINT_NS * 3 // 2


def running_rate(progress: list[tuple[int, int]], t0: int, t1: int) -> float | None:
    """Iterations per ns while the kernels ran through, inside [t0, t1]: over the pairs of
    consecutive checkpoints with no stop between them. None if there is no such pair."""
    lo = bisect.bisect_left(progress, (t0, -1))
    hi = bisect.bisect_right(progress, (t1, float("inf")))
    work = ns = 0
    for (ta, na), (tb, nb) in itertools.pairwise(progress[lo:hi]):
        if tb - ta <= THROUGH_NS and nb > na:
            work += nb - na
            ns += tb - ta
    return work / ns if ns else None


def device_ns(progress: list[tuple[int, int]], t0: int, t1: int, rate: float) -> float:
    """The device time a VF's kernels had in [t0, t1], by their own log: the work they did
    there at `rate`, theirs while running through at about that time (running_rate). A
    machine that runs slower for a while is then not taken for device time lost, and a
    kernel's stop falling between two checkpoints counts only the part it ran."""
    return work_between(progress, t0, t1) / rate if rate else 0.0


def switch_gaps(logs: dict[int, list[tuple[int, int]]], t0: int, t1: int) -> list[float]:
    """The world switches inside [t0, t1] as the kernels saw them, in ns: from the last
    instruction one VF ran before it was stopped to the first the next VF ran after.

    Each log is cut into the stretches it ran through (no checkpoint gap over
    THROUGH_NS). A stretch starts at its first checkpoint (the first iteration after a
    resume logs at once) and ends where its work, at the VF's running rate, ran out
    before the gap; consecutive stretches of two different VFs, in time order, are a
    switch. Gaps inside one VF's log (between two of its kernels) are not.
    """
    stretches: list[tuple[float, float, int]] = []
    for vf, p in logs.items():
        rate = running_rate(p, t0, t1)
        if not rate:
            continue
        start = p[0][0]
        for (ta, na), (tb, nb) in itertools.pairwise(p):
            if tb - ta > THROUGH_NS:
                stretches.append((start, ta + (nb - na) / rate, vf))
                start = tb
        stretches.append((start, p[-1][0], vf))  # the log's last checkpoint is its end
    stretches.sort()
    return [
        b_start - a_end
        for (_, a_end, a_vf), (b_start, _, b_vf) in itertools.pairwise(stretches)
        if a_vf != b_vf and t0 <= a_end and b_start <= t1
    ]


SPIN_FOREVER = r"""
extern "C" __global__ void spin_forever(volatile int *flag) { while (*flag == 0) { } }
"""  # volatile: without it the compiler may drop the loop


def hang(xp: Any) -> None:
    """A kernel that never ends: a Python loop on emu, a CUDA kernel on cuda."""
    if xp.__name__ == "cupy":
        flag = xp.zeros(1, dtype=xp.int32)
        xp.RawKernel(SPIN_FOREVER, "spin_forever")((1,), (1,), (flag,))
        xp.cuda.get_current_stream().synchronize()
    while True:
        pass


@dataclass
class WorkerReport:
    vf: int
    work: int  # work its kernels completed: spin_log's iterations, wait_log's device ns
    # (CLOCK_MONOTONIC ns, cumulative iterations): the kernels' own record of their work
    progress: list[tuple[int, int]]
    launches: int
    resets: int
    errors: list[str]


def busy_guest(
    conn: Connection, socket: str, vf: int, token: str, kernel_s: float, workload: str = "spin"
) -> None:
    """Launch kernels until the parent sends anything, two in flight: as a real tenant
    queues its next kernel before the last one ends, so a kernel's end never leaves the VF
    without work (a work-conserving policy would switch it out at once). `workload`:
    "spin" (spin_log, CPU-bound) or "wait" (bench/wait.py's wait_log, device-bound)."""
    import gpuvirt
    from gpuvirt.bench.wait import wait_log

    errors: list[str] = []
    work = launches = 0
    progress: list[tuple[int, int]] = []
    with gpuvirt.attach(vf=vf, socket=socket, token=token) as gpu:
        k = gpuvirt.kernel(wait_log if workload == "wait" else spin_log)
        gpu.launch(k, 0.0).result(timeout=30)
        conn.send("ready")
        inflight: deque[Any] = deque()
        while True:
            try:
                if not conn.poll():  # once asked to stop, only the queued ones finish
                    while len(inflight) < IN_FLIGHT:
                        inflight.append(gpu.launch(k, kernel_s))
                if not inflight:
                    break
                log = inflight.popleft().result(timeout=60)
            except gpuvirt.GpuvirtError as e:  # a reset: what was queued fails too
                errors.append(f"{type(e).__name__}: {e}")
                gpu.wait_ready(30)
                continue
            progress += [(t, work + n) for t, n in log]
            work += log[-1][1]
            launches += 1
        conn.recv()
        conn.send(WorkerReport(vf, work, progress, launches, gpu.resets, errors))


IN_FLIGHT = 2


def hang_guest(conn: Connection, socket: str, vf: int, token: str) -> None:
    """Launch a kernel that never ends; report the reset and the re-initialization."""
    import gpuvirt

    done: dict[str, Any] = {}
    gpu = gpuvirt.attach(
        vf=vf, socket=socket, token=token,
        on_reset=lambda g: done.setdefault("reinit_at", time.monotonic()),
    )  # fmt: skip
    k = gpuvirt.kernel(spin)
    gpu.launch(k, 0.0).result(timeout=30)
    conn.send("ready")
    conn.recv()
    fut = gpu.launch(hang)
    t0 = time.monotonic()
    try:
        fut.result(timeout=120)
        outcome = "completed?!"
    except gpuvirt.VFResetError as e:
        outcome = f"VFResetError: {e}"
    except gpuvirt.GpuvirtError as e:
        # The engine's end reached the channel before the FLR notice reached the mailbox
        # thread (the host waits ready_to_reset_wait, then goes on): reported, not hidden.
        outcome = f"{type(e).__name__}: {e}"
    t_err = time.monotonic()
    gpu.wait_ready(30)
    after = gpu.launch(k, 0.01).result(timeout=30)
    conn.send({
        "outcome": outcome, "error_after_s": t_err - t0,
        "reinit_after_s": done.get("reinit_at", time.monotonic()) - t0,
        "works_after_reset": after > 0, "resets": gpu.resets,
    })  # fmt: skip
    gpu.close()


class Workers:
    """Start worker processes, wait until all are ready, stop them and collect reports."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list[tuple[Any, Connection]] = []

    def start(self, target: Any, *args: Any) -> Connection:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=target, args=(child, *args), daemon=True)
        p.start()
        child.close()
        self.procs.append((p, parent))
        return parent

    def wait_ready(self, timeout: float = 60) -> None:
        for p, conn in self.procs:
            if not conn.poll(timeout):
                raise TimeoutError(f"worker pid {p.pid} not ready within {timeout} s")
            assert conn.recv() == "ready"

    def stop(self, timeout: float = 60) -> list[Any]:
        """Ask each worker to stop; its report, or None for one that already finished."""
        out = []
        for _, conn in self.procs:
            with contextlib.suppress(BrokenPipeError, ConnectionError):
                conn.send("stop")
        for p, conn in self.procs:
            try:
                out.append(conn.recv() if conn.poll(timeout) else None)
            except (EOFError, ConnectionError):
                out.append(None)
            p.join(timeout)
        return out

    def kill(self) -> None:
        for p, _ in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
