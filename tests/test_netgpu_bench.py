"""bench netgpu's own setup (the suite itself runs in test_bench.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpuvirt.bench.netgpu_send import place_sender


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to keep one free")
def test_the_sender_is_kept_off_the_engines_cpus() -> None:
    mine = os.sched_getaffinity(0)
    device = {max(mine)}
    engine, sender = _sleeper(), _sleeper()
    try:
        os.sched_setaffinity(engine.pid, device)
        assert place_sender(sender.pid, engine.pid) == sorted(mine - device)
        assert os.sched_getaffinity(sender.pid) == mine - device
    finally:
        for p in (engine, sender):
            p.kill()
            p.wait()


def test_a_sender_beside_an_engine_that_may_run_anywhere_may_too() -> None:
    mine = os.sched_getaffinity(0)
    engine, sender = _sleeper(), _sleeper()
    try:
        assert place_sender(sender.pid, engine.pid) == sorted(mine)
        assert os.sched_getaffinity(sender.pid) == mine
    finally:
        for p in (engine, sender):
            p.kill()
            p.wait()


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
