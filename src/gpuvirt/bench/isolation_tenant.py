"""One tenant of `bench isolation`: verified GPU work, and the fault it is told to commit.

Run as `python -m gpuvirt.bench.isolation_tenant PARAMS_JSON`, one process per
tenant. `mode` "native" is a plain CUDA process (CuPy in this process: under MPS
or the driver's time-slicing); "gpuvirt" is a guest of a VF, its kernels run by
the VF's engine. The kernels are the same functions in both: a step is REPS
float64 products of an integer-valued matrix, checked by the exact sum of the
result (integers below 2**53 add up exactly in any order).

Reports JSON lines on stdout ("ready", "ok", "bad", "error", "reset", "fault",
"dead", "done"), each with its monotonic time; takes orders on stdin ("fault",
"restart", "stop"; EOF stops it too).
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from typing import Any

N = 1024
REPS = 20  # ~1 ms of an H200 per step: the work a neighbour keeps the device busy with
DEAD_AFTER = 5  # errors in a row with no step done between: its context is gone
GRAB_CHUNKS = (1 << 30, 64 << 20)  # cudaMalloc sizes, the larger until refused first
SPIN = 'extern "C" __global__ void spin(volatile int *f) { while (*f == 0) { } }'
POKE = 'extern "C" __global__ void poke(unsigned long long p) { *(volatile int *)p = 1; }'


def step(xp: Any, a: Any, c: Any, reps: int) -> float:
    for _ in range(reps):
        xp.matmul(a, a, out=c)
    return float(c.sum())


def spin(xp: Any, go: bool = True) -> None:
    """A kernel on every SM that never ends (the device as a hostile tenant would hold it)."""
    k = xp.RawKernel(SPIN, "spin")
    if not go:
        k.compile()
        return
    sms = xp.cuda.Device().attributes["MultiProcessorCount"]
    flag = xp.zeros(1, dtype=xp.int32)
    k((sms * 4,), (128,), (flag,))
    xp.cuda.runtime.deviceSynchronize()


def poke(xp: Any, go: bool = True) -> None:
    """A write through a pointer to nothing: the device's MMU faults (illegal address)."""
    k = xp.RawKernel(POKE, "poke")
    if not go:
        k.compile()
        return
    k((1,), (1,), (xp.uint64(16),))
    xp.cuda.runtime.deviceSynchronize()


def grab(xp: Any, go: bool = True) -> dict[str, int]:
    """All the device memory this tenant can reach: through CuPy's pool (what gpuvirt
    caps per engine) and by cudaMalloc itself (what only MPS's or MIG's limits cap).
    Nothing is freed: it is held until the process (or the VF's engine) ends."""
    got = {"pool_bytes": 0, "malloc_bytes": 0}
    if not go:
        return got
    held = []
    for size in GRAB_CHUNKS:
        while True:
            try:
                held.append(xp.empty(size, dtype=xp.uint8))
            except Exception:  # OutOfMemoryError: the pool's limit, or the device's
                break
            got["pool_bytes"] += size
    for size in GRAB_CHUNKS:
        while True:
            try:
                xp.cuda.runtime.malloc(size)  # never freed: held as long as the context
            except Exception:
                break
            got["malloc_bytes"] += size
    grab.held = held  # type: ignore[attr-defined]  # kept alive with the process
    return got


FAULTS = {"spin": spin, "illegal_address": poke, "grab_memory": grab}


class _Out:
    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, ev: str, **data: Any) -> None:
        line = json.dumps({"ev": ev, "t": time.monotonic(), **data}, default=str)
        with self._lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()


class Native:
    """The tenant's own CUDA context (CuPy in this process)."""

    def __init__(self, a: Any) -> None:
        import cupy

        self.xp = cupy
        self.a = cupy.asarray(a)
        self.c = cupy.empty_like(self.a)

    def step(self) -> float:
        return step(self.xp, self.a, self.c, REPS)

    def fault(self, kind: str, go: bool = True) -> Any:
        return FAULTS[kind](self.xp, go)


class Guest:
    """A VF of a gpuvirt host: buffers in its FB, kernels run by its engine."""

    def __init__(self, a: Any, p: dict[str, Any]) -> None:
        import gpuvirt

        self.reset_seen = threading.Event()
        self.gpu = gpuvirt.attach(
            vf=p["vf"], socket=p["socket"], token=p["token"],
            on_reset=lambda g: self.reset_seen.set(),
        )  # fmt: skip
        self.host_a = a
        self.setup()

    def setup(self) -> None:
        self.a = self.gpu.alloc(self.host_a.shape, self.host_a.dtype)
        self.a.write(self.host_a)
        self.c = self.gpu.alloc(self.host_a.shape, self.host_a.dtype)

    def step(self) -> float:
        return self.gpu.launch(step, self.a, self.c, REPS).result(60)

    def fault(self, kind: str, go: bool = True) -> Any:
        return self.gpu.launch(FAULTS[kind], go).result(60)

    def recover(self, timeout: float) -> None:
        """After a reset: the host's notification, the VF back, buffers again."""
        from gpuvirt.errors import VFResetError

        if not self.reset_seen.wait(timeout):
            raise VFResetError("no reset notification came")
        self.reset_seen.clear()
        self.gpu.wait_ready(timeout)
        self.setup()


def main(arg: str) -> None:
    import numpy as np

    p = json.loads(arg)
    out = _Out()
    orders: queue.SimpleQueue[str] = queue.SimpleQueue()

    def read_orders() -> None:
        for line in sys.stdin:
            orders.put(line.strip())
        orders.put("stop")

    threading.Thread(target=read_orders, daemon=True).start()
    a = np.random.default_rng(p["seed"]).integers(0, 4, (N, N)).astype(np.float64)
    want = float((a @ a).sum())
    dev: Native | Guest = Native(a) if p["mode"] == "native" else Guest(a, p)
    if p.get("fault"):
        dev.fault(p["fault"], False)  # compiled now: a compile must not pass for the fault
    dev.step()
    out("ready", pid=os.getpid())
    errors = 0
    while True:
        try:
            order = orders.get_nowait()
        except queue.Empty:
            order = ""
        if order == "stop":
            break
        try:
            if order == "fault":
                out("fault", kind=p["fault"])
                out("fault_result", result=dev.fault(p["fault"]))
            elif order == "restart":
                out("restart")
                if isinstance(dev, Native):
                    return  # the bench starts a fresh process in its place
                dev.gpu.request_reset()
                dev.recover(60)
            got = dev.step()
            out("ok" if got == want else "bad", got=got)
            errors = 0
        except Exception as e:
            errors += 1
            out("error", error=f"{type(e).__name__}: {str(e)[-300:]}")
            if isinstance(dev, Guest) and _reset(e):
                try:
                    dev.recover(60)
                    out("reset")
                    continue
                except Exception as again:
                    out("error", error=f"{type(again).__name__}: {str(again)[-300:]}")
            if errors >= DEAD_AFTER:
                out("dead")
                sys.exit(3)
    out("done")


def _reset(e: Exception) -> bool:
    """The VF is being reset: its engine was lost (died, hung, faulted) and comes back."""
    from gpuvirt.errors import BufferLostError, DetachedError, KernelError, VFResetError

    return isinstance(e, (VFResetError, BufferLostError, DetachedError, KernelError))


if __name__ == "__main__":
    main(sys.argv[1])
