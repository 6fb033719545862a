"""World switch and policies, observed from real engines running real kernels."""

from __future__ import annotations

import itertools
import pickle
import select
import socket
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

import gpuvirt
from gpuvirt.bench.workers import Workers, busy_guest
from gpuvirt.defaults import MAX_TAKEN
from gpuvirt.device.base import EngineSpec, WSCommand
from gpuvirt.device.emu import EmuDevice
from gpuvirt.errors import StateError
from gpuvirt.protocol.command import Kind, Message, Status, pack
from helpers import MakeHost, hold_fullaccess, runs_of, time_order

pytestmark = pytest.mark.timeout(180)
SLICE_MS = 20  # a turn long enough that foreign load on the device's CPU leaves it samples
TURNS = 8  # turns each recorder sees, whatever the machine's speed
SAMPLES = 2_000_000  # room for TURNS turns of one-per-iteration stamps


def record_turns(xp: Any, out: Any, turns: int) -> int:
    """Write CLOCK_MONOTONIC into `out` every iteration until this kernel has been off
    the device `turns` times (a gap of over a slice: a turn of another VF), or `out`
    is full; how many it wrote."""
    gap = SLICE_MS * 1_000_000
    n, off, last = 0, 0, time.monotonic_ns()
    while n < out.size and off < turns:
        now = time.monotonic_ns()
        off += now - last > gap
        out[n], last, n = now, now, n + 1
    return n


def _recorder(conn: Connection, sock: str, vf: int, token: str) -> None:
    with gpuvirt.attach(vf=vf, socket=sock, token=token) as gpu:
        out = gpu.alloc(SAMPLES, np.int64)
        gpu.launch(record_turns, out, 0).result(30)  # kernel shipped and warm
        conn.send("ready")
        conn.recv()
        n = gpu.launch(record_turns, out, TURNS).result(120)
        conn.send(out.read()[:n])


def test_kernels_of_two_vfs_never_run_at_once_and_round_robin_keeps_order(
    make_host: MakeHost,
) -> None:
    hp = make_host(
        sriov={"vf_num": 3}, scheduler={"policy": "round_robin", "time_slice_ms": SLICE_MS}
    )
    with Workers() as w:
        conns = [w.start(_recorder, str(hp.socket), vf, hp.token(vf)) for vf in range(3)]
        w.wait_ready()
        before = hp.admin.request("GET", "/sched")["switches"]
        for c in conns:
            c.send("go")
        samples = [c.recv() for c in conns]
        switches = hp.admin.request("GET", "/sched")["switches"] - before
    order = time_order(samples)
    runs = runs_of(order)
    # Each run of one VF's samples needs a world switch to end: were two engines ever
    # running together, their samples would interleave into far more runs than switches.
    assert len(runs) <= switches + 1, (len(runs), switches)
    # Round robin: while all three are busy, each run is followed by the next VF in turn.
    busy_until = min(s[-1] for s in samples)
    cut = sum(int(np.count_nonzero(s < busy_until)) for s in samples)
    head_runs = runs_of(order[:cut])
    assert len(head_runs) > 6
    assert all((b - a) % 3 == 1 for a, b in itertools.pairwise(head_runs))


def _window(hp: Any, seconds: float) -> dict[int, float]:
    a = hp.admin.request("GET", "/sched")
    time.sleep(seconds)  # the measurement window
    b = hp.admin.request("GET", "/sched")
    span = b["elapsed_ns"] - a["elapsed_ns"]
    return {
        int(vf): (b["vfs"][vf]["device_ns"] - a["vfs"][vf]["device_ns"]) / span for vf in b["vfs"]
    }


@pytest.mark.parametrize("policy", ["fairness", "round_robin", "liquid"])
def test_policies_give_the_shares_they_promise(make_host: MakeHost, policy: str) -> None:
    # VF0 busy, VF1 attached but idle, VF2 without a guest
    hp = make_host(sriov={"vf_num": 3}, scheduler={"policy": policy})
    with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)), Workers() as w:
        w.start(busy_guest, str(hp.socket), 0, hp.token(0), 0.05)
        w.wait_ready()
        share = _window(hp, 1.5)
        w.stop()
    if policy == "fairness":  # every enabled VF gets its slice, guest or not, work or not
        assert share[1] > 0.2 and share[2] > 0.2 and share[0] < 0.5
    elif policy == "round_robin":  # VFs with a guest get theirs, idle or not
        assert share[1] > 0.3 and share[2] == 0 and share[0] < 0.7
    else:  # liquid: an idle VF yields at once; the busy one gets the device
        assert share[0] > 0.9 and share[1] < 0.05 and share[2] == 0


def test_weighted_shares_follow_the_weights(make_host: MakeHost) -> None:
    hp = make_host(
        scheduler={"policy": "weighted"},
        vf=[{"index": 0, "weight": 1}, {"index": 1, "weight": 3}],
    )
    with Workers() as w:
        for vf in (0, 1):
            w.start(busy_guest, str(hp.socket), vf, hp.token(vf), 0.05)
        w.wait_ready()
        share = _window(hp, 2.0)
        w.stop()
    # Exact proportions are the policy's, proved without timing in test_sched_policy.py;
    # on real engines the heavier VF gets more, and both get some.
    assert share[1] > share[0] > 0, share


