"""Device time measured by the device (BUSY_NS): the cuda engine's BusyClock and the
engine loop that publishes it, on the CPU.

CUDA cannot run here, so the clock is driven through a stand-in for `cupy.cuda`
whose events are stamped by a device clock the kernels themselves advance: a
launch's device time is then known exactly. Everything else is the real thing: the
cooperative engine loop (in a thread), its status area, control socket and the
guest's command queue. What the events see on a GPU is docs/cuda.md, "Device time".
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpuvirt.defaults import DEVICE_DISAGREE_PP
from gpuvirt.device import make_device
from gpuvirt.device.base import EngineSpec, WSCommand
from gpuvirt.device.ctl import CTL_EXIT, CTL_GUEST, CTL_WAKE
from gpuvirt.device.cuda import CoopEngine
from gpuvirt.device.cuda_executor import BusyClock
from gpuvirt.device.emu_executor import EmuExecutor
from gpuvirt.device.engine_loop import CoopEngineLoop
from gpuvirt.device.process import send_fd
from gpuvirt.device.status import StatusArea, Word
from gpuvirt.guest.queue import CommandQueue, kernel
from gpuvirt.host.status import disagrees, flag_disagreements
from gpuvirt.protocol.command import Copy, Kind
from gpuvirt.protocol.info import RESERVED_SIZE

MS = 1_000_000
FB_SIZE = 1 << 20
T = 5.0


class DeviceClock:
    """Stands in for `cupy.cuda`: an event records the device clock's reading, which only
    the device's work (the kernels below) moves."""

    def __init__(self) -> None:
        self.now = 0
        self.waits = 0  # Event.synchronize calls: the loop should need none of its own

    def Event(self) -> _Event:  # CuPy's name
        return _Event(self)

    def get_elapsed_time(self, start: _Event, end: _Event) -> float:
        return (end.at - start.at) / 1e6  # ms, as CUDA gives it


class _Event:
    def __init__(self, clock: DeviceClock) -> None:
        self.clock, self.at = clock, -1

    def record(self, stream: Any = None) -> None:
        self.at = self.clock.now

    def synchronize(self) -> None:
        self.clock.waits += 1


CLOCK = DeviceClock()  # the loop's device: its executor's xp, so kernels reach it


def _device_work(xp: DeviceClock, ns: int) -> None:
    xp.now += ns


def _work_then_raise(xp: DeviceClock, ns: int) -> None:
    xp.now += ns
    raise RuntimeError("the tenant's kernel raised after queuing its work")


def test_busy_word_is_engine_written_and_its_own() -> None:
    assert Word.BUSY_NS < 64  # words 0..63 are the engine's
    assert len({int(w) for w in Word}) == len(Word)


def test_clock_takes_each_launch_once_and_late() -> None:
    clock = DeviceClock()
    busy = BusyClock(clock, stream=None)
    assert busy.take() == 0  # nothing marked yet
    assert busy.start() == 0
    clock.now += 3 * MS
    busy.stop()
    clock.now += 7 * MS  # between launches: not the VF's device time
    assert busy.start() == 3 * MS  # the launch before, taken as the next begins
    clock.now += 5 * MS
    busy.stop()
    assert busy.take() == 5 * MS
    assert busy.take() == 0  # taken once


def test_emu_engines_have_no_device_clock() -> None:
    """On emu the device's time is the host's wall clock: busy_ns() is None, for emu's
    own engine and for a cooperative engine over an emu FB (whose word nobody writes)."""
    dev = make_device("emu")
    fb = os.memfd_create("test-busy-fb", os.MFD_CLOEXEC)
    os.ftruncate(fb, FB_SIZE)
    dev.create_fb(0, FB_SIZE)
    engines = [
        dev.new_engine(EngineSpec(0, FB_SIZE)),
        CoopEngine(EngineSpec(1, FB_SIZE), fb, "emu"),
    ]
    try:
        for e in engines:
            e.command(WSCommand.INIT_GPU, 30)
            assert e.busy_ns() is None
    finally:
        for e in engines:
            e.kill()
        os.close(fb)
        dev.close()


class Loop:
    """A cooperative engine loop in a thread over an emu FB, with a BusyClock on CLOCK."""

    def __init__(self) -> None:
        self.fb = os.memfd_create("test-busy-fb", os.MFD_CLOEXEC)
        os.ftruncate(self.fb, FB_SIZE)
        executor = EmuExecutor(self.fb, FB_SIZE)
        executor.busy = BusyClock(CLOCK, stream=None)  # type: ignore[attr-defined]
        executor.xp = CLOCK
        self.status = StatusArea(StatusArea.create("test-busy-status"))
        self.ctl, engine_ctl = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.idle = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.loop = CoopEngineLoop(executor, self.status, engine_ctl, self.idle)
        self.thread = threading.Thread(target=self.loop.serve, daemon=True)
        self.thread.start()
        guest, engine_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        send_fd(self.ctl, CTL_GUEST, engine_end.fileno())
        engine_end.close()
        self.queue = CommandQueue(guest)
        self.serial = 0

    def command(self, cmd: WSCommand) -> None:
        self.serial += 1
        self.status[Word.CMD_CODE] = cmd
        self.status[Word.CMD_SERIAL] = self.serial
        self.ctl.send(CTL_WAKE)
        deadline = time.monotonic() + T
        while self.status[Word.ACK_SERIAL] < self.serial:
            assert time.monotonic() < deadline, f"{cmd.name} not acknowledged"
            self.ctl.recv(64)

    def launch(self, fn: Any, ns: int) -> Any:
        return self.queue.launch(kernel(fn), (), {"ns": ns})

    def close(self) -> None:
        self.ctl.send(CTL_EXIT)
        self.thread.join(T)
        self.queue.close()
        os.close(self.fb)


