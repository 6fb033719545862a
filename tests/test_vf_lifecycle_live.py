"""Random admin and guest actions against one live host, checked against a model of
the VF state table: every path ends in the state the table says, none in RESETTING."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuvirt
from gpuvirt.bench.common import host_config
from gpuvirt.errors import GpuvirtError
from gpuvirt.host.process import HostProcess
from helpers import MakeHost, hold_fullaccess, wait_state

pytestmark = pytest.mark.timeout(600)
GUARD = 2  # FLRs allowed in the window; the next one quarantines
ACTIONS = ("enable", "disable", "reset", "clear-guard", "clear-fb", "attach", "disable-in-init")


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostProcess]:
    work = tmp_path_factory.mktemp("live")
    cfg = host_config(work, sriov={"vf_num": 2}, reset={"guard_flr": f"{GUARD}/3600s"})
    hp = HostProcess(cfg, work / "run").start()
    yield hp
    hp.stop()


def _step(hp: HostProcess, action: str, vf: int, state: str, flrs: int) -> tuple[str, int]:
    """Do one action; return the (state, recent FLRs) the table predicts after it."""
    if action == "attach":
        if state != "AVAIL":
            with pytest.raises(gpuvirt.AuthRefusedError):
                gpuvirt.attach(vf=vf, socket=hp.socket, token=hp.token(vf))
            return state, flrs
        with gpuvirt.attach(vf=vf, socket=hp.socket, token=hp.token(vf)) as gpu:
            assert gpu.launch(lambda xp: vf + 100).result(30) == vf + 100
        wait_state(hp, vf, "AVAIL")  # the fini after the guest left
        return "AVAIL", flrs
    if action == "disable-in-init":  # a guest holds init access when the VF goes away
        if state != "AVAIL":
            return _step(hp, "disable", vf, state, flrs)
        with hold_fullaccess(hp, vf):
            assert hp.admin.vf(vf, "disable")["state"] == "UNAVAIL"
        return "UNAVAIL", flrs
    if action == "clear-fb" and state == "UNAVAIL":
        with pytest.raises(GpuvirtError, match="disabled"):
            hp.admin.vf(vf, action)
        return state, flrs
    hp.admin.vf(vf, action)
    if action == "enable":
        return ("AVAIL" if state == "UNAVAIL" else state), flrs
    if action == "disable":
        return "UNAVAIL", flrs
    if action == "reset" and state == "AVAIL":
        flrs += 1
        return ("QUARANTINED" if flrs > GUARD else "AVAIL"), flrs
    if action == "clear-guard":
        return ("AVAIL" if state == "QUARANTINED" else state), 0
    return state, flrs


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, 1)), max_size=8))
def test_random_actions_end_where_the_state_table_says(host: HostProcess, steps) -> None:
    model = {v["index"]: (v["state"], v["guard"]["recent_flrs"]) for v in host.status()["vfs"]}
    for action, vf in steps:
        model[vf] = _step(host, action, vf, *model[vf])
        got = {v["index"]: (v["state"], v["guard"]["recent_flrs"]) for v in host.status()["vfs"]}
        assert got == model, (action, vf)
    assert host.alive()


def test_the_daemon_hands_the_init_lock_on_once_a_guest_is_active(make_host: MakeHost) -> None:
    # GUEST_READY releases nothing in the table (tests/test_vf_states.py's model stops
    # there): Host.activate() must. If it forgot, VF1's init would wait for a lock that
    # VF0, ACTIVE and past its fullaccess timeout's reach, never gives back.
    hp = make_host(scheduler={"fullaccess_timeout_ms": 60_000})
    with gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as a:
        assert hp.admin.vf(0)["state"] == "ACTIVE"
        with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1), timeout=10) as b:
            assert hp.admin.vf(1)["state"] == "ACTIVE"
            assert b.launch(lambda xp: 1).result(30) == 1
        assert a.launch(lambda xp: 0).result(30) == 0
