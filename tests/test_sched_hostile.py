"""A hostile tenant against the world switch (issue 31): kernels on VF 1 of a root host
with confinement required, the neighbour on VF 0 computing meanwhile.

- A kernel that keeps sending itself SIGCONT cancels the stop the host posts (a pending
  stop is discarded when SIGCONT is generated). Its engine, raised to SCHED_FIFO for that
  stop, then kept the device's CPU, the neighbour's engine never got it to take its own
  stop, and the host reset the neighbour. Only the tenant that cancels may lose its slice
  or be reset.
- Threads a kernel creates while its engine is raised for a stop inherited SCHED_FIFO,
  and kept it. No tenant thread may run at a real-time policy.
- An engine runs at ENGINE_POLICY (SCHED_BATCH, device/emu.py) between stops, every
  thread of it, and is back at it after each stop it was raised for.
- A kernel that writes its engine's words to say "done, nothing running" while it
  computes gets its VF parked (host/sched/policy.py): on the device, uncharged. That
  is device time nobody else wanted; once the neighbour has work, the liar is stopped
  like any VF before the neighbour runs, under `liquid` and under `weighted`, there
  with its weight raised while it is parked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

from confine_env import hostile_scene
from gpuvirt.device.emu import ENGINE_POLICY
from gpuvirt.errors import GpuvirtError
from helpers import MakeHost, runs_of, time_order, wait_until
from hostile import STAMP_NS, k_looks_idle

pytestmark = pytest.mark.timeout(120)
STORM_S = 3.0  # how long the attacker keeps at it: hundreds of the neighbour's slices
REAL_TIME = (os.SCHED_FIFO, os.SCHED_RR)
STOPPED_NS = 1_000_000  # a gap between two of a kernel's stamps this long: it was not running


def k_cancel_stops(xp: Any, seconds: float) -> int:
    """One thread, sending itself SIGCONT as fast as it can."""
    end, n, me = time.monotonic() + seconds, 0, os.getpid()
    while time.monotonic() < end:
        os.kill(me, signal.SIGCONT)
        n += 1
    return n


def k_threads_while_raised(xp: Any, seconds: float, most: int) -> int:
    """Watch for the host raising this engine to take a stop (it sets the policy, then
    sends SIGSTOP) and start a thread (that then waits forever) in that window: a new
    thread inherits the policy its creator has."""
    end = time.monotonic() + seconds
    forever = threading.Event()
    started = 0
    while time.monotonic() < end:
        if started < most and os.sched_getscheduler(0) in REAL_TIME:
            threading.Thread(target=forever.wait, daemon=True).start()
            started += 1
    return started


def _flrs(hp: Any, vf: int) -> list[dict[str, Any]]:
    return [e for e in hp.admin.events(after=0) if e["vf"] == vf and e["kind"] == "flr.start"]


def test_a_tenant_that_cancels_its_stop_never_gets_its_neighbour_reset(
    make_host: MakeHost,
) -> None:
    with hostile_scene(make_host) as sc:
        sc.conn.send(("busy", STORM_S))  # the neighbour computes through the attack
        fut = sc.gpu.launch(k_cancel_stops, STORM_S)
        with contextlib.suppress(GpuvirtError):  # the attacker may be reset: its own fault
            fut.result(60)
        assert sc.conn.poll(60) and sc.conn.recv() is True, "the neighbour lost its kernel"
        assert sc.neighbour_ok()
        assert _flrs(sc.hp, 0) == []
        # No engine is left raised: a tenant at SCHED_FIFO would keep the device's CPU.
        for vf in (0, 1):
            assert os.sched_getscheduler(sc.engine_pid(vf)) == ENGINE_POLICY


def test_no_tenant_thread_ever_runs_at_a_real_time_policy(make_host: MakeHost) -> None:
    with hostile_scene(make_host) as sc:
        sc.conn.send(("busy", STORM_S))
        started = sc.gpu.launch(k_threads_while_raised, STORM_S, 40).result(60)
        assert sc.conn.recv() is True
        engine = sc.engine_pid(1)
        raised = []
        for tid in os.listdir(f"/proc/{engine}/task"):
            if int(tid) == engine:
                continue  # the engine's own thread is raised by the host, for a stop only
            try:
                policy = os.sched_getscheduler(int(tid))
            except ProcessLookupError:
                continue
            if policy in REAL_TIME:
                raised.append((int(tid), policy))
        assert raised == [], (started, raised)
        assert sc.neighbour_ok()


def test_every_engine_thread_runs_at_the_engine_policy_between_stops(
    make_host: MakeHost,
) -> None:
    """SCHED_BATCH: a COPY_IN or LAUNCH waking the engine never preempts the host task
    running on the device's CPU (a NetGPU receiver, say) at once."""
    with hostile_scene(make_host) as sc:
        sc.conn.send(("busy", 0.5))  # switches: each engine raised and lowered again
        assert sc.conn.poll(60) and sc.conn.recv() is True
        for vf in (0, 1):
            engine = sc.engine_pid(vf)
            policies = {
                int(t): os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{engine}/task")
            }
            assert set(policies.values()) == {ENGINE_POLICY}, (vf, policies)


# The liar's weight while it is parked: under `weighted`, raised to this mid-attack, as an
# operator might. Were the raise to make a parked VF a candidate again, the liar would hold
# the device 8/9 of the time.
RAISED_WEIGHT = 8.0


@pytest.mark.parametrize(
    "policy", ["liquid", "weighted"], ids=["liquid", "weighted-weight-raised-in-flight"]
)
def test_a_kernel_that_says_it_is_idle_is_still_stopped_before_its_neighbour_runs(
    make_host: MakeHost, policy: str
) -> None:
    sections: dict[str, Any] = {"scheduler": {"policy": policy}}
    if policy == "weighted":
        sections["vf"] = [{"index": 0, "weight": 1}, {"index": 1, "weight": 1}]
    with hostile_scene(make_host, **sections) as sc:

        def liar() -> dict[str, Any]:
            return sc.hp.admin.request("GET", "/sched")["vfs"]["1"]

        stamps = sc.gpu.alloc(int(4 * STORM_S * 1e9) // STAMP_NS, np.int64)
        sc.gpu.launch(k_looks_idle, stamps, 4 * STORM_S)  # never resumed: not awaited
        wait_until(lambda: liar()["parked"])
        # view() (emu): one word of the FB per poll, not a copy of the whole buffer
        wait_until(lambda: stamps.view()[0], what="the liar computing")
        before = sc.hp.admin.request("GET", "/sched")["switches"]
        sc.conn.send(("stamps", STORM_S))
        if policy == "weighted":
            sc.hp.admin.vf_set(1, weight=RAISED_WEIGHT)
            assert liar()["weight"] == RAISED_WEIGHT  # it holds no slice: at once
        assert sc.conn.poll(60), "the neighbour's kernel never finished"
        theirs = sc.conn.recv()
        switches = sc.hp.admin.request("GET", "/sched")["switches"] - before
        mine = stamps.read()
        mine = mine[mine > 0]
        assert sc.neighbour_ok()
        assert _flrs(sc.hp, 0) == []
    # Were the liar left running beside the neighbour (it "has nothing to stop"), their
    # stamps would interleave at the CPU's timeslices: far more runs than switches.
    runs = len(runs_of(time_order([mine, theirs])))
    assert runs <= switches + 1, (runs, switches)
    # And it gets the device: the liar, with nothing pending by its own words, is no
    # candidate for it while the neighbour computes.
    ran = np.diff(theirs)
    assert ran[ran < STOPPED_NS].sum() > 0.5 * (theirs[-1] - theirs[0]), ran.max()