def test_world_switch_commands_only_in_gims_order() -> None:
    dev = EmuDevice()
    dev.create_fb(0, 4 << 20)
    engine = dev.new_engine(EngineSpec(0, 4 << 20))
    try:
        with pytest.raises(StateError, match="RUN_GPU is illegal after SHUTDOWN_GPU"):
            engine.command(WSCommand.RUN_GPU, 5)
        engine.command(WSCommand.INIT_GPU, 30)
        with pytest.raises(StateError, match="SAVE_GPU_STATE is illegal after INIT_GPU"):
            engine.command(WSCommand.SAVE_GPU_STATE, 5)
        for cmd in (WSCommand.RUN_GPU, WSCommand.IDLE_GPU, WSCommand.SAVE_GPU_STATE,
                    WSCommand.LOAD_GPU_STATE, WSCommand.RUN_GPU, WSCommand.IDLE_GPU):  # fmt: skip
            engine.command(cmd, 5)
        with pytest.raises(StateError, match="LOAD_GPU_STATE is illegal after IDLE_GPU"):
            engine.command(WSCommand.LOAD_GPU_STATE, 5)
    finally:
        engine.kill()
        dev.close()


def test_a_guest_flooding_its_channel_cannot_make_the_scheduler_spin(make_host: MakeHost) -> None:
    hp = make_host(scheduler={"policy": "liquid"})
    with Workers() as w:
        w.start(busy_guest, str(hp.socket), 0, hp.token(0), 0.02)
        w.wait_ready()
        with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)) as liar:
            assert liar._queue is not None
            chan = liar._queue.channel  # its own end, written as any tenant can
            junk = pack(Kind.DEFINE, kid=7, payload=b"not a pickle")  # the engine answers none
            a = hp.admin.request("GET", "/sched")
            sent = 0
            for _ in range(50_000):
                try:
                    chan.send(junk, socket.MSG_DONTWAIT)
                    sent += 1
                except BlockingIOError:
                    pass  # full until its engine's next slice: the storm goes on
            b = hp.admin.request("GET", "/sched")
        (busy,) = w.stop()
    woke, switched = b["wakeups"] - a["wakeups"], b["switches"] - a["switches"]
    assert sent > 0 and woke <= 3 * switched + 50, (sent, woke, switched)
    assert b["vfs"]["1"]["pending"] <= MAX_TAKEN + 1
    assert busy.errors == [] and busy.launches > 0


def test_work_queued_in_a_vfs_channel_is_scheduled_with_no_doorbell_rung(
    make_host: MakeHost,
) -> None:
    """The doorbell is the engine's end of the channel: a launch the guest sent is work the
    scheduler sees, whatever the guest's library did. (An eventfd the guest had to ring
    once counted only what it rang: a launch sent without a ring, beside a busy
    neighbour, waited for ever under a work-conserving policy.)"""
    hp = make_host(scheduler={"policy": "liquid"})
    with Workers() as w:
        w.start(busy_guest, str(hp.socket), 0, hp.token(0), 0.02)
        w.wait_ready()
        with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)) as gpu:
            k = gpuvirt.kernel(_square)
            assert gpu.launch(k, 3).result(timeout=30) == 9  # defined in the engine now
            assert gpu._queue is not None
            chan = gpu._queue.channel
            seq = 1 << 30  # no future of the library's: its reply is read here
            chan.send(pack(Kind.LAUNCH, seq, k.kid, 0, pickle.dumps(((7,), {}))))
            assert select.select([chan], [], [], 30)[0], "the launch was never run"
            reply = Message.decode(chan.recv(1 << 16))
        (busy,) = w.stop()
    assert (reply.kind, reply.seq, reply.flags) == (Kind.DONE, seq, Status.OK)
    assert pickle.loads(reply.payload) == 49
    assert busy.errors == [] and busy.launches > 0


def _square(xp: Any, i: int) -> int:
    return i * i


def test_a_drained_vf_in_fullaccess_does_not_make_the_scheduler_spin(
    make_host: MakeHost,
) -> None:
    """VF0 holds FULLACCESS with nothing to run while VF1 waits with work: VF0 keeps the
    device (it is exclusive), and its being drained must not wake the scheduler again and
    again (it once did: a wake-up per pass, the thread never slept)."""
    slice_ms = 6
    hp = make_host(
        scheduler={"policy": "liquid", "time_slice_ms": slice_ms, "fullaccess_timeout_ms": 60_000}
    )
    with Workers() as w:
        w.start(busy_guest, str(hp.socket), 1, hp.token(1), 0.02)
        w.wait_ready()
        held = hold_fullaccess(hp, 0)
        try:
            a = hp.admin.request("GET", "/sched")
            time.sleep(0.5)  # a window of the exclusive VF's slices
            b = hp.admin.request("GET", "/sched")
        finally:
            held.close()
        (busy,) = w.stop()
    assert a["current"] == b["current"] == 0
    slices = (b["elapsed_ns"] - a["elapsed_ns"]) / (slice_ms * 1e6)
    woke = b["wakeups"] - a["wakeups"]
    assert woke <= 3 * slices + 50, (woke, slices)
    assert busy.errors == [] and busy.launches > 0
