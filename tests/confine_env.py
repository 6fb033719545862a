"""The setting every hostile-tenant test runs in: a root host with confinement
required, a neighbour on VF 0 with a secret in its FB, the attacker on VF 1."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gpuvirt
from gpuvirt.host.process import HostProcess
from helpers import MakeHost, wait_state
from hostile import neighbour

SPAWN = mp.get_context("spawn")
CANARY = "GPUVIRT_TEST_HOST_SECRET"
NEIGHBOUR_BYTES = 4 << 20


@dataclass
class Scene:
    hp: HostProcess
    gpu: Any  # the attacker's attached VF 1
    conn: Any  # pipe to the neighbour process
    neighbour_pid: int

    def neighbour_ok(self) -> bool:
        self.conn.send("check")
        return self.conn.recv()

    def uid(self, vf: int) -> int:
        return self.hp.config.engine.uid_base + vf

    def engine_pid(self, vf: int) -> int:
        pid = self.hp.admin.vf(vf)["engine_pid"]
        assert pid
        return pid

    def token_files(self) -> list[Path]:
        return [p.token_file for p in self.hp.config.vf_layout()]

    def host_paths(self) -> dict[str, Path]:
        h = self.hp.config.host
        admin = h.admin_address()
        assert isinstance(admin, Path)
        return {"admin": admin, "mailbox": h.socket_path(), "state": h.state_path()}


_hosts = itertools.count()


def unique_uid_base() -> int:
    """Engine uids of this host only (other hosts on the machine use the default)."""
    return 1_000_000 + 64 * ((os.getpid() % 5000) * 16 + next(_hosts) % 16)


@contextmanager
def hostile_scene(make_host: MakeHost, **sections: Any) -> Iterator[Scene]:
    """`sections` are further host config sections (a scheduler policy, the VFs' weights)."""
    hp = make_host(
        env={CANARY: "the host's own secret"},
        engine={"sandbox": "required", "uid_base": unique_uid_base()},
        **sections,
    )
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(
        target=neighbour, args=(child, str(hp.socket), hp.token(0), NEIGHBOUR_BYTES)
    )
    proc.start()
    pid = parent.recv()
    try:
        with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)) as gpu:
            yield Scene(hp, gpu, parent, pid)
    finally:
        parent.send("close")
        assert parent.recv() == "closed"
        proc.join(10)
    wait_state(hp, 1, "AVAIL")


def uid_processes(uid: int) -> list[int]:
    """Every process on the machine running as `uid` (real uid), seen from the host."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            out.append(int(d))
                        break
        except OSError:
            continue
    return out


def thread_states(pid: int) -> dict[str, str]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        out[tid] = stat[stat.rindex(")") + 2]
    return out
