"""Tenants for the chaos and fuzz benches: honest ones that check every result,
and a hostile one that leaves a pattern behind for the next tenant to look for.

Run with bench/workers.py's Workers (spawn processes, a private pipe each).
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import numpy as np

PATTERN = 0xAB


def matmul(xp: Any, a: Any, b: Any, out: Any) -> None:
    out[...] = a @ b


def verified_guest(conn: Connection, socket: str, vf: int, token: str, seed: int) -> None:
    """Known computations back to back, each checked against numpy, until told to stop."""
    import gpuvirt

    rng = np.random.default_rng(seed)
    checked = wrong = 0
    errors: list[str] = []
    with gpuvirt.attach(vf=vf, socket=socket, token=token) as gpu:
        k = gpuvirt.kernel(matmul)
        a, b, out = (
            gpu.alloc((48, 32), np.int64),
            gpu.alloc((32, 40), np.int64),
            gpu.alloc((48, 40), np.int64),
        )
        conn.send("ready")
        while not conn.poll():
            x = rng.integers(-1000, 1000, (48, 32), dtype=np.int64)
            y = rng.integers(-1000, 1000, (32, 40), dtype=np.int64)
            try:
                a.write(x)
                b.write(y)
                gpu.launch(k, a, b, out).result(timeout=60)
                got = out.read()
            except gpuvirt.GpuvirtError as e:  # an honest tenant should never see one
                errors.append(f"{type(e).__name__}: {e}")
                gpu.wait_ready(30)
                a, b, out = (
                    gpu.alloc((48, 32), np.int64),
                    gpu.alloc((32, 40), np.int64),
                    (gpu.alloc((48, 40), np.int64)),
                )
                continue
            checked += 1
            wrong += not np.array_equal(got, x @ y)
        conn.recv()
        conn.send({"vf": vf, "checked": checked, "wrong": wrong, "errors": errors,
                   "resets": gpu.resets})  # fmt: skip


def _touch(xp: Any, buf: Any) -> None:
    buf += 0  # the engine maps and touches it too


def pattern_guest(conn: Connection, socket: str, vf: int, token: str, nbytes: int) -> None:
    """Fill `nbytes` of the FB with PATTERN, say so, then wait to be killed."""
    import gpuvirt

    gpu = gpuvirt.attach(vf=vf, socket=socket, token=token)
    buf = gpu.alloc(nbytes, np.uint8)
    buf.write(np.full(nbytes, PATTERN, np.uint8))
    gpu.launch(_touch, buf).result(30)
    conn.send("ready")
    conn.recv()  # never answered: the bench SIGKILLs this process


def leaked_bytes(socket: str, vf: int, token: str) -> int:
    """Attach as the next tenant and count the bytes of the FB that are not zero."""
    import gpuvirt
    from gpuvirt.protocol.info import RESERVED_SIZE

    with gpuvirt.attach(vf=vf, socket=socket, token=token) as gpu:
        whole = gpu.alloc(gpu.fb_size - RESERVED_SIZE, np.uint8)
        return int(np.count_nonzero(whole.view()))
