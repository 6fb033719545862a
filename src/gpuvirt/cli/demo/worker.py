"""The guest side of the demo: one process per VF, doing verified work in it.

Each guest does matrix products in its VF and checks every result on its own
side (Freivalds' check: C·r = A·(B·(A·r)) for a random r, O(n²) against the
kernel's O(n³)); one ingests a NetGPU stream and hashes it where it landed;
one, told to, launches a kernel that never returns and, once back from that
reset, one that writes through a bad pointer. It reports to the coordinator as JSON lines on stdout and takes orders ("hang", "fault",
"stop") on stdin; stdin closing (the coordinator gone) stops it too. This module is
imported in the guest process, so it stays light: no rich, no typer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json as json_mod
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuvirt.cli.demo.knobs import DEPTH, HANG_TIMEOUT_S, INCIDENTS, REFRESH_S
from gpuvirt.errors import GpuvirtError


def _kernels() -> tuple[Callable[..., Any], dict[str, Callable[..., Any]]]:
    """The work kernel and the hostile ones, each for whichever device it lands on.

    Nested, so cloudpickle ships them by value: the engine never imports this CLI
    module. `xp` says where they run: numpy on emu (the kernel is the engine's CPU),
    cupy on cuda (a real CUDA kernel on the device).
    """

    def abA(xp: Any, a: Any, b: Any, c: Any) -> None:
        xp.matmul(xp.matmul(a, b), a, out=c)

    # `go` False only compiles (cuda): done at setup, so that an NVRTC compile inside the
    # incident's own launch cannot pass for the incident.
    def hang(xp: Any, go: bool = True) -> None:
        if xp.__name__ == "numpy":
            while go:
                pass
            return
        # volatile: without it the compiler may assume the loop ends, or delete it
        src = 'extern "C" __global__ void spin(volatile int *f) { while (*f == 0) { } }'
        k = xp.RawKernel(src, "spin")
        if not go:
            k.compile()
            return
        flag = xp.zeros(1, dtype=xp.int32)
        k((1,), (1,), (flag,))  # the engine's synchronize never returns

    def fault(xp: Any, go: bool = True) -> None:
        # A write through a pointer to nothing: on cuda the device's MMU faults
        # (cudaErrorIllegalAddress) and the context is lost; on emu the engine dies of
        # SIGSEGV. Either way the host resets this VF and no other.
        if xp.__name__ == "numpy":
            import ctypes

            if go:
                ctypes.memset(16, 1, 4)
            return
        src = 'extern "C" __global__ void poke(unsigned long long p) { *(volatile int *)p = 1; }'
        k = xp.RawKernel(src, "poke")
        if not go:
            k.compile()
            return
        k((1,), (1,), (xp.uint64(16),))

    return abA, {"hang": hang, "fault": fault}


class _Out:
    """JSON lines to the coordinator; several guest threads report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, ev: str, **data: Any) -> None:
        line = json_mod.dumps({"ev": ev, "t": time.time(), **data}) + "\n"
        with self._lock:
            sys.stdout.write(line)
            sys.stdout.flush()


@dataclass
class _Work:
    verified: int = 0
    failed: int = 0
    after_reset: int = 0  # verified since the last reset
    resets_seen: int = 0
    lost_to_reset: int = 0
    unexpected_resets: int = 0
    flop: float = 0.0
    # per incident ("hang", "fault"): when it was submitted, seen, reset, recovered from
    incidents: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def guest_main(arg: str) -> None:
    import numpy as np

    import gpuvirt

    p = json_mod.loads(arg)
    out = _Out()
    # Ctrl-C in the terminal reaches the whole process group; the coordinator
    # stops guests itself, in order, so a guest must not die mid-report.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = threading.Event()
    orders: queue.SimpleQueue[str] = queue.SimpleQueue()

    def read_orders() -> None:
        for line in sys.stdin:
            if line.strip() in INCIDENTS:
                orders.put(line.strip())
            elif line.strip() == "stop":
                break
        stop.set()  # "stop", or EOF: the coordinator is gone

    threading.Thread(target=read_orders, daemon=True).start()
    resets: list[float] = []
    reset_seen = threading.Event()  # the host's FLR notification has come

    def on_reset(g: Any) -> None:
        resets.append(time.time())
        reset_seen.set()
        out("reset", resets=g.resets)

    gpu = gpuvirt.attach(vf=p["vf"], socket=p["socket"], token=p["token"], on_reset=on_reset)
    out("attached", pid=os.getpid())
    net_thread = None
    net: dict[str, Any] = {}
    if p.get("netgpu"):
        net_thread = threading.Thread(
            target=_netgpu_rx, args=(gpu, p["netgpu"], out, net), daemon=True
        )
        net_thread.start()
    work = _Work()
    try:
        _compute(
            gpu, np.random.default_rng(p["seed"]), p, stop, orders, work, out, (resets, reset_seen)
        )
    except Exception as e:  # reported, not raised: the coordinator decides what failed
        work.errors.append(f"{type(e).__name__}: {e}")
    if net_thread is not None:
        net_thread.join(HANG_TIMEOUT_S)
    out("done", work=work.__dict__, resets=gpu.resets, netgpu=net)
    # The host may be gone already (the coordinator gave up on it); this process
    # exits right after, so a fini that cannot be sent changes nothing.
    with contextlib.suppress(GpuvirtError):
        gpu.close()


