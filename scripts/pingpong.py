#!/usr/bin/env python3
"""What a wake-up costs on this machine: a SOCK_SEQPACKET ping-pong between two
processes, blocking and polling (gpuvirt/poll.py), apart and on one CPU.

    .venv/bin/python scripts/pingpong.py [ROUND_TRIPS]

The echo sits on the last CPU (the emulated device's); the pinger on the first
(`apart`) or the last (`together`). Prints p50 and p99 in µs of each. See
docs/benchmarks.md (launch) for what the figures mean.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time

from gpuvirt.poll import PollWindow

LIMIT_NS = 200_000


def _recv(sock: socket.socket, buf: bytearray, window: PollWindow) -> int:
    def now() -> int | None:
        try:
            return sock.recv_into(buf, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None

    return window.wait(now, lambda: sock.recv_into(buf))


def _echo(sock: socket.socket, cpu: int, limit_ns: int) -> None:
    os.sched_setaffinity(0, {cpu})
    buf, window = bytearray(4096), PollWindow(limit_ns)
    while n := _recv(sock, buf, window):
        sock.send(memoryview(buf)[:n])


def _run(pinger_cpu: int, echo_cpu: int, limit_ns: int, n: int) -> tuple[float, float]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = mp.get_context("spawn").Process(target=_echo, args=(b, echo_cpu, limit_ns))
    proc.start()
    b.close()
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {pinger_cpu})
    buf, window, out = bytearray(4096), PollWindow(limit_ns), []
    try:
        for i in range(n + 1000):
            t = time.perf_counter()
            a.send(b"x" * 64)
            _recv(a, buf, window)
            if i >= 1000:  # after a warm-up
                out.append((time.perf_counter() - t) * 1e6)
    finally:
        os.sched_setaffinity(0, saved)
        a.close()
        proc.join(5)
    out.sort()
    return out[len(out) // 2], out[int(len(out) * 0.99)]


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    cpus = sorted(os.sched_getaffinity(0))
    places = {"apart": (cpus[0], cpus[-1]), "together": (cpus[-1], cpus[-1])}
    if len(cpus) == 1:
        del places["apart"]
    for name, (pinger, echo) in places.items():
        for how, limit in (("blocking", 0), ("polling", LIMIT_NS)):
            p50, p99 = _run(pinger, echo, limit, n)
            print(f"{name:9} {how:9} p50 {p50:7.1f} µs  p99 {p99:7.1f} µs")


if __name__ == "__main__":
    main()
