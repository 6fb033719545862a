"""Fixtures: real host daemons in temporary directories, and ways to wait on them.

Waiting is always on something the host reports (its event log, long-polled
through the admin endpoint), never on a fixed sleep.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gpuvirt.bench.common import host_config
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