@pytest.fixture
def loop() -> Iterator[Loop]:
    lp = Loop()
    try:
        yield lp
    finally:
        lp.close()


def test_loop_publishes_each_launchs_device_time_by_idle(loop: Loop) -> None:
    loop.command(WSCommand.RUN_GPU)
    loop.launch(_device_work, 3 * MS).result(timeout=T)
    assert loop.status[Word.BUSY_NS] == 0  # taken when the next launch begins
    waits = CLOCK.waits
    loop.launch(_device_work, 5 * MS).result(timeout=T)
    assert loop.status[Word.BUSY_NS] == 3 * MS
    CLOCK.now += 11 * MS  # the device busy with nothing of this VF's: not counted
    loop.command(WSCommand.IDLE_GPU)
    # IDLE drains: the slice's device time is all in the word when it is acknowledged
    assert loop.status[Word.BUSY_NS] == 8 * MS
    assert CLOCK.waits - waits == 2  # one per launch taken, none added on the launch path


def test_a_kernel_that_raises_still_pays_for_its_work(loop: Loop) -> None:
    loop.command(WSCommand.RUN_GPU)
    with pytest.raises(Exception, match="raised after queuing"):
        loop.launch(_work_then_raise, 4 * MS).result(timeout=T)
    loop.command(WSCommand.IDLE_GPU)
    assert loop.status[Word.BUSY_NS] == 4 * MS
    assert loop.status[Word.FAILED] == 1


def test_copies_are_device_time_too(loop: Loop) -> None:
    loop.command(WSCommand.RUN_GPU)
    waits = CLOCK.waits
    loop.queue.copy(Kind.COPY_IN, Copy(RESERVED_SIZE, 0, 4096)).result(timeout=T)
    loop.command(WSCommand.IDLE_GPU)
    assert loop.status[Word.COMPLETED] == 1
    assert CLOCK.waits - waits == 1  # marked and taken like a launch (emu's moves no clock)


# ---- what the host reports: /status, /sched, /metrics, vf list -----------------------------


def test_a_disagreement_over_one_point_is_flagged() -> None:
    assert not disagrees({"device_ns": 5})  # no device measure (emu): never
    assert not disagrees({"disagree_pp": None})
    assert not disagrees({"disagree_pp": DEVICE_DISAGREE_PP})
    assert disagrees({"disagree_pp": DEVICE_DISAGREE_PP + 0.01})
    snap = flag_disagreements({"vfs": {0: {"disagree_pp": 2.5}, 1: {"disagree_pp": 0.2}}})
    assert [r["device_disagrees"] for r in snap["vfs"].values()] == [True, False]


def test_vf_list_shows_the_gap_and_flags_it() -> None:
    from rich.console import Console

    from gpuvirt.bench.common import scratch_host
    from gpuvirt.cli.vf import vf_table

    with scratch_host(sriov={"vf_num": 1}) as hp:
        row = hp.admin.vf(0)

    def render(v: dict[str, Any]) -> str:
        console = Console(width=250, record=True)
        console.print(vf_table([v]))
        return console.export_text()

    assert "dev/wall" in render(row) and "pp" not in render(row)  # emu: one clock
    assert "0.4pp" in render({**row, "disagree_pp": 0.4, "device_disagrees": False})
    assert "2.3pp !" in render({**row, "disagree_pp": 2.3, "device_disagrees": True})


def test_host_on_emu_reports_device_and_wall_time_as_one(make_host: Any) -> None:
    """On emu the device's time is the host's wall clock: the figures are there, equal,
    and nothing disagrees; in /status, /sched and /metrics alike."""
    hp = make_host(sriov={"vf_num": 2})
    st = hp.status()
    assert st["sched"]["device_disagrees"] is False and st["sched"]["disagree_pp_max"] == 0
    for v in st["vfs"]:
        assert v["wall_ms"] >= v["device_ms"] >= 0
        assert v["disagree_pp"] in (None, 0, 0.0) and v["device_disagrees"] is False
    rows = hp.admin.request("GET", "/sched")["vfs"].values()
    assert all(r["device_disagrees"] is False for r in rows)
    text, _ = hp.admin.raw("GET", "/metrics")
    for name in ("gpuvirt_vf_wall_seconds_total", "gpuvirt_vf_device_disagreement_pp",
                 "gpuvirt_vf_device_disagrees"):  # fmt: skip
        assert f'{name}{{vf="0"}}' in text.decode(), name
    assert 'gpuvirt_vf_device_disagrees{vf="1"} 0.0' in text.decode()
