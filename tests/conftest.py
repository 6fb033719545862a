"""Fixtures: real host daemons in temporary directories, and ways to wait on them.

Waiting is always on something the host reports (its event log, long-polled
through the admin endpoint), never on a fixed sleep.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from gpuvirt.bench.common import host_config
from gpuvirt.device.cuda import GpuInfo, probe_gpu
from gpuvirt.errors import DeviceError
from gpuvirt.host.process import HostProcess
from helpers import MakeHost


@pytest.fixture
def make_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MakeHost]:
    started: list[HostProcess] = []

    def make(env: dict[str, str] | None = None, **sections: Any) -> HostProcess:
        work = tmp_path_factory.mktemp("host")
        sections.setdefault("sriov", {"vf_num": 2})
        hp = HostProcess(host_config(work, **sections), work / "run", env).start()
        started.append(hp)
        return hp

    yield make
    for hp in started:
        hp.stop()


@pytest.fixture(scope="module")
def gpu_info() -> GpuInfo:
    """The GPU the cuda tests run on; they skip without one, unless GPUVIRT_REQUIRE_CUDA=1
    (gpu-check) makes its absence a failure."""
    try:
        return probe_gpu()
    except DeviceError as e:
        if os.environ.get("GPUVIRT_REQUIRE_CUDA") == "1":
            pytest.fail(f"GPUVIRT_REQUIRE_CUDA=1 but: {e}")
        pytest.skip(str(e))
