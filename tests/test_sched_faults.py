"""The scheduler thread against real engines, faults and lies (no host around it)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from gpuvirt.defaults import IDLE_WAKES_MAX, MAX_TAKEN
from gpuvirt.device.base import Engine, EngineSpec, WSCommand
from gpuvirt.device.emu import EmuDevice
from gpuvirt.device.status import Word
from gpuvirt.errors import StateConflictError
from gpuvirt.host.sched import Policy, Scheduler
from helpers import wait_until

pytestmark = pytest.mark.timeout(120)
FB = 4 << 20
SLICE_MS = 2  # the rig's time slice


@dataclass
class Faults:
    seen: list[tuple[int | None, str, str]] = field(default_factory=list)
    event: threading.Event = field(default_factory=threading.Event)

    def __call__(self, vf: int | None, reason: str, detail: str) -> None:
        self.seen.append((vf, reason, detail))
        self.event.set()


@dataclass
class Rig:
    sched: Scheduler
    engines: list[Engine]
    faults: Faults


def channel() -> tuple[socket.socket, socket.socket]:
    """A VF's command channel: the guest's end, and the engine's, which the host watches
    as the VF's doorbell (host/sched/entry.py). Nothing reads the engine's end here, so
    what the guest sends stays queued: work the engine has not taken."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


@contextlib.contextmanager
def guests(r: Rig) -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    """A channel for every VF of the rig, its engine's end the VF's doorbell; at the end
    each VF loses its guest and both ends are closed."""
    chans = [channel() for _ in r.engines]
    for vf, (_guest, bell) in enumerate(chans):
        r.sched.set_guest(vf, bell.fileno()).result(10)
    try:
        yield chans
    finally:
        for vf, (guest, bell) in enumerate(chans):
            r.sched.set_guest(vf, None).result(10)
            guest.close()
            bell.close()


@pytest.fixture
def rig(request: pytest.FixtureRequest) -> Iterator[Callable[..., Rig]]:
    devs: list[EmuDevice] = []
    scheds: list[Scheduler] = []

    def make(policy: str, n: int, job_timeout_s: float = 30.0) -> Rig:
        dev = EmuDevice()
        devs.append(dev)
        engines = []
        for vf in range(n):
            dev.create_fb(vf, FB)
            e = dev.new_engine(EngineSpec(vf, FB))
            e.command(WSCommand.INIT_GPU, 60)
            engines.append(e)
        faults = Faults()
        sched = Scheduler(Policy(policy), SLICE_MS, 1000, job_timeout_s, faults)
        scheds.append(sched)
        sched.start()
        for vf, e in enumerate(engines):
            sched.add(vf, e, 1.0).result(10)
        return Rig(sched, engines, faults)

    yield make
    for s in scheds:
        if s.alive():
            s.stop()
    for d in devs:
        d.close()


def _anon_inodes() -> dict[str, int]:
    """This process's eventfds and epolls, by kind: what the scheduler opens itself."""
    kinds: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own fd, closed by now
        if target in ("anon_inode:[eventfd]", "anon_inode:[eventpoll]"):
            kinds[target] = kinds.get(target, 0) + 1
    return kinds


def test_a_stopped_scheduler_refuses_work_and_leaves_no_descriptor_open(rig) -> None:
    """Before, an op posted after stop() got a future nobody would ever answer (its
    caller waited out its own timeout), and the thread's eventfd and epoll stayed open
    for the process's life."""
    r = rig("liquid", 1)
    before = _anon_inodes()
    r.sched.stop()
    after = _anon_inodes()
    for kind in ("anon_inode:[eventfd]", "anon_inode:[eventpoll]"):
        assert after.get(kind, 0) == before[kind] - 1, (kind, before, after)
    with pytest.raises(StateConflictError, match="scheduler has stopped"):
        r.sched.set_weight(0, 2.0)
    r.sched.stop()  # a second stop is harmless
    assert r.sched.snapshot()["current"] is None  # status still answers: nothing runs


