"""bench launch: the round trip of an empty kernel, guest → engine → guest.

The floor is a plain socket ping-pong between two processes over the same
kind of socket (AF_UNIX SOCK_SEQPACKET), measured in the same run, in
alternating rounds so machine noise hits both alike. Target: launch p50 ≤
1.5 × the floor's p50.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from typing import Any

from gpuvirt.bench.common import Result, Target, percentile, scratch_host

TARGET_RATIO = 1.5


def _echo(sock: socket.socket) -> None:
    buf = bytearray(4096)
    view = memoryview(buf)
    while True:
        n = sock.recv_into(buf)
        if not n:
            return
        sock.send(view[:n])


def pingpong(n: int, payload: int = 64) -> list[float]:
    """Round trips of `payload` bytes to an echo process and back, in µs."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = mp.get_context("spawn").Process(target=_echo, args=(b,), daemon=True)
    proc.start()
    b.close()
    msg = b"x" * payload
    buf = bytearray(4096)  # the tightest plain loop: no allocation per receive
    for _ in range(200):  # warm both processes
        a.send(msg)
        a.recv_into(buf)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        a.send(msg)
        a.recv_into(buf)
        out.append((time.perf_counter() - t) * 1e6)
    a.close()
    proc.join(5)
    return out


def _empty(xp: Any) -> None:
    return None


def launches(gpu: Any, n: int) -> list[float]:
    import gpuvirt

    k = gpuvirt.kernel(_empty)
    for _ in range(200):
        gpu.launch(k).result(timeout=10)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        gpu.launch(k).result(timeout=10)
        out.append((time.perf_counter() - t) * 1e6)
    return out


def run(quick: bool = False, backend: str = "emu") -> Result:
    import gpuvirt

    rounds, per_round = (3, 500) if quick else (10, 2000)
    floor: list[float] = []
    launch: list[float] = []
    with (
        scratch_host(device={"backend": backend}, sriov={"vf_num": 2}) as hp,
        gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as gpu,
    ):
        for _ in range(rounds):
            floor += pingpong(per_round)
            launch += launches(gpu, per_round)
    p50, p99, f50 = percentile(launch, 50), percentile(launch, 99), percentile(floor, 50)
    ratio = p50 / f50
    return Result(
        bench="launch",
        backend=backend,
        figures={
            "p50_us": round(p50, 2),
            "p99_us": round(p99, 2),
            "floor_p50_us": round(f50, 2),
            "floor_p99_us": round(percentile(floor, 99), 2),
            "ratio_p50": round(ratio, 3),
            "samples": len(launch),
        },
        targets=[Target("ratio_p50", round(ratio, 3), TARGET_RATIO, "<=")],
        rows=[
            ("launch round trip p50", p50, "µs"),
            ("launch round trip p99", p99, "µs"),
            ("socket ping-pong p50 (floor)", f50, "µs"),
            ("socket ping-pong p99", percentile(floor, 99), "µs"),
            ("launch / floor (p50)", ratio, "×"),
        ],
        series={"launch_us": launch, "floor_us": floor},
    )
