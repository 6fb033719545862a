"""Poll before sleeping (gpuvirt/poll.py): the window's rule, and both ends using it.

The rule is checked by feeding it waits, the ends by running real launches
through a host; never by how long anything took.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpuvirt
from gpuvirt.errors import GpuvirtError
from gpuvirt.poll import GROW_FROM, PollWindow, poll_limit_ns
from helpers import MakeHost

LIMIT = 200_000


def test_a_short_wait_that_polling_missed_grows_the_window_to_the_limit() -> None:
    w = PollWindow(LIMIT)
    w.window_ns = 0
    w.slept(LIMIT // 2)
    assert w.window_ns == LIMIT // GROW_FROM
    for _ in range(8):
        w.slept(LIMIT // 2)
    assert w.window_ns == LIMIT


def test_long_waits_shrink_it_to_nothing_and_a_short_one_brings_it_back() -> None:
    w = PollWindow(LIMIT)
    for _ in range(3):
        w.slept(10 * LIMIT)
    assert w.window_ns == 0
    assert w.poll(lambda: pytest.fail("a closed window must not poll")) is None
    w.slept(LIMIT // 10)
    assert w.window_ns > 0


def test_a_limit_of_zero_never_polls() -> None:
    w = PollWindow(0)
    for _ in range(4):
        w.slept(1)
    assert w.window_ns == 0
    assert w.poll(lambda: pytest.fail("polling is off")) is None


def test_poll_returns_what_the_attempt_got_after_as_many_tries_as_it_took() -> None:
    tries = iter([None, None, 7])
    assert PollWindow(10**9).poll(lambda: next(tries)) == 7


def test_a_poll_that_shared_its_cpu_stops_polling_for_longer_each_time_in_a_row() -> None:
    w = PollWindow(LIMIT)
    backoffs = []
    for _ in range(10):
        w._yielded(away_ns=990, wall_ns=1000)  # the peer ran while we yielded
        backoffs.append(w.backoff)
    # the second shared poll in a row stops polling, each one after it for twice as long
    assert backoffs == [0, 2, 4, 8, 16, 32, 64, 128, 256, 256]
    assert w.window_ns == 0
    for _ in range(256):
        w.slept(LIMIT // 2)
        assert w.window_ns == 0  # not polling again until the backoff has run out
    w.slept(LIMIT // 2)
    assert w.window_ns > 0
    w._yielded(away_ns=100, wall_ns=1000)  # a poll on a CPU of its own: the streak ends
    w._yielded(away_ns=990, wall_ns=1000)
    assert (w.backoff, w.shared) == (0, 1)
    w._yielded(away_ns=990, wall_ns=1000)
    assert (w.backoff, w.window_ns) == (2, 0)


def test_a_thread_that_runs_now_and_then_on_the_pollers_cpu_never_stops_its_polling() -> None:
    """A host thread's timer firing on the guest's CPU takes one poll's yield, now and
    then: polling goes on (it stopped for 2 waits each time: 2–6 % of a launch bench's
    waits blocking on a VM where a blocked wait costs a cross-CPU wake-up)."""
    w = PollWindow(LIMIT)
    for _ in range(5):
        w._yielded(away_ns=990, wall_ns=1000)
        assert (w.window_ns, w.backoff) == (LIMIT, 0)
        w._yielded(away_ns=0, wall_ns=1000)


@given(st.lists(st.integers(min_value=0, max_value=10 * LIMIT), max_size=60))
def test_the_window_never_leaves_zero_to_limit(waits: list[int]) -> None:
    w = PollWindow(LIMIT)
    for ns in waits:
        w.slept(ns)
        assert 0 <= w.window_ns <= LIMIT
        assert w.window_ns == 0 or w.window_ns >= LIMIT // GROW_FROM


@pytest.mark.parametrize("value", ["x", "-1", "1.5", "2000000"])
def test_a_bad_poll_setting_is_refused_by_name(value: str) -> None:
    with pytest.raises(GpuvirtError, match="GPUVIRT_POLL_US"):
        poll_limit_ns(value)


def test_the_poll_setting_defaults_and_zero_is_off() -> None:
    assert poll_limit_ns(None) == poll_limit_ns("") > 0
    assert poll_limit_ns("0") == 0


def test_attach_refuses_a_bad_poll_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUVIRT_POLL_US", "soon")
    with pytest.raises(GpuvirtError, match="GPUVIRT_POLL_US='soon'"):
        gpuvirt.attach(vf=0, socket="/nonexistent", token="00" * 32)


def test_a_tenant_whose_kernels_run_long_stops_polling(make_host: MakeHost) -> None:
    hp = make_host()
    with gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as gpu:
        queue = gpu._queue
        assert queue is not None and queue._poll.window_ns > 0
        for _ in range(4):  # each wait outlasts the limit many times over: the window halves
            assert gpu.launch(_sleep, 0.02).result(timeout=30) == "slept"
        assert queue._poll.window_ns == 0


def test_launches_are_right_with_polling_off_at_both_ends(make_host: MakeHost) -> None:
    hp = make_host(engine={"poll_us": 0})
    env = {"GPUVIRT_POLL_US": "0"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        with gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as gpu:
            assert gpu._queue is not None and gpu._queue._poll.limit_ns == 0
            assert [gpu.launch(_square, i).result(timeout=30) for i in range(50)] == [
                i * i for i in range(50)
            ]


def _sleep(xp: object, s: float) -> str:
    import time

    time.sleep(s)  # the tenant's kernel is slow; this is the workload, not a wait in a test
    return "slept"


def _square(xp: object, i: int) -> int:
    return i * i


def test_a_poll_whose_yields_let_a_busy_peer_run_counts_as_shared() -> None:
    """Real processes on one CPU: every yield hands it to a spinning peer, which the
    window sees in how long its yields took, and at the second such poll it stops
    polling."""
    cpu = min(os.sched_getaffinity(0))
    saved = os.sched_getaffinity(0)
    peer = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(peer.pid, {cpu})
        os.sched_setaffinity(0, {cpu})
        w = PollWindow(10**10)
        for shared, window, backoff in ((1, 10**10, 0), (2, 0, 2)):
            assert w.poll(iter([None] * 5 + [7]).__next__) == 7
            assert (w.shared, w.window_ns, w.backoff) == (shared, window, backoff)
    finally:
        os.sched_setaffinity(0, saved)
        peer.kill()
        peer.wait()


def test_a_poll_whose_only_yield_was_bare_ends_a_streak_of_shared_polls() -> None:
    """A poll's first yield is its own bare cost (nothing counted away), so a poll that
    yielded once judged its CPU its own: the streak of shared polls before it ends, and
    polling stops again only after two more in a row, for 2 waits, not twice the last
    backoff."""
    w = PollWindow(10**10)
    w.shared = 3
    w.bare_yield_ns = 10**15  # whatever this yield takes, it is the quickest seen
    tries = iter([None, 7])
    assert w.poll(lambda: next(tries)) == 7
    assert w.shared == 0