def test_an_exception_on_the_thread_resets_that_vf_and_the_others_keep_switching(rig) -> None:
    r = rig("round_robin", 3)
    chans = [channel() for _ in range(3)]
    for vf, (_guest, bell) in enumerate(chans):
        r.sched.set_guest(vf, bell.fileno()).result(10)
    chans[0][1].close()  # VF0's doorbell is gone under the thread: its next switch-in raises
    assert r.faults.event.wait(20)
    (vf, reason, detail), *_ = r.faults.seen
    assert (vf, reason) == (0, "sched_error") and "Bad file descriptor" in detail
    assert r.sched.alive()
    before = r.sched.snapshot()
    wait_until(lambda: r.sched.snapshot()["switches"] >= before["switches"] + 20)
    after = r.sched.snapshot()
    assert after["errors"] == 1 and after["vfs"][0]["faulted"]
    assert after["vfs"][0]["switches_in"] == before["vfs"][0]["switches_in"]
    assert after["vfs"][1]["switches_in"] > before["vfs"][1]["switches_in"]
    assert after["vfs"][2]["switches_in"] > before["vfs"][2]["switches_in"]
    for vf, (guest, bell) in enumerate(chans[1:], 1):
        r.sched.set_guest(vf, None).result(10)
        guest.close()
        bell.close()


def test_snapshots_from_another_thread_while_vfs_come_and_go(rig) -> None:
    r = rig("liquid", 3)
    errors: list[BaseException] = []
    stop = threading.Event()
    taken = [0]

    def reader() -> None:
        while not stop.is_set():
            try:
                r.sched.snapshot()
                taken[0] += 1
            except BaseException as e:  # every failure is the test's finding
                errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    try:
        guest, bell = channel()
        for i in range(150):
            r.sched.remove(2).result(10)
            r.sched.add(2, r.engines[2], 1.0).result(10)
            r.sched.set_guest(2, bell.fileno()).result(10)
            if i % 2:  # watched, then work: the selector's map changes
                guest.send(b"launch")
            elif i:
                bell.recv(64)  # the last one taken, as the engine takes it
    finally:
        stop.set()
        t.join()
        r.sched.set_guest(2, None).result(10)
        guest.close()
        bell.close()
    assert errors == [] and taken[0] > 150
    assert r.sched.alive() and r.faults.seen == []


def test_a_flooded_channel_is_bounded_and_wakes_the_thread_once_per_slice(rig) -> None:
    r = rig("liquid", 2)
    with guests(r) as chans:
        before = r.sched.snapshot()
        r.engines[1].status[Word.RECEIVED] = 1 << 62  # its engine: "I took 2**62 launches"
        guest = chans[1][0]
        sent = 0
        for _ in range(20_000):  # ...and a message storm on top, as fast as the channel takes it
            try:
                guest.send(b"launch", socket.MSG_DONTWAIT)
                sent += 1
            except BlockingIOError:
                pass  # full: the storm goes on against a full channel
        wait_until(lambda: r.sched.snapshot()["current"] == 1)
        after = r.sched.snapshot()
        assert sent > 0 and after["vfs"][1]["pending"] <= MAX_TAKEN + 1
        woke = after["wakeups"] - before["wakeups"]
        switched = after["switches"] - before["switches"]
        assert woke <= 2 * switched + 10, (woke, switched)


def test_a_guest_that_closes_its_channel_wakes_the_thread_once_not_for_ever(rig) -> None:
    """The host watches the engine's end of the channel, and a closed guest end leaves it
    readable for good (end of file). Edge-triggered, that is one wake-up; level-triggered
    it was one per turn of the thread's loop for as long as the VF waits off the device."""
    r = rig("liquid", 2)
    with guests(r) as chans:
        chans[0][0].send(b"launch")  # VF0: a launch never taken, so it always has the device
        wait_until(lambda: r.sched.snapshot()["current"] == 0)
        before = r.sched.snapshot()
        chans[1][0].close()  # VF1's guest goes; its VF stays off the device, watched
        fifty_slices = 50 * SLICE_MS * 1_000_000
        wait_until(lambda: r.sched.snapshot()["elapsed_ns"] - before["elapsed_ns"] > fifty_slices)
        after = r.sched.snapshot()
        assert after["vfs"][1]["pending"] == 0 and after["current"] == 0
        woke = after["wakeups"] - before["wakeups"]
        assert woke < 50, f"{woke} wake-ups in 50 slices after one end of file"


