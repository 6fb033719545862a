"""`gpuvirt vf set`: a VF's FB and weight changed on a running host, and every refusal.

The parser is property-tested; the rest runs against real hosts through the
admin endpoint (raw HTTP where the body itself is under test) and the CLI.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpuvirt
from gpuvirt.admin_client import AdminRefusedError
from gpuvirt.config import MIN_VF_FB, MiB, format_size, parse_vf_settings
from gpuvirt.errors import ConfigError
from gpuvirt.host.process import HostProcess
from helpers import MakeHost, last_seq, wait_event, wait_state

PLAIN_ENV = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "160"}


# ---- the parser -------------------------------------------------------------------------


@given(st.integers(MIN_VF_FB, 1 << 50), st.floats(0.001, 1e6, allow_nan=False))
def test_settings_take_sizes_as_text_or_bytes(n: int, w: float) -> None:
    assert parse_vf_settings({"fb": n, "weight": w}).fb == n
    assert parse_vf_settings({"fb": format_size(n)}).fb == n
    s = parse_vf_settings({"weight": w})
    assert (s.fb, s.weight) == (None, w)


@given(st.text(min_size=1, max_size=12).filter(lambda k: k not in ("fb", "weight")))
def test_an_unknown_key_is_refused_by_name(key: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_vf_settings({key: 1})
    assert "unknown key" in str(e.value)
    assert key.strip() in str(e.value) or repr(key)[1:-1] in str(e.value)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"fb": "3 parsecs"}, ['fb = "3 parsecs"', "unknown size unit"]),
        ({"fb": "512KiB"}, ['fb = "512KiB"', "at least 1 MiB"]),
        ({"fb": -5}, ["fb = -5", "negative"]),
        ({"fb": True}, ["fb = true", "expected a size"]),
        ({"weight": 0}, ["weight = 0", "greater than 0"]),
        ({"weight": "2"}, ['weight = "2"', "expected a number"]),
        ({"weight": float("inf")}, ["weight = inf", "finite"]),
        ([1, 2], ["expected an object", "an array"]),
    ],
)
def test_bad_values_are_refused_with_key_value_and_reason(body: Any, words: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        parse_vf_settings(body)
    for w in words:
        assert w in str(e.value)


# ---- on a real host ---------------------------------------------------------------------


def post(hp: HostProcess, path: str, body: bytes, headers: str | None = None) -> tuple[int, Any]:
    """One raw HTTP request, so the tests see exactly what a curl user would."""
    if headers is None:
        headers = f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(hp.config.host.admin_address()))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode() + body)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def cli(hp: HostProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuvirt", "vf", *args, "--config", str(hp.config_path)],
        capture_output=True, text=True, timeout=60, env=PLAIN_ENV,
    )  # fmt: skip


def test_fb_is_recarved_and_scrubbed_and_the_next_guest_gets_it(make_host: MakeHost) -> None:
    hp = make_host()
    old = hp.admin.vf(0)
    with gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as gpu:
        x = gpu.alloc(1 << 20, np.uint8)
        x.write(np.full(1 << 20, 7, np.uint8))
    wait_state(hp, 0, "AVAIL")
    after = last_seq(hp)
    v = hp.admin.vf_set(0, fb="96MiB")
    assert (v["state"], v["fb_total"]) == ("AVAIL", 96 * MiB)
    assert v["fb_resident"] == 0, "a re-carved FB holds nothing of the old one"
    assert v["engine_pid"] != old["engine_pid"], "a fresh engine runs on the new FB"
    ev = wait_event(hp, lambda e: e["kind"] == "set", after=after)
    assert (ev["vf"], ev["data"]["fb"], ev["data"]["caller"]) == (
        0,
        [old["fb_total"], 96 * MiB],
        f"admin (uid {os.getuid()})",  # who called, from SO_PEERCRED
    )
    states = [
        e["data"]["new"] for e in hp.admin.events(after=after, vf=0) if e["kind"] == "transition"
    ]
    assert states == ["RESETTING", "AVAIL"]
    with gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as gpu:
        assert gpu.fb_size == 96 * MiB
        y = gpu.alloc(1 << 20, np.uint8)
        assert not y.read().any(), "the new FB starts as zeros"
        y.write(np.arange(1 << 20, dtype=np.uint64).astype(np.uint8))

        def total(xp: Any, a: Any) -> int:
            return int(a.astype(xp.uint64).sum())

        assert gpu.launch(total, y).result(30) == sum(range(256)) * 4096
    assert hp.admin.vf(1)["fb_total"] == old["fb_total"], "the other VF is untouched"


def test_weight_changes_any_time_and_reaches_the_scheduler(make_host: MakeHost) -> None:
    hp = make_host(scheduler={"policy": "weighted"})
    with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)) as gpu:
        assert gpu.launch(lambda xp: 1).result(30) == 1
        after = last_seq(hp)
        v = hp.admin.vf_set(1, weight=3)
        assert (v["state"], v["weight"]) == ("ACTIVE", 3.0)
        assert gpu.launch(lambda xp: 2).result(30) == 2, "the guest never noticed"
        # A running VF's slice keeps the weight it started with; the next one takes it.
        s = hp.admin.request("GET", "/sched")["vfs"]["1"]
        assert 3.0 in (s["weight"], s["next_weight"])
        hp.admin.vf_set(0, weight=0.5)  # no guest, so not running: at once
        assert hp.admin.request("GET", "/sched")["vfs"]["0"]["weight"] == 0.5
        ev = wait_event(hp, lambda e: e["kind"] == "set", after=after)
        assert ev["data"]["weight"] == [1.0, 3.0]
        assert hp.status()["vfs"][1]["configured_share"] == 1.0  # the only guest
        assert hp.admin.vf(0)["weight"] == 0.5
    assert hp.admin.vf(1)["weight"] == 3.0, "the weight outlives the guest"


def test_fb_refused_while_a_guest_holds_the_vf(make_host: MakeHost) -> None:
    hp = make_host()
    size = hp.admin.vf(0)["fb_total"]
    with gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)):
        with pytest.raises(AdminRefusedError) as e:
            hp.admin.vf_set(0, fb="64MiB", weight=5)
        assert e.value.status == 409
        assert "fb = 64 MiB" in str(e.value) and "has a guest" in str(e.value)
        v = hp.admin.vf(0)
        assert (v["fb_total"], v["weight"], v["state"]) == (size, 1.0, "ACTIVE"), "nothing changed"
        # The same size is no change, so it is no conflict (a repeated DRA prepare).
        assert hp.admin.vf_set(0, fb=size)["state"] == "ACTIVE"


def test_the_sum_must_fit_the_device(make_host: MakeHost) -> None:
    hp = make_host()  # 1 GiB device, 64 MiB PF reserve, 2 VFs of 480 MiB
    code, body = post(hp, "/vf/0/set", b'{"fb": "481MiB"}')
    assert code == 400
    assert "fb = 481 MiB: does not fit the device" in body["error"]
    assert "other VFs' 480 MiB leaves 480 MiB for VF0" in body["error"]
    hp.admin.vf_set(1, fb="100MiB")
    assert hp.admin.vf_set(0, fb="860MiB")["fb_total"] == 860 * MiB
    code, body = post(hp, "/vf/1/set", b'{"fb": 104857601}')
    assert code == 400 and "leaves 100 MiB for VF1" in body["error"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b'{"fb": "2GiB", "colour": "red"}', ["colour", "unknown key"]),
        (b'{"weight": -1}', ["weight = -1", "greater than 0"]),
        (b'{"fb": "lots"}', ['fb = "lots"', "not a size"]),
        (b"fb=2GiB", ["not JSON"]),
        (b'"2GiB"', ["expected an object"]),
    ],
)
def test_bad_bodies_get_400_naming_what_was_wrong(
    make_host: MakeHost, body: bytes, words: list[str]
) -> None:
    hp = make_host(sriov={"vf_num": 1})
    before = hp.admin.vf(0)
    code, reply = post(hp, "/vf/0/set", body)
    assert code == 400
    assert reply["error"].startswith("POST /vf/0/set")
    for w in words:
        assert w in reply["error"]
    after = hp.admin.vf(0)
    assert (after["fb_total"], after["weight"], after["state"]) == (
        before["fb_total"], before["weight"], "AVAIL",
    )  # fmt: skip


def test_a_disabled_vf_takes_its_new_size_when_enabled(make_host: MakeHost) -> None:
    hp = make_host()
    hp.admin.vf(1, "disable")
    v = hp.admin.vf_set(1, fb=200 * MiB)
    assert (v["state"], v["fb_total"]) == ("UNAVAIL", 200 * MiB)
    assert hp.admin.vf(1, "enable")["fb_total"] == 200 * MiB
    with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)) as gpu:
        assert gpu.fb_size == 200 * MiB


def test_cli_sets_and_reports_refusals(make_host: MakeHost) -> None:
    hp = make_host()
    r = cli(hp, "set", "0", "--fb", "100MiB", "--weight", "2.5")
    assert r.returncode == 0, r.stderr
    assert "VF0: FB 100 MiB, weight 2.5; state AVAIL" in r.stdout
    r = cli(hp, "set", "0", "--weight", "2", "--json")
    assert json.loads(r.stdout)["weight"] == 2.0
    r = cli(hp, "set", "0", "--fb", "1TiB")
    assert r.returncode == 1
    assert "fb = 1 TiB: does not fit the device" in r.stderr
    r = cli(hp, "set", "0")
    assert r.returncode == 2 and "nothing to set" in r.stderr
    assert Path(hp.config_path).exists()


def test_a_quarantined_vf_is_recarved_without_an_engine_and_comes_back_at_its_new_size(
    make_host: MakeHost,
) -> None:
    hp = make_host(reset={"guard_flr": "1/60s"})
    for _ in range(2):
        hp.admin.vf(1, "reset")
    wait_state(hp, 1, "QUARANTINED")
    v = hp.admin.vf_set(1, fb="150MiB")
    assert (v["state"], v["fb_total"], v["engine_pid"]) == ("QUARANTINED", 150 * MiB, None)
    assert hp.admin.vf(1, "clear-guard")["state"] == "AVAIL"
    with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)) as gpu:
        assert gpu.fb_size == 150 * MiB


def test_no_such_vf_is_404(make_host: MakeHost) -> None:
    hp = make_host(sriov={"vf_num": 1})
    code, body = post(hp, "/vf/3/set", b'{"weight": 2}')
    assert code == 404 and "no VF '3'" in body["error"]


@pytest.mark.parametrize(
    ("headers", "code", "words"),
    [
        ("Content-Length: lots\r\n", 400, "Content-Length 'lots': must be 0..16384"),
        ("Content-Length: 99999999\r\n", 400, "must be 0..16384"),
        ("Transfer-Encoding: chunked\r\n", 411, "send the body with a Content-Length"),
    ],
)
def test_a_body_without_a_usable_length_is_refused(
    make_host: MakeHost, headers: str, code: int, words: str
) -> None:
    hp = make_host(sriov={"vf_num": 1})
    status, body = post(hp, "/vf/0/set", b"", headers)
    assert status == code
    assert words in body["error"]
    assert hp.admin.vf(0)["state"] == "AVAIL", "the host carries on"
