"""bench netgpu's own setup (the suite itself runs in test_bench.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpuvirt.bench import netgpu_send
from gpuvirt.bench.netgpu_send import Placement, place


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.fixture
def my_cpus() -> Iterator[set[int]]:
    """This thread's CPUs, given back after the test (place() pins the caller)."""
    mine = os.sched_getaffinity(0)
    yield mine
    os.sched_setaffinity(0, mine)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to keep one free")
def test_the_sender_is_kept_off_the_engines_cpus_and_the_receiver_off_the_senders(
    my_cpus: set[int],
) -> None:
    device = {max(my_cpus)}
    engine, sender = _sleeper(), _sleeper()
    try:
        os.sched_setaffinity(engine.pid, device)
        got = place(sender.pid, engine.pid)
        assert os.sched_getaffinity(sender.pid) == set(got.sender)
        assert os.sched_getaffinity(0) == set(got.receiver)
        assert got.sender and not set(got.sender) & device
        assert got.receiver and not set(got.receiver) & set(got.sender)
        if len(my_cpus) == 2:  # the one CPU left for the receiver is the device's
            assert got == Placement(sorted(my_cpus - device), sorted(device))
        else:  # a CPU of its own, off the device's too
            assert not set(got.receiver) & device
    finally:
        for p in (engine, sender):
            p.kill()
            p.wait()


def test_a_sender_beside_an_engine_that_may_run_anywhere_may_too(my_cpus: set[int]) -> None:
    engine, sender = _sleeper(), _sleeper()
    try:
        assert place(sender.pid, engine.pid) == Placement(sorted(my_cpus), sorted(my_cpus))
        assert os.sched_getaffinity(sender.pid) == my_cpus
        assert os.sched_getaffinity(0) == my_cpus
    finally:
        for p in (engine, sender):
            p.kill()
            p.wait()


def test_the_sender_paces_nothing_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its sockets use SENDER_CC (no internal pacing timer) where the kernel has it."""
    with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
        offered = f.read().split()
    made: list[socket.socket] = []
    connect = socket.create_connection

    def recorded(*a: Any, **kw: Any) -> socket.socket:
        made.append(connect(*a, **kw))
        return made[-1]

    monkeypatch.setattr(netgpu_send.socket, "create_connection", recorded)
    seen: list[bytes] = []

    def receive(ls: socket.socket) -> None:
        c, _ = ls.accept()
        while c.recv(1 << 16):
            pass
        # the sender has sent it all and waits for this close: its socket is still open
        seen.append(made[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16))
        c.close()

    with socket.create_server(("127.0.0.1", 0)) as ls:
        t = threading.Thread(target=receive, args=(ls,))
        t.start()
        data = memoryview(bytes(1 << 16))
        netgpu_send._send_all(data, ls.getsockname()[1], 1, 1 << 16, framed=False)
        t.join(10)
    want = netgpu_send.SENDER_CC if netgpu_send.SENDER_CC in offered else None
    assert netgpu_send.sender_cc() == want
    if want is not None:
        assert seen[0].rstrip(b"\0") == want.encode()


def test_a_trial_reports_the_watched_processes_cpu_beside_the_receivers() -> None:
    from gpuvirt.bench import netgpu_cpu

    watch = {"me": os.getpid(), "gone": 2**22 + 1}  # pid_max is at most 2**22
    before = netgpu_cpu.sample(watch)
    t = time.process_time()
    while time.process_time() - t < 0.05:  # work, counted both ways
        pass
    got = netgpu_cpu.per_gb(before, netgpu_cpu.sample(watch), 0.5, 0.05)
    assert set(got) == {
        "cpu_s_per_gb", "rx_preempted_per_gb", "busy_cpus", "me_cpu_s_per_gb",
        "gone_cpu_s_per_gb",
    }  # fmt: skip
    assert got["cpu_s_per_gb"] > 0 and got["me_cpu_s_per_gb"] > 0
    assert got["busy_cpus"] >= 0
    assert got["gone_cpu_s_per_gb"] == 0  # a process that is not there counts nothing
