"""The scheduler thread's inbox (host/sched/ops.py), with its real eventfd."""

from __future__ import annotations

import select
import threading

import pytest

from gpuvirt.host.sched.ops import Ops


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_ops_posted_from_other_threads_run_in_order_and_answer_their_futures() -> None:
    ops, seen = Ops(), []
    futs: list = []
    posters = [
        threading.Thread(target=lambda i=i: futs.append(ops.call(seen.append, i))) for i in range(8)
    ]
    for t in posters:
        t.start()
        t.join()
    assert _readable(ops.fd), "a post wakes the thread"
    ops.woken()
    assert not _readable(ops.fd)
    assert ops.run() == 8
    assert seen == list(range(8))
    assert all(f.done() and f.result() is None for f in futs)
    assert ops.run() == 0


def test_an_op_that_raises_fails_its_own_future_and_not_the_others() -> None:
    ops = Ops()
    bad = ops.call(lambda: 1 // 0)
    good = ops.call(lambda: "fine")
    later = ops.post(lambda fut: None)  # answered later, by whoever holds fut
    assert ops.run() == 3
    with pytest.raises(ZeroDivisionError):
        bad.result(0)
    assert good.result(0) == "fine"
    assert not later.done()
