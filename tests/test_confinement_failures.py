"""A confined engine's failure reaches the operator: its stderr comes back through a
pipe only the host reads, into the VF's FAILED reason and the event log."""

from __future__ import annotations

import pytest

from confine_env import unique_uid_base
from gpuvirt.device.faults import FAULT_ENV
from helpers import MakeHost, wait_event

pytestmark = pytest.mark.timeout(120)


def test_a_confined_engines_start_failure_says_why_in_the_event_log(make_host: MakeHost) -> None:
    # VF1's engine exits during every start, saying so on its stderr (the test fault)
    hp = make_host(
        env={FAULT_ENV: "1:0:0"},
        engine={"sandbox": "required", "uid_base": unique_uid_base()},
    )
    ev = wait_event(
        hp, lambda e: e["vf"] == 1 and e["kind"] == "transition" and e["data"]["new"] == "FAILED"
    )
    reason = ev["data"]["reason"]
    assert "exited" in reason, reason
    assert "engine stderr: gpuvirt engine: test fault (--fault-exit)" in reason, reason
    assert hp.admin.vf(1)["state"] == "FAILED"
    assert hp.admin.vf(0)["state"] == "AVAIL"  # the neighbour started, confined
