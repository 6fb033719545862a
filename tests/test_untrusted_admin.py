"""The admin endpoint against callers it must not trust, over its real sockets."""

from __future__ import annotations

import http.client
import inspect
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from gpuvirt import errors
from gpuvirt.admin_client import AdminClient, AdminRefusedError
from gpuvirt.config import load_or_create_token
from gpuvirt.device.base import CommandTimeout, EngineDied
from gpuvirt.errors import GpuvirtError
from gpuvirt.host.admin import status_of
from helpers import MakeHost, last_seq, wait_event

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tcp_get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_tcp_admin_with_a_token_refuses_requests_without_it(
    make_host: MakeHost, tmp_path: Path
) -> None:
    port = free_port()
    token_file = tmp_path / "admin.token"
    hp = make_host(host={"admin": f"127.0.0.1:{port}", "admin_token_file": str(token_file)})
    token = load_or_create_token(token_file)  # the host created it at start
    status, body = tcp_get(port, "/status")
    assert status == 401 and "bearer token" in body["error"]
    status, _ = tcp_get(port, "/status", {"Authorization": "Bearer " + "00" * 32})
    assert status == 401
    status, _ = tcp_get(port, "/status", {"Authorization": f"Basic {token.hex()}"})
    assert status == 401
    status, body = tcp_get(port, "/status", {"Authorization": f"Bearer {token.hex()}"})
    assert status == 200 and len(body["vfs"]) == 2
    # Mutating calls with the token work and name the caller's address.
    after = last_seq(hp)
    assert hp.admin.vf(1, "reset")["state"] == "AVAIL"
    ev = wait_event(hp, lambda e: e["category"] == "admin" and e["kind"] == "reset", after=after)
    assert ev["data"]["caller"]["address"].startswith("127.0.0.1:")
    with pytest.raises(GpuvirtError, match="bearer token"):
        AdminClient(("127.0.0.1", port)).vf(1, "reset")


def test_unix_admin_calls_are_events_with_the_callers_uid(make_host: MakeHost) -> None:
    hp = make_host()
    after = last_seq(hp)
    for action in ("disable", "enable", "reset", "clear-guard"):
        hp.admin.vf(0, action)
    calls = [e for e in hp.admin.events(after=after) if e["category"] == "admin"]
    assert [e["kind"] for e in calls][:4] == ["disable", "enable", "reset", "clear-guard"]
    for e in calls[:4]:
        assert e["data"]["caller"]["uid"] == os.getuid()
        assert e["data"]["caller"]["pid"] == os.getpid()
        assert f"uid {os.getuid()}" in e["message"]


@pytest.mark.parametrize("wait", ["abc", "-1", "nan", "inf"])
def test_a_bad_wait_is_a_400_naming_the_parameter(make_host: MakeHost, wait: str) -> None:
    hp = make_host()
    with pytest.raises(GpuvirtError, match=rf"wait='{wait}': must be a number of seconds"):
        hp.admin.request("GET", f"/events?wait={wait}")
    assert hp.admin.status()["pid"] == hp.pid


def test_long_polls_do_not_hold_the_executor_that_resets_run_on(make_host: MakeHost) -> None:
    # More long-polls than the loop's default executor has threads, each waiting for an
    # event that will not come (after= far ahead), sent before a reset of VF1 (whose
    # engine kill and start run on that executor). The reset completes while every
    # poll is still waiting: none has an answer when the reset's answer is back.
    hp = make_host()
    polls = []
    for _ in range(3 * min(32, (os.cpu_count() or 1) + 4)):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(hp.config.host.admin_address()))
        s.sendall(b"GET /events?after=1000000000&wait=20 HTTP/1.1\r\nHost: x\r\n\r\n")
        polls.append(s)
    try:
        assert hp.admin.vf(1, "reset")["state"] == "AVAIL"
        for s in polls:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        for s in polls:
            s.close()


# What an operator's request gets when it fails, by the error's meaning (errors.py).
EXPECTED_STATUS = {
    errors.ConfigError: 400,  # a bad value
    errors.StateConflictError: 409,  # not now
    errors.DeviceError: 502,  # the backend failed
    CommandTimeout: 502,
    EngineDied: 502,
    errors.StateError: 500,  # a host bug
    errors.GpuvirtError: 500,
}
# Tenant-side errors (and their subclasses) no admin action raises: a host bug if one did.
TENANT_SIDE = (
    errors.HostUnreachableError, errors.AuthRefusedError, errors.OutOfMemoryError,
    errors.BufferLostError, errors.VFResetError, errors.DetachedError, errors.KernelError,
)  # fmt: skip


def test_every_error_class_has_the_status_its_meaning_gives() -> None:
    # Every class in errors.py has a meaning here: a new one must be given its own.
    for _n, cls in inspect.getmembers(errors, inspect.isclass):
        assert cls in EXPECTED_STATUS or issubclass(cls, TENANT_SIDE), cls
        want = EXPECTED_STATUS.get(cls, 500)
        assert status_of(cls("x")) == want, cls
    for cls, code in EXPECTED_STATUS.items():
        assert status_of(cls("x")) == code, cls
    assert status_of(RuntimeError("x")) == 500


def test_a_state_conflict_is_a_409_and_a_bad_value_a_400(make_host: MakeHost) -> None:
    hp = make_host()
    hp.admin.vf(1, "disable")
    with pytest.raises(
        AdminRefusedError, match="VF1: clear-fb refused in UNAVAIL: it is disabled"
    ) as e:
        hp.admin.vf(1, "clear-fb")
    assert e.value.status == 409
    with pytest.raises(AdminRefusedError, match="fb = 1 TiB: does not fit the device") as e:
        hp.admin.vf_set(0, fb="1TiB")
    assert e.value.status == 400