def test_a_vf_stopped_while_taking_a_message_still_gets_its_turn(rig) -> None:
    """SIGSTOP lands when a system call returns, so an emu engine is often stopped just
    after the read that emptied its channel, before it counted the launch: the channel
    shows nothing and RECEIVED nothing new. Its TAKING word says it holds one; read
    without it, such a VF had no work and was never picked again beside a busy one."""
    r = rig("liquid", 2)
    with guests(r) as chans:
        chans[0][0].send(b"launch")  # VF0: a launch never taken, so it always has work
        wait_until(lambda: r.sched.snapshot()["current"] == 0)
        before = r.sched.snapshot()["vfs"][1]["switches_in"]
        r.engines[1].status[Word.TAKING] = 1  # VF1's engine: stopped right after its read
        wait_until(lambda: r.sched.snapshot()["vfs"][1]["switches_in"] > before)


def test_an_engine_faking_its_running_kernel_still_hits_job_timeout(rig) -> None:
    r = rig("fairness", 1, job_timeout_s=0.3)
    st = r.engines[0].status  # the engine's own status words, as its kernel can write them
    seq = 1
    while not r.faults.event.is_set():
        # A new kernel id every write and a start time in the future: were either believed,
        # the hung kernel's own device time would never reach job_timeout.
        st[Word.CURRENT_START_NS] = time.monotonic_ns() + 10**12
        st[Word.CURRENT_SEQ] = seq
        seq += 1
        assert seq < 50_000_000, "job_timeout never tripped"
    (vf, reason, _detail), *_ = r.faults.seen
    assert (vf, reason) == (0, "job_timeout")


def test_an_idle_signal_storm_wakes_the_thread_a_bounded_number_of_times_a_slice(rig) -> None:
    r = rig("liquid", 2)
    with guests(r) as chans:
        for guest, _bell in chans:
            guest.send(b"launch")  # one launch each that is never taken: both stay busy
        wait_until(lambda: r.sched.snapshot()["current"] is not None)
        before = r.sched.snapshot()
        for _ in range(20_000):  # the engine's "my queue drained" eventfd, written as it can
            for e in r.engines:
                os.eventfd_write(e.idle_fd(), 1)
        after = r.sched.snapshot()
        woke = after["wakeups"] - before["wakeups"]
        slices = after["switches"] - before["switches"] + 1
        assert woke <= (IDLE_WAKES_MAX + 2) * slices + 10, (woke, slices)


def test_a_parked_vf_running_a_launch_it_never_rang_for_still_hits_job_timeout(rig) -> None:
    """A drained VF kept on the device holds no slice and is charged nothing: were it
    looked at again only when a message reaches its channel, a kernel its engine runs
    with nothing sent for it (a tenant's thread starts one) would run uncharged and past
    job_timeout for as long as nobody else wanted the device."""
    r = rig("liquid", 1, job_timeout_s=0.3)
    guest, bell = channel()
    r.sched.set_guest(0, bell.fileno()).result(10)
    st = r.engines[0].status  # the engine's own words, as its kernel can write them
    guest.send(b"launch")  # one launch...
    wait_until(lambda: r.sched.snapshot()["current"] == 0)
    bell.recv(64)  # ...taken by the engine...
    st[Word.RECEIVED] += 1
    st[Word.COMPLETED] += 1  # ...and done: nothing pending, nobody else, so it parks
    wait_until(lambda: r.sched.snapshot()["vfs"][0]["parked"])
    st[Word.CURRENT_START_NS] = time.monotonic_ns()  # then a kernel, nothing sent for it
    st[Word.CURRENT_SEQ] = 1
    assert r.faults.event.wait(30), r.sched.snapshot()["vfs"][0]
    (vf, reason, _detail), *_ = r.faults.seen
    assert (vf, reason) == (0, "job_timeout")
    r.sched.set_guest(0, None).result(10)
    guest.close()
    bell.close()
