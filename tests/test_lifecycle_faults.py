"""Lifecycle paths under real faults: a disable during init, EMFILE in an FLR, a device
reset beside a quarantined VF, an engine that lies about its running kernel."""

from __future__ import annotations

import json
import os
import resource
import signal
import time
from pathlib import Path

import pytest

import gpuvirt
from helpers import MakeHost, hold_fullaccess, last_seq, wait_event, wait_until

pytestmark = pytest.mark.timeout(180)


def test_disable_during_fullaccess_lets_the_next_init_proceed(make_host: MakeHost) -> None:
    hp = make_host(scheduler={"fullaccess_timeout_ms": 120_000})
    s = hold_fullaccess(hp, 0)
    assert hp.admin.vf(0)["state"] == "FULLACCESS"
    assert hp.admin.vf(0, "disable")["state"] == "UNAVAIL"
    # GIM grants init access to one VF at a time: VF1's init waits on VF0's, which the
    # disable must have ended.
    with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)) as gpu:
        assert gpu.launch(lambda xp: 11).result(10) == 11
    s.close()
    assert hp.admin.vf(0, "enable")["state"] == "AVAIL"


def _events_file(hp) -> Path:
    return hp.config.host.state_path() / "events.jsonl"


def _wait_logged(path: Path, match, timeout: float = 60.0) -> dict:
    """The first event in the host's log file that `match` accepts (the admin endpoint
    cannot be asked: the host may open no descriptor at all)."""

    def logged() -> dict | None:
        return next((e for e in map(json.loads, path.read_text().splitlines()) if match(e)), None)

    return wait_until(logged, timeout, "the event logged", every=0.05)


def test_emfile_during_an_flr_leaves_the_vf_failed_not_resetting(make_host: MakeHost) -> None:
    hp = make_host()
    engine = hp.admin.vf(0)["engine_pid"]
    limits = resource.prlimit(hp.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(hp.pid, resource.RLIMIT_NOFILE, (0, limits[1]))  # no new fd at all
    try:
        os.kill(engine, signal.SIGKILL)
        failed = _wait_logged(
            _events_file(hp),
            lambda e: e["vf"] == 0 and e["kind"] == "transition" and e["data"]["new"] == "FAILED",
        )
    finally:
        resource.prlimit(hp.pid, resource.RLIMIT_NOFILE, limits)
    assert "Too many open files" in failed["data"]["reason"]
    assert hp.alive()
    assert hp.admin.vf(0)["state"] == "FAILED"
    kinds = [e["kind"] for e in hp.admin.events(vf=0)]
    assert "flr.scrub_failed" in kinds
    # an admin brings the VF back once descriptors are to be had again
    assert hp.admin.vf(0, "disable")["state"] == "UNAVAIL"
    assert hp.admin.vf(0, "enable")["state"] == "AVAIL"
    with gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as gpu:
        assert gpu.launch(lambda xp: 5).result(10) == 5


def test_a_device_reset_leaves_a_quarantined_vf_quarantined(make_host: MakeHost) -> None:
    # VF1's second engine start fails once: its FLR escalates to a device reset
    hp = make_host(reset={"guard_flr": "1/60s"}, env={"GPUVIRT_FAULT_ENGINE_START": "1:1:1"})
    assert hp.admin.vf(0, "reset")["state"] == "AVAIL"
    assert hp.admin.vf(0, "reset")["state"] == "QUARANTINED"
    after = last_seq(hp)
    hp.admin.vf(1, "reset")
    wait_event(hp, lambda e: e["kind"] == "device_reset.done", after=after)
    assert hp.admin.vf(0)["state"] == "QUARANTINED"
    assert hp.admin.vf(1)["state"] == "AVAIL"
    with pytest.raises(gpuvirt.AuthRefusedError, match="quarantined"):
        gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0))


def _liar(xp):
    """A hung kernel that rewrites its engine's CURRENT_SEQ and start time, as any
    kernel can: the status words are in the engine's own memory."""
    import gc

    from gpuvirt.device.status import StatusArea, Word

    st = next(o for o in gc.get_objects() if isinstance(o, StatusArea))
    seq = 1
    while True:
        st[Word.CURRENT_START_NS] = time.monotonic_ns() + 10**12
        st[Word.CURRENT_SEQ] = seq
        seq += 1


def test_a_kernel_faking_its_status_words_still_hits_job_timeout(make_host: MakeHost) -> None:
    hp = make_host(scheduler={"job_timeout_s": 1.0})
    with gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as gpu:
        after = last_seq(hp)
        fut = gpu.launch(_liar)
        with pytest.raises(gpuvirt.VFResetError):
            fut.result(60)
        start = wait_event(hp, lambda e: e["kind"] == "flr.start", after=after)
        assert (start["vf"], start["data"]["reason"]) == (0, "job_timeout")
        gpu.wait_ready()
        assert gpu.launch(lambda xp: 8).result(10) == 8


def test_emfile_in_engine_start_is_retried_and_ends_in_a_legal_state(make_host: MakeHost) -> None:
    hp = make_host()
    engine = hp.admin.vf(0)["engine_pid"]
    top = max(int(fd.name) for fd in Path(f"/proc/{hp.pid}/fd").iterdir())
    limits = resource.prlimit(hp.pid, resource.RLIMIT_NOFILE)
    # No fd above those open now: after the kill, the FLR gets only the few the dead
    # engine left, enough to renew the FB but not to spawn an engine and its spare.
    resource.prlimit(hp.pid, resource.RLIMIT_NOFILE, (top + 1, limits[1]))
    try:
        os.kill(engine, signal.SIGKILL)
        _wait_logged(_events_file(hp), lambda e: e["kind"] == "engine.start_error")
        done = _wait_logged(
            _events_file(hp), lambda e: e["kind"] in ("flr.done", "device_reset.done")
        )
    finally:
        resource.prlimit(hp.pid, resource.RLIMIT_NOFILE, limits)
    assert hp.alive()
    states = {v["index"]: v["state"] for v in hp.status()["vfs"]}
    assert set(states.values()) <= {"AVAIL", "FAILED"}, (done["kind"], states)
    tries = [e["data"]["attempt"] for e in hp.admin.events() if e["kind"] == "engine.start_error"]
    assert tries[:1] == [1] and max(tries) <= 3
    for vf, state in states.items():  # an admin brings back whatever failed
        if state == "FAILED":
            hp.admin.vf(vf, "disable")
            assert hp.admin.vf(vf, "enable")["state"] == "AVAIL"
    with gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as gpu:
        assert gpu.launch(lambda xp: 7).result(10) == 7
