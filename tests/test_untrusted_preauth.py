"""Hostile peer: a pre-auth flood from one uid must not lock out another (issue 31).

One uid (this process, root) holds 400 connections that never send ATTACH;
a tenant of another uid (a child that drops to nobody, the socket's group
letting it in as docs/operations.md says) attaches and runs a kernel while
the flood is held; the flooding uid's own extra attach gets HostBusyError
naming TOO_MANY_UID. The host accepts connections one at a time in order, so
once that extra attach is answered, all 400 before it have been counted.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import socket
import tempfile
from pathlib import Path

import pytest

import gpuvirt
import gpuvirt.guest.client
from gpuvirt.defaults import MAX_PENDING_ATTACH_PER_UID
from gpuvirt.errors import HostBusyError
from helpers import MakeHost

pytestmark = pytest.mark.timeout(180)
SPAWN = mp.get_context("spawn")
NOBODY = 65534
FLOOD = 400


def _k_add(xp, a: int, b: int) -> int:
    return a + b


def tenant(conn, sock: str, token: str) -> None:
    """Another uid's honest tenant: attach at once and run one kernel."""
    # everything it imports, imported as root: the interpreter lives under a 0700 home
    attach = gpuvirt.attach
    gpuvirt.kernel(_k_add).pickled()
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    try:
        with attach(vf=0, socket=sock, token=token, timeout=10) as gpu:
            conn.send(("ok", os.getuid(), gpu.launch(_k_add, 2, 3).result(30)))
    except Exception as e:
        conn.send(("error", type(e).__name__, str(e)))


def test_one_uids_flood_leaves_another_uid_its_slot(make_host: MakeHost) -> None:
    run = Path(tempfile.mkdtemp(prefix="gv-preauth-", dir="/tmp"))
    run.chmod(0o755)  # the tenant reaches the socket; the socket's group lets it connect
    path = run / "mbox.sock"
    hp = make_host(host={"socket": str(path), "socket_group": NOBODY, "socket_mode": 0o660,
                         "attach_timeout_ms": 60_000})  # fmt: skip
    flood = []
    try:
        for _ in range(FLOOD):  # never an ATTACH; held open for the host's full minute
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(path))
            flood.append(s)
        with pytest.raises(HostBusyError, match="TOO_MANY_UID"):
            gpuvirt.attach(vf=1, socket=path, token=hp.token(1), timeout=1.0)
        parent, child = SPAWN.Pipe()
        proc = SPAWN.Process(target=tenant, args=(child, str(path), hp.token(0)))
        proc.start()
        assert parent.recv() == ("ok", NOBODY, 5)
        proc.join(30)
        # the flood still held its slots meanwhile: that many got no answer and no close
        answered, _, _ = select.select(flood, [], [], 0)
        assert len(flood) - len(answered) == MAX_PENDING_ATTACH_PER_UID
        refused = [e for e in hp.admin.events() if e["kind"] == "attach.refused"]
        assert any(e["data"]["reason"] == "TOO_MANY_UID" for e in refused)
    finally:
        for s in flood:
            s.close()
