"""Hostile tenant: text it controls, shown to the operator (issue 31).

A guest holds its VF2PF key, so it publishes any driver_version it likes; here
it publishes terminal controls (an OSC title ending in BEL, a screen clear)
and rich markup. Whatever the operator runs (`vf show`, plain or --json,
`events`, plain or --json) must carry no control character, even once a JSON
field is decoded (`jq -r`), and must show the markup as letters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import gpuvirt
import gpuvirt.guest.client as guest_client
from helpers import MakeHost, wait_event

pytestmark = pytest.mark.timeout(120)

HOSTILE = "\x1b]0;pwn\x07\x1b[2J[link=http://x]y[/link]"
MARKUP = "[link=http://x]y[/link]"
PLAIN_ENV = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200"}


def gpuvirt_cli(hp, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "gpuvirt", *args, "--config", str(hp.config_path)],
        capture_output=True, text=True, timeout=60, env=PLAIN_ENV, check=True,
    )  # fmt: skip
    return done.stdout


def no_controls(text: str) -> bool:
    return not any((ord(c) < 0x20 and c not in "\n") or 0x7F <= ord(c) <= 0x9F for c in text)


def test_a_guests_driver_version_cannot_drive_the_operators_terminal(
    make_host: MakeHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    hp = make_host()
    # the tenant's own library, changed as the tenant likes: it publishes this string
    monkeypatch.setattr(guest_client, "DRIVER_VERSION", HOSTILE)
    with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)):
        wait_event(hp, lambda e: e["kind"] == "vf2pf.first" and e["vf"] == 1)
        shown = json.loads(gpuvirt_cli(hp, "vf", "show", "1", "--json"))["driver_version"]
        assert no_controls(shown) and MARKUP in shown, repr(shown)
        assert shown == "\\x1b]0;pwn\\x07\\x1b[2J" + MARKUP  # the letters, escaped
        plain = gpuvirt_cli(hp, "vf", "show", "1")
        assert no_controls(plain) and MARKUP in plain, repr(plain)
        for line in gpuvirt_cli(hp, "events", "--json", "--vf", "1").splitlines():
            ev = json.loads(line)
            assert no_controls(ev["message"]), repr(ev)
            assert all(no_controls(str(v)) for v in ev["data"].values()), repr(ev)
        first = [json.loads(x) for x in gpuvirt_cli(hp, "events", "--json").splitlines()]
        (ev,) = [e for e in first if e["kind"] == "vf2pf.first"]
        assert MARKUP in ev["data"]["driver_version"]
        plain = gpuvirt_cli(hp, "events", "--vf", "1")
        assert no_controls(plain) and MARKUP in plain, repr(plain)
        raw, _ = hp.admin.raw("GET", "/metrics")  # no label carries it either
        assert no_controls(raw.decode() if isinstance(raw, bytes) else raw)
