"""Hang detection, VF FLR, the guard and the device reset, with real faults."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

import gpuvirt
from gpuvirt.bench.workers import Workers, busy_guest, hang_guest
from gpuvirt.protocol.info import PF2VF_OFFSET, RESERVED_SIZE
from gpuvirt.protocol.mailbox import FRAME_SIZE, Attach, Frame, GuestMsg, HostMsg
from helpers import MakeHost, last_seq, wait_event, wait_state, wait_until

pytestmark = pytest.mark.timeout(180)


def flr_done(vf: int):
    return lambda e: e["kind"] == "flr.done" and e["vf"] == vf


def test_a_kernel_that_never_ends_is_reset_and_the_others_go_on(make_host: MakeHost) -> None:
    hp = make_host(sriov={"vf_num": 3}, scheduler={"job_timeout_s": 1.0})
    with gpuvirt.attach(vf=2, socket=hp.socket, token=hp.token(2)) as keeper, Workers() as w:
        kept = keeper.alloc(1 << 16, np.float64)
        kept.write(np.arange(1 << 16, dtype=np.float64))
        hanger = w.start(hang_guest, str(hp.socket), 0, hp.token(0))
        w.start(busy_guest, str(hp.socket), 1, hp.token(1), 0.02)
        w.wait_ready()
        hanger.send("go")
        report = hanger.recv()  # the hang guest returns once it saw the reset and recovered
        assert report["outcome"].startswith("VFResetError")
        assert report["works_after_reset"] and report["resets"] == 1
        (busy,) = [r for r in w.stop()[1:]]
        np.testing.assert_array_equal(kept.read(), np.arange(1 << 16, dtype=np.float64))
    assert busy.errors == [] and busy.launches > 0
    ev = [e for e in hp.admin.events() if e["kind"] == "flr.start"]
    assert [(e["vf"], e["data"]["reason"]) for e in ev] == [(0, "job_timeout")]
    done = wait_event(hp, flr_done(0))
    assert set(done["data"]["steps"]) >= {"off_schedule", "notify", "kill", "scrub", "engine_start"}
    # the neighbour's device time kept growing while VF0 was being reset
    before, after = ev[0]["data"]["device_ns"]["vfs"], done["data"]["device_ns"]["vfs"]
    assert after["1"] > before["1"]
    assert hp.admin.vf(1)["flr_count"] == 0 and hp.admin.vf(2)["flr_count"] == 0


def test_a_sigkilled_engine_is_reset_and_the_guest_recovers(make_host: MakeHost) -> None:
    hp = make_host()
    resets: list[int] = []
    gpu = gpuvirt.attach(
        vf=0, socket=hp.socket, token=hp.token(0), on_reset=lambda g: resets.append(g.generation)
    )
    old = gpu.alloc(1024, np.uint8)
    old.write(np.full(1024, 7, np.uint8))
    after = last_seq(hp)
    os.kill(hp.admin.vf(0)["engine_pid"], signal.SIGKILL)
    start = wait_event(hp, lambda e: e["kind"] == "flr.start" and e["vf"] == 0, after=after)
    assert start["data"]["reason"] == "engine_died"
    wait_event(hp, flr_done(0), after=after)
    gpu.wait_ready()
    assert resets and gpu.resets == 1
    with pytest.raises(gpuvirt.BufferLostError, match="reset"):
        old.read()
    # the FB came back scrubbed: nothing of the old contents anywhere
    whole = gpu.alloc(gpu.fb_size - RESERVED_SIZE, np.uint8)
    assert not whole.view().any()
    assert gpu.launch(lambda xp: 6 * 7).result(10) == 42
    gpu.close()


def test_pending_launches_fail_with_vf_reset_error(make_host: MakeHost) -> None:
    hp = make_host()
    gpu = gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1))
    from gpuvirt.bench.workers import hang

    fut = gpu.launch(hang)
    after = last_seq(hp)
    flrs = hp.admin.vf(1)["flr_count"]
    # The admin call returns once the FLR is done; the guest's re-init may already
    # have begun, so the state it reports is not the point: one FLR, by the admin, is.
    assert hp.admin.vf(1, "reset")["flr_count"] == flrs + 1
    done = wait_event(hp, flr_done(1), after=after)
    assert done["data"]["reason"] == "admin"
    with pytest.raises(gpuvirt.VFResetError, match="reset"):
        fut.result(30)
    gpu.wait_ready()
    assert gpu.launch(lambda xp: "alive").result(10) == "alive"
    gpu.close()


def test_a_reset_is_a_reset_even_when_the_engines_end_comes_first(make_host: MakeHost) -> None:
    """The host waits only ready_to_reset_wait (10 ms) for READY_TO_RESET and then kills
    the engine; a guest whose mailbox thread was not scheduled in that time (a loaded
    machine: CI's chaos run) read the channel's end first and answered DetachedError
    for a reset. Here the mailbox thread is held at the notice (it needs the client's
    state lock to fail the pending work) until the FLR is over: the channel's end is
    there, and the launch still fails with VFResetError once the notice is read."""
    from gpuvirt.bench.workers import hang

    hp = make_host()
    gpu = gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1))
    fut = gpu.launch(hang)
    with gpu._state_lock:  # the mailbox thread is held where it handles the notice
        done = hp.admin.vf(1, "reset")  # returns once the FLR is over: the engine is gone
        assert done["flr_count"] == 1
        # Before the fix: DetachedError("the VF's engine closed the channel") at once.
        # Now the engine's end waits for the mailbox's word, which cannot come yet.
        with pytest.raises(TimeoutError):
            fut.result(0.5)
    with pytest.raises(gpuvirt.VFResetError, match="reset"):
        fut.result(30)
    gpu.wait_ready()
    assert gpu.launch(lambda xp: "alive").result(10) == "alive"
    gpu.close()


def _frame(s: socket.socket) -> tuple[Frame, list[int]]:
    import array

    fds = array.array("i")
    data = b""
    got: list[int] = []
    while len(data) < FRAME_SIZE:
        chunk, anc, _f, _a = s.recvmsg(FRAME_SIZE - len(data), socket.CMSG_SPACE(16))
        for _lvl, _kind, raw in anc:
            fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
        assert chunk, "host closed the connection"
        data += chunk
    got.extend(fds)
    return Frame.decode(data), got


def test_a_guest_that_never_releases_init_is_reset(make_host: MakeHost) -> None:
    hp = make_host(scheduler={"fullaccess_timeout_ms": 300})
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(str(hp.socket))
    s.sendall(Attach(vf=0, token=bytes.fromhex(hp.token(0))).encode())
    assert _frame(s)[0].msg == HostMsg.SUCCESS
    s.sendall(Frame(GuestMsg.REQ_GPU_INIT_DATA).encode())
    assert _frame(s)[0].msg == HostMsg.GPU_INIT_DATA_READY
    s.sendall(Frame(GuestMsg.REQ_GPU_INIT_ACCESS).encode())
    ready, fds = _frame(s)
    assert ready.msg == HostMsg.READY_TO_ACCESS_GPU and len(fds) == ready.dw3 == 2
    for fd in fds:
        os.close(fd)
    # ...and now hold FULLACCESS, never sending REL_GPU_INIT_ACCESS
    assert _frame(s)[0].msg == HostMsg.FLR_NOTIFICATION
    s.sendall(Frame(GuestMsg.READY_TO_RESET).encode())
    assert _frame(s)[0].msg == HostMsg.FLR_NOTIFICATION_COMPLETION
    ev = wait_event(hp, flr_done(0))
    assert ev["data"]["reason"] == "fullaccess_timeout"
    assert ev["data"]["steps"]["notify"] >= 0
    start = [e for e in hp.admin.events() if e["kind"] == "flr.notify"][-1]
    assert start["data"]["ready_to_reset"] is True
    s.close()


def test_the_guard_quarantines_on_the_fourth_flr(make_host: MakeHost) -> None:
    hp = make_host(reset={"guard_flr": "3/60s"})
    for _ in range(3):
        assert hp.admin.vf(0, "reset")["state"] == "AVAIL"
    assert hp.admin.vf(0, "reset")["state"] == "QUARANTINED"
    assert hp.admin.vf(0)["guard"]["tripped"]
    with pytest.raises(gpuvirt.AuthRefusedError, match="quarantined"):
        gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0))
    assert [e["vf"] for e in hp.admin.events() if e["kind"] == "guard.trip"] == [0]
    # the neighbour is unaffected, and an admin brings the VF back
    with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)) as gpu:
        assert gpu.launch(lambda xp: 1).result(10) == 1
    out = subprocess.run(
        [sys.executable, "-m", "gpuvirt", "vf", "clear-guard", "0", "--config", str(hp.config_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "AVAIL" in out.stdout
    with gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as gpu:
        assert gpu.launch(lambda xp: 2).result(10) == 2


def test_after_an_flr_the_fb_is_all_zeros(make_host: MakeHost) -> None:
    hp = make_host()
    gpu = gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1))
    big = gpu.alloc(16 << 20, np.uint8)
    big.write(np.full(16 << 20, 0x5A, np.uint8))
    after = last_seq(hp)
    gpu.request_reset()
    wait_event(hp, flr_done(1), after=after)
    gpu.wait_ready()
    fresh = gpu.alloc(gpu.fb_size - RESERVED_SIZE, np.uint8)
    assert not fresh.view().any()
    head = np.frombuffer(gpu._fb.view(0, RESERVED_SIZE), np.uint8)  # info blocks aside
    assert not head[:PF2VF_OFFSET].any()
    gpu.close()


def test_status_shows_each_flr_take_its_spare_and_the_next_one_start(make_host: MakeHost) -> None:
    """`spares` in /status: engines started ahead of need and how many are done
    starting, so an operator (or a bench spacing its FLRs) can tell whether the next FLR
    waits for an interpreter start."""
    hp = make_host()

    def settled() -> dict[str, int] | None:
        spares = hp.status()["spares"]
        return spares if spares["kept"] and spares["ready"] == spares["kept"] else None

    kept = wait_until(settled, what="every spare done starting")["kept"]
    for _ in range(2):  # the second FLR takes the spare the first one started
        after = last_seq(hp)
        hp.admin.vf(0, "reset")
        wait_event(hp, flr_done(0), after=after)
        assert wait_until(settled, what="the refill done starting")["kept"] == kept


def test_a_failed_engine_restart_escalates_to_a_device_reset(make_host: MakeHost) -> None:
    # VF1's second engine start fails once: the FLR escalates, the device reset succeeds
    hp = make_host(env={"GPUVIRT_FAULT_ENGINE_START": "1:1:1"})
    with gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as gpu:
        after = last_seq(hp)
        hp.admin.vf(1, "reset")
        wait_event(hp, lambda e: e["kind"] == "device_reset.done", after=after)
        gpu.wait_ready()  # VF0 was reset too, and its guest came back
        assert gpu.resets == 1
        assert gpu.launch(lambda xp: 3).result(10) == 3
    assert hp.admin.vf(1)["state"] == "AVAIL"


def test_a_vf_whose_engine_never_restarts_is_failed(make_host: MakeHost) -> None:
    hp = make_host(env={"GPUVIRT_FAULT_ENGINE_START": "1:1:0"})
    after = last_seq(hp)
    hp.admin.vf(1, "reset")
    wait_event(hp, lambda e: e["kind"] == "device_reset.done", after=after)
    assert hp.admin.vf(1)["state"] == "FAILED"
    wait_state(hp, 0, "AVAIL")
    with gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as gpu:
        assert gpu.launch(lambda xp: 4).result(10) == 4
    with pytest.raises(gpuvirt.AuthRefusedError, match="disabled or failed"):
        gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1))
