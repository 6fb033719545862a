"""A guest's command queue against a real engine loop (emu, in a thread, over a real
socket pair): what a launch's future says, what travels on the wire for a launch
without arguments, and how a reset settles what is still pending."""

from __future__ import annotations

import os
import pickle
import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from gpuvirt.device.ctl import CTL_EXIT, CTL_GUEST
from gpuvirt.device.emu_executor import EmuExecutor
from gpuvirt.device.engine_loop import EngineLoop
from gpuvirt.device.process import send_fd
from gpuvirt.device.status import StatusArea, Word
from gpuvirt.errors import GpuvirtError, KernelError, VFResetError
from gpuvirt.guest.queue import CommandQueue, kernel
from gpuvirt.protocol.command import BufDesc, Kind, Message, Status, pack

FB_SIZE = 1 << 20
T = 5.0


class Engine:
    """An emu engine loop in a thread; `channel` is the guest's end of its command channel."""

    def __init__(self) -> None:
        self.fb = os.memfd_create("test-queue-fb", os.MFD_CLOEXEC)
        os.ftruncate(self.fb, FB_SIZE)
        self.status = StatusArea(StatusArea.create("test-queue-status"))
        self.ctl, engine_ctl = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.idle = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        loop = EngineLoop(EmuExecutor(self.fb, FB_SIZE), self.status, engine_ctl, self.idle)
        self.thread = threading.Thread(target=loop.serve, daemon=True)
        self.thread.start()
        self.channel, engine_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        send_fd(self.ctl, CTL_GUEST, engine_end.fileno())
        engine_end.close()

    def close(self) -> None:
        self.ctl.send(CTL_EXIT)
        self.thread.join(T)
        self.channel.close()
        os.close(self.fb)
        os.close(self.idle)


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine()
    try:
        yield e
    finally:
        e.close()


@pytest.fixture
def queue(engine: Engine) -> CommandQueue:
    return CommandQueue(engine.channel)


def _xp_name(xp: Any) -> str:
    return xp.__name__


def _fill(xp: Any, buf: Any, value: float = 0.0) -> float:
    buf[:] = value
    return float(buf.sum())


def _divide(xp: Any, by: int) -> float:
    return 1 / by


def test_a_launch_without_arguments_sends_an_empty_payload_and_runs(engine: Engine) -> None:
    """The wire form DESIGN.md's launch round trip relies on: an empty LAUNCH payload
    means fn(xp), nothing to unpickle (protocol.md, command channel)."""
    k = kernel(_xp_name)
    engine.channel.send(pack(Kind.DEFINE, kid=k.kid, payload=k.pickled()))
    engine.channel.send(pack(Kind.LAUNCH, seq=9, kid=k.kid))
    reply = Message.decode(engine.channel.recv(4096))
    assert (reply.kind, reply.seq, reply.flags) == (Kind.DONE, 9, Status.OK)
    assert pickle.loads(reply.payload) == "numpy"


def test_futures_carry_results_arguments_and_kernel_errors(queue: CommandQueue) -> None:
    desc = BufDesc(0, (16,), "float32")
    fill = queue.launch(kernel(_fill), (desc,), {"value": 2.0})
    bad = queue.launch(kernel(_divide), (0,), {})
    good = queue.launch(kernel(_divide), (4,), {})
    assert not bad.done()  # nothing is read until someone waits
    assert good.result(T) == 0.25  # reading up to it settles the ones before it
    assert fill.done() and bad.done()
    assert fill.result() == 32.0
    err = bad.exception()
    assert isinstance(err, KernelError) and "ZeroDivisionError" in str(err)
    with pytest.raises(KernelError, match="_divide raised in the engine"):
        bad.result()
    assert queue.completed == 3 and not queue.pending


def test_a_settled_future_answers_without_the_channel(engine: Engine, queue: CommandQueue) -> None:
    fut = queue.launch(kernel(_divide), (2,), {})
    assert fut.result(T) == 0.5
    engine.channel.shutdown(socket.SHUT_RDWR)
    assert fut.result(0) == 0.5 and fut.exception(0) is None


class _Unloadable:
    """Pickles in the engine, fails to unpickle anywhere: int("not a number")."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (int, ("not a number",))


def _returns_unloadable(xp: Any) -> _Unloadable:
    return _Unloadable()


def test_a_result_the_guest_cannot_unpickle_fails_that_launch_only(queue: CommandQueue) -> None:
    fut = queue.launch(kernel(_returns_unloadable), (), {})
    with pytest.raises(KernelError, match="_returns_unloadable returned a result this process"):
        fut.result(T)
    assert fut.done() and not queue.pending
    assert queue.launch(kernel(_divide), (2,), {}).result(T) == 0.5


def test_a_refused_request_is_a_gpuvirt_error_naming_it(queue: CommandQueue) -> None:
    fut = queue.copy_packed(Kind.COPY_IN, b"\0" * 5)  # not a whole descriptor
    with pytest.raises(GpuvirtError, match="COPY_IN refused by the engine: copy descriptors"):
        fut.result(T)


def test_a_reset_fails_every_pending_future_once(queue: CommandQueue) -> None:
    futs = [queue.launch(kernel(_divide), (1,), {}) for _ in range(3)]
    reset = VFResetError("VF 0 was reset")
    queue.fail_all(reset)
    for f in futs:
        assert f.done() and f.exception() is reset
        with pytest.raises(VFResetError):
            f.result()
    assert not queue.pending
    with pytest.raises(VFResetError):
        queue.launch(kernel(_divide), (1,), {})


def test_a_wait_that_passes_its_deadline_names_the_launch(queue: CommandQueue) -> None:
    def _sleep(xp: Any, s: float) -> None:
        import time

        time.sleep(s)

    fut = queue.launch(kernel(_sleep), (1.0,), {})
    with pytest.raises(TimeoutError, match=r"_sleep.*\(launch 1\) not done after 0.05 s"):
        fut.result(0.05)
    assert fut.result(T) is None


def test_status_words_count_launches_received_and_completed(
    engine: Engine, queue: CommandQueue
) -> None:
    for i in range(5):
        assert queue.launch(kernel(_divide), (i + 1,), {}).result(T) == 1 / (i + 1)
    assert engine.status[Word.RECEIVED] == 5 and engine.status[Word.COMPLETED] == 5
    assert engine.status[Word.CURRENT_SEQ] == 0


def test_buffers_reach_the_kernel_as_views_of_the_fb(engine: Engine, queue: CommandQueue) -> None:
    desc = BufDesc(4096, (4,), "float64")
    queue.launch(kernel(_fill), (), {"buf": desc, "value": 1.5}).result(T)
    fb = np.memmap(f"/proc/self/fd/{engine.fb}", dtype=np.float64, mode="r")
    assert list(fb[512:516]) == [1.5] * 4