def _compute(
    gpu: Any, rng: Any, p: dict[str, Any], stop: threading.Event,
    orders: queue.SimpleQueue[str], work: _Work, out: _Out,
    reset: tuple[list[float], threading.Event],
) -> None:  # fmt: skip
    import numpy as np

    from gpuvirt.errors import BufferLostError, DetachedError, KernelError, VFResetError

    resets, reset_seen = reset
    abA, hostile = _kernels()
    n = p["n"]
    a = rng.standard_normal((n, n))  # fixed per run; B is fresh every launch
    is_hostile = p["role"] == "hostile"
    incident: str | None = None  # the incident whose reset this guest waits for
    bad_fut: Any = None  # its launch, until it has failed
    recovering: str | None = None  # reset done; recovered at the next verified result
    bufs: list[tuple[Any, Any, Any]] = []
    inflight: deque[tuple[Any, int, Any]] = deque()
    free: deque[int] = deque()

    def setup() -> None:
        bufs.clear()
        for _ in range(DEPTH):
            A, B, C = (gpu.alloc((n, n), np.float64) for _ in range(3))
            A.write(a)
            bufs.append((A, B, C))
        free.clear()
        free.extend(range(DEPTH))
        if is_hostile:  # a fresh engine after every reset: compile its kernels again
            for k in hostile.values():
                gpu.launch(k, False).result(HANG_TIMEOUT_S)

    setup()
    last_report = 0.0
    while True:
        try:
            while free and not stop.is_set() and bad_fut is None:
                if is_hostile and incident is None and recovering is None and not orders.empty():
                    incident = orders.get()
                    work.incidents[incident] = {"submitted": time.time()}
                    bad_fut = gpu.launch(hostile[incident])
                    out("incident", kind=incident, info=work.incidents[incident])
                    break
                s = free.popleft()
                b = rng.random((n, n))
                bufs[s][1].write(b)
                inflight.append((gpu.launch(abA, *bufs[s]), s, b))
            if not inflight and bad_fut is not None:
                # What was queued before it has been checked; now its failure, then the reset.
                try:
                    bad_fut.result(HANG_TIMEOUT_S)
                except KernelError as e:
                    # cuda's answer to the faulting launch: the context is lost and the
                    # engine exits; the reset reaches this guest at its next operation.
                    work.incidents[incident or "?"]["kernel_error"] = str(e)[-300:]
                    bad_fut = None
                    continue
                raise AssertionError(f"a {incident} kernel returned")
            if not inflight:
                return
            fut, s, b = inflight.popleft()
            fut.result(HANG_TIMEOUT_S)
            c = bufs[s][2].read()
            r = rng.standard_normal(n)
            want = a @ (b @ (a @ r))
            if np.allclose(
                c @ r, want, rtol=0, atol=1e-9 * n * max(1.0, float(np.abs(want).max()))
            ):
                work.verified += 1
                work.after_reset += 1
                work.flop += 4 * n**3
                if recovering is not None:
                    work.incidents[recovering]["recovered"] = time.time()
                    out("recovered", kind=recovering, info=work.incidents[recovering])
                    recovering = None
            else:
                work.failed += 1
            free.append(s)
        except (VFResetError, BufferLostError, DetachedError) as e:
            t_err = time.time()
            if isinstance(e, DetachedError) and incident is None:
                raise
            # An engine that died (the fault) closes its channel before the host's FLR
            # notification comes: wait for that, then for the VF to be back.
            if not reset_seen.wait(HANG_TIMEOUT_S):
                raise
            reset_seen.clear()
            work.resets_seen += 1
            work.lost_to_reset += len(inflight) + (1 if bad_fut is not None else 0)
            inflight.clear()
            bad_fut = None
            if incident is None:
                work.unexpected_resets += 1
                work.errors.append(f"reset without a hang or fault: {e}")
            gpu.wait_ready(HANG_TIMEOUT_S)
            work.after_reset = 0
            if incident is not None:
                work.incidents[incident].update(
                    error=t_err, ready=time.time(), on_reset=resets[-1] if resets else None
                )
                out("recovering", kind=incident, info=work.incidents[incident])
                recovering, incident = incident, None
            setup()
        now = time.monotonic()
        if now - last_report >= REFRESH_S:
            last_report = now
            out(
                "progress", verified=work.verified, failed=work.failed, after_reset=work.after_reset
            )


def _netgpu_rx(gpu: Any, spec: dict[str, Any], out: _Out, net: dict[str, Any]) -> None:
    import numpy as np

    h, got, last_seq, t0 = hashlib.sha256(), 0, -1, time.time()
    try:
        pool = gpu.netgpu.pool(nbytes=spec["pool"], chunk=spec["chunk"])
        sock = socket.create_connection(tuple(spec["addr"]), timeout=HANG_TIMEOUT_S)
        sock.settimeout(None)
        last_report = 0.0
        for frag in pool.receive(sock):
            if frag.seq < last_seq:
                net.setdefault("errors", []).append(f"fragment {frag.seq} after {last_seq}")
            last_seq = frag.seq
            # Read back from where it landed, the VF's FB (through staging on cuda)
            h.update(frag.buffer(np.uint8).read())
            got += frag.size
            pool.release([frag.token])
            if time.monotonic() - last_report >= REFRESH_S:
                last_report = time.monotonic()
                out("netgpu", bytes=got)
        sock.close()
    except Exception as e:  # reported; the coordinator marks the stream failed
        net.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
    net.update(bytes=got, sha256=h.hexdigest(), seconds=time.time() - t0)
    out("netgpu", bytes=got, final=True)
