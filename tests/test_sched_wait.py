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
SLICE_MS = 6
IDLE_SLICES = 50  # an idle stretch far longer than anything one slice can be charged
KERNEL_S = 0.05


def wait(xp: Any, seconds: float) -> None:
    time.sleep(seconds)


def waiting_guest(conn: Connection, socket: str, vf: int, token: str) -> None:
    """Two launches in flight (as a tenant queues its next kernel before the last ends)
    until the parent says stop; then the CLOCK_MONOTONIC instant of each completion."""
    with gpuvirt.attach(vf=vf, socket=socket, token=token) as gpu:
        k = gpuvirt.kernel(wait)
        gpu.launch(k, 0.0).result(timeout=30)
        conn.send("ready")
        conn.recv()
        inflight: deque[Any] = deque()
        done: list[int] = []
        while not conn.poll():
            while len(inflight) < 2:
                inflight.append(gpu.launch(k, WAIT_S))
            inflight.popleft().result(timeout=60)
            done.append(time.monotonic_ns())
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
        start = time.monotonic_ns()
        time.sleep(WINDOW_S)  # the first half settles; the second is measured
        for c in conns:
            c.send("stop")
        completions = [c.recv() for c in conns]
    # One window for both, on the clock the guests stamped with (a VF's own reply to a
    # "mark" comes only at its next completion, a turn of the other VF later).
    since = start + int(WINDOW_S / 2 * 1e9)
    done = [sum(t >= since for t in ts) for ts in completions]
    share = done[0] / sum(done)
    want = weights[0] / sum(weights)
    # A kernel the VF was stopped in finishes its wait meanwhile: at most one kernel a
    # turn comes free (about 1.1 x here, 1.3 x at worst). The bug gave 2-2.3 x.
    assert 0.6 * want < share < 1.5 * want, (done, share, want)


def idle_guest(conn: Connection, socket: str, vf: int, token: str) -> None:
    """One kernel; on each message from the parent, one kernel of that many seconds."""
    with gpuvirt.attach(vf=vf, socket=socket, token=token) as gpu:
        k = gpuvirt.kernel(wait)
        gpu.launch(k, 0.0).result(timeout=30)
        conn.send("ready")
        while (seconds := conn.recv()) is not None:
            gpu.launch(k, seconds).result(timeout=30)
            conn.send("done")


def test_a_vf_idling_on_the_device_is_charged_nothing(make_host: MakeHost) -> None:
    """Work-conserving policies keep a drained VF on the device when nobody else wants
    it. Charged for that idling, the VF that attached first was starved later for 15 x
    the time its neighbour took to start, with weights 1:15 (CI: the test above saw the
    light VF at 0.58 x its share, the first second of the window lost to that debt)."""
    hp = make_host(
        scheduler={"policy": "weighted", "time_slice_ms": SLICE_MS},
        vf=[{"index": 0, "weight": 1}, {"index": 1, "weight": 15}],
    )

    def vf0() -> dict[str, Any]:
        return hp.admin.request("GET", "/sched")["vfs"]["0"]

    with Workers() as w:
        c = w.start(idle_guest, str(hp.socket), 0, hp.token(0))
        w.wait_ready()
        before = vf0()["device_ns"]
        time.sleep(IDLE_SLICES * SLICE_MS / 1000)  # the idling the VF would be charged for
        idle = vf0()
        # Holding no slice, it has none to finish at the old weight: a new weight applies
        # at once (it waited for the next slice's end, and that slice was charged at the
        # old weight).
        hp.admin.vf_set(0, weight=2)
        assert (vf0()["weight"], vf0()["next_weight"]) == (2.0, None)
        c.send(KERNEL_S)
        assert c.recv() == "done"
        after = vf0()
        c.send(None)
    # At most the rest of the slice it drained in, and what that slice overran.
    assert idle["device_ns"] - before < 2 * SLICE_MS * 1e6, (before, idle)
    assert idle["parked"] and idle["running"]  # still on the device, holding no slice
    # Its next launch takes a slice again (from the scheduler's wake-up on its doorbell).
    assert after["device_ns"] - idle["device_ns"] > KERNEL_S * 1e9 / 2, (idle, after)
