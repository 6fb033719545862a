"""Engine.switch_out on the preemptive backend (emu): the VF is stopped where it stands,
mid-kernel, its slice charged until the stop was issued, and the stop may be posted.
The cooperative counterpart is in tests/test_cuda_cpu.py."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np

from gpuvirt.device.base import EngineSpec, SwitchLimits, WSCommand
from gpuvirt.device.emu import EmuDevice
from gpuvirt.device.status import Word
from gpuvirt.guest.queue import kernel
from gpuvirt.protocol.command import BufDesc
from gpuvirt.protocol.info import RESERVED_SIZE
from helpers import guest_queue, wait_until

cloudpickle.register_pickle_by_value(sys.modules[__name__])

FB = 4 << 20
T = 5.0
LIMITS = SwitchLimits(cmd_s=T, coop_idle_s=T)


def _wait_then_stamp(xp: Any, a: Any, flag: str) -> None:
    while not os.path.exists(flag):  # ends only once the test lets it
        time.sleep(0.001)
    a[0] = time.monotonic_ns()  # when the kernel ended, on the host's clock


def test_switch_out_stops_an_emu_vf_mid_kernel_and_may_post_the_stop(tmp_path: Path) -> None:
    dev = EmuDevice()
    try:
        fb = dev.create_fb(0, FB)
        e = dev.new_engine(EngineSpec(0, FB))
        e.command(WSCommand.INIT_GPU, 60)
        e.command(WSCommand.RUN_GPU, T)
        q = guest_queue(e)
        stamp = BufDesc(RESERVED_SIZE, (1,), "<i8")
        flag = tmp_path / "end"
        fut = q.launch(kernel(_wait_then_stamp), (stamp,), {"flag": str(flag)})
        wait_until(lambda: e.status[Word.CURRENT_SEQ], T, "the kernel running")
        out = e.switch_out(LIMITS, post=True)
        assert e.settle()  # the posted stop (or the one waited for) has landed
        assert e.status[Word.COMPLETED] == 0  # stopped mid-kernel
        flag.touch()
        assert set(e.switch_in(LIMITS)) == {"LOAD_GPU_STATE", "RUN_GPU"}
        assert fut.result(timeout=T) is None
        ended = int(np.frombuffer(os.pread(fb, 8, RESERVED_SIZE), "<i8")[0])
        assert out.until_ns < ended  # charged until the stop, not the kernel's end
        assert out.busy_ns is None  # emu's device time is the wall's
        # Posted where the engine could be raised for its stop (root here; CI too).
        assert out.posted == (os.geteuid() == 0)
        q.close()
    finally:
        dev.close()
