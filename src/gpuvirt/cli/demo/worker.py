"""The guest side of the demo: one process per VF, doing verified work in it.

Each guest does matrix products in its VF and checks every result on its own
side (Freivalds' check: C·r = A·(B·(A·r)) for a random r, O(n²) against the
kernel's O(n³)); one ingests a NetGPU stream and hashes it where it landed;
one launches a kernel that never returns when told to. It reports to the
coordinator as JSON lines on stdout and takes orders ("hang", "stop") on
stdin; stdin closing (the coordinator gone) stops it too. This module is
imported in the guest process, so it stays light: no rich, no typer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json as json_mod
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuvirt.cli.demo.knobs import DEPTH, HANG_TIMEOUT_S, REFRESH_S
from gpuvirt.errors import GpuvirtError


def _kernels() -> tuple[Callable[..., Any], Callable[..., Any]]:
    # Nested, so cloudpickle ships them by value: the engine never imports this CLI module.
    def abA(xp: Any, a: Any, b: Any, c: Any) -> None:
        xp.matmul(xp.matmul(a, b), a, out=c)

    def spin(xp: Any) -> None:
        while True:
            pass

    return abA, spin


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
    after_reset: int = 0
    resets_seen: int = 0
    lost_to_reset: int = 0
    unexpected_resets: int = 0
    flop: float = 0.0
    hang: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def guest_main(arg: str) -> None:
    import numpy as np

    import gpuvirt

    p = json_mod.loads(arg)
    out = _Out()
    # Ctrl-C in the terminal reaches the whole process group; the coordinator
    # stops guests itself, in order, so a guest must not die mid-report.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop, hang = threading.Event(), threading.Event()

    def orders() -> None:
        for line in sys.stdin:
            if line.strip() == "hang":
                hang.set()
            elif line.strip() == "stop":
                break
        stop.set()  # "stop", or EOF: the coordinator is gone

    threading.Thread(target=orders, daemon=True).start()
    resets: list[float] = []
    gpu = gpuvirt.attach(
        vf=p["vf"], socket=p["socket"], token=p["token"],
        on_reset=lambda g: (resets.append(time.time()), out("reset", resets=g.resets)),
    )  # fmt: skip
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
        _compute(gpu, np.random.default_rng(p["seed"]), p, stop, hang, work, out, resets)
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
    gpu: Any, rng: Any, p: dict[str, Any], stop: threading.Event, hang: threading.Event,
    work: _Work, out: _Out, resets: list[float],
) -> None:  # fmt: skip
    import numpy as np

    from gpuvirt.errors import BufferLostError, VFResetError

    abA, spin = _kernels()
    n = p["n"]
    a = rng.standard_normal((n, n))  # fixed per run; B is fresh every launch
    is_hang = p["role"] == "hang"
    hang_fut: Any = None
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

    setup()
    last_report = 0.0
    while True:
        try:
            while free and not stop.is_set() and hang_fut is None:
                if is_hang and hang.is_set() and not work.hang:
                    work.hang["submitted"] = time.time()
                    hang_fut = gpu.launch(spin)
                    out("hang_submitted")
                    break
                s = free.popleft()
                b = rng.random((n, n))
                bufs[s][1].write(b)
                inflight.append((gpu.launch(abA, *bufs[s]), s, b))
            if not inflight and hang_fut is not None:
                # What was queued before the hang has been checked; now wait for the reset.
                hang_fut.result(HANG_TIMEOUT_S)
                raise AssertionError("a kernel that never returns returned")
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
                work.flop += 4 * n**3
                if work.resets_seen:
                    work.after_reset += 1
            else:
                work.failed += 1
            free.append(s)
        except (VFResetError, BufferLostError) as e:
            t_err = time.time()
            work.resets_seen += 1
            work.lost_to_reset += len(inflight) + (1 if hang_fut is not None else 0)
            inflight.clear()
            expected = hang_fut is not None
            hang_fut = None
            if not expected:
                work.unexpected_resets += 1
                work.errors.append(f"reset without a hang: {e}")
            gpu.wait_ready(HANG_TIMEOUT_S)
            if expected:
                work.hang.update(
                    error=t_err, ready=time.time(), on_reset=resets[-1] if resets else None
                )
                out("recovering", hang=work.hang)
            setup()
        now = time.monotonic()
        if now - last_report >= REFRESH_S:
            last_report = now
            out(
                "progress", verified=work.verified, failed=work.failed, after_reset=work.after_reset
            )
        if work.hang.get("ready") and work.after_reset == 1 and not work.hang.get("recovered"):
            work.hang["recovered"] = time.time()
            out("recovered", hang=work.hang)


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
            h.update(frag.array(np.uint8))  # read where it landed, in the VF's FB
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
