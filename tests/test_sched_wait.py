"""Shares when kernels wait on the device instead of spinning on the CPU (issue 27).

A GPU kernel, as its engine sees it, is wall time without CPU: the engine launches
it and waits. On emu the same is a kernel that sleeps. Such a kernel keeps waiting
while its engine is stopped, so a VF that gets the device back for a moment completes
a kernel it was charged almost nothing for. The scheduler once handed out exactly such
moments after every slice of a busy VF (the running VF's doorbell was not read before
its slice ended: its pending count read 0, it left the candidates, the next VF got the
device and the first took it straight back by wake-up preemption): with weights 1:15
the light VF did 2-2.3 times its share of the kernels. Shares here are read from the
kernels the guests saw complete, not from the scheduler's own accounting.
"""

from __future__ import annotations

import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import pytest

import gpuvirt
from gpuvirt.bench.workers import Workers
from helpers import MakeHost

pytestmark = pytest.mark.timeout(120)
WAIT_S = 0.002  # one kernel: wall time without CPU, as a GPU kernel is to its engine
WINDOW_S = 3.0  # the measurement window (its length sets precision, not the verdict)


def wait(xp: Any, seconds: float) -> None:
    time.sleep(seconds)


def waiting_guest(conn: Connection, socket: str, vf: int, token: str) -> None:
    """Two launches in flight (as a tenant queues its next kernel before the last ends);
    on each message from the parent, the count of kernels completed so far."""
    with gpuvirt.attach(vf=vf, socket=socket, token=token) as gpu:
        k = gpuvirt.kernel(wait)
        gpu.launch(k, 0.0).result(timeout=30)
        conn.send("ready")
        conn.recv()
        inflight: deque[Any] = deque()
        done = 0
        while True:
            while len(inflight) < 2:
                inflight.append(gpu.launch(k, WAIT_S))
            inflight.popleft().result(timeout=60)
            done += 1
            if conn.poll():
                if conn.recv() == "stop":
                    break
                conn.send(done)
        for fut in inflight:
            fut.result(timeout=60)
        conn.send(done)


def test_weighted_shares_hold_when_kernels_wait(make_host: MakeHost) -> None:
    weights = (1, 15)
    hp = make_host(
        scheduler={"policy": "weighted"},
        vf=[{"index": vf, "weight": w} for vf, w in enumerate(weights)],
    )
    with Workers() as w:
        conns = [w.start(waiting_guest, str(hp.socket), vf, hp.token(vf)) for vf in (0, 1)]
        w.wait_ready()
        for c in conns:
            c.send("go")
        marks = []
        for _ in range(2):
            time.sleep(WINDOW_S / 2)  # the first half settles; the second is measured
            for c in conns:
                c.send("mark")
            marks.append([c.recv() for c in conns])
        for c in conns:
            c.send("stop")
            c.recv()
    done = [b - a for a, b in zip(*marks, strict=True)]
    share = done[0] / sum(done)
    want = weights[0] / sum(weights)
    # A kernel the VF was stopped in finishes its wait meanwhile: at most one kernel a
    # turn comes free (about 1.1 x here, 1.3 x at worst). The bug gave 2-2.3 x.
    assert 0.6 * want < share < 1.5 * want, (done, share, want)
