"""The cuda backend sized from the whole device: a host without device.fb_total.

Its own module, on purpose: such a host carves every VF's FB from the free device
memory its probe measures, so it must be the only host of the suite alive. In
test_cuda_gpu.py a module-scoped host holds device memory until that module ends
(pytest finalizes module fixtures before the next module starts); a host sized
while it was alive found less than the layout the test expected, and all four VFs
FAILED inside the suite while passing alone (the H200 run of issue 30).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest

import gpuvirt
from gpuvirt.bench.common import SANDBOX_ENV
from gpuvirt.device.cuda import GpuInfo

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]


def _scale(xp: Any, a: Any, factor: float) -> str:
    a *= factor
    return xp.__name__


def test_default_layout_starts_every_vf_with_contexts_budgeted(
    gpu_info: GpuInfo, tmp_path: Path
) -> None:
    from gpuvirt.config import config_from_dict, load_or_create_token
    from gpuvirt.host.process import HostProcess

    # fb_total unset (scratch_host sets one): the VFs share the device less the budget.
    # engine.sandbox as every other host of the run (gpu-check's steps set it).
    sandbox = (
        {"engine": {"sandbox": os.environ[SANDBOX_ENV]}} if os.environ.get(SANDBOX_ENV) else {}
    )
    cfg = config_from_dict({
        "host": {"socket": str(tmp_path / "host.sock"), "admin": str(tmp_path / "admin.sock"),
                 "state_dir": str(tmp_path / "state")},
        "device": {"backend": "cuda"}, "sriov": {"vf_num": 4}, **sandbox,
    })  # fmt: skip
    with HostProcess(cfg, tmp_path / "run") as hp:
        vfs = hp.admin.status()["vfs"]
        why = [e["message"] for e in hp.admin.events(after=0) if e["vf"] is not None
               and "FAILED" in str(e.get("data", {}).get("new", ""))]  # fmt: skip
        assert [v["state"] for v in vfs] == ["AVAIL"] * 4, why  # none FAILED: every FB fitted
        assert all(v["context_bytes"] > 0 for v in vfs)
        # hp.token() sizes the layout, which on cuda without fb_total needs the device
        token = load_or_create_token(tmp_path / "state" / "vf3.token").hex()
        with gpuvirt.attach(vf=3, socket=hp.socket, token=token) as g:
            a = g.alloc(1 << 20, np.float32)
            a.write(np.ones(1 << 20, np.float32))
            assert g.launch(_scale, a, 2.0).result(timeout=60) == "cupy"
