"""Hostile tenant, part 2: other processes, the host's sockets, the network,
process creation, and work that outlives its slice or its VF."""

from __future__ import annotations

import os
import socket

import pytest

import gpuvirt
from confine_env import hostile_scene, thread_states, uid_processes
from gpuvirt.defaults import DEFAULT_ENGINE_TASKS
from helpers import MakeHost, wait_state
from hostile import k_connect, k_fork_bomb, k_signal, k_spinner, k_syscalls, k_threads

pytestmark = pytest.mark.timeout(180)


def test_the_host_and_its_sockets_cannot_be_reached(make_host: MakeHost) -> None:
    with hostile_scene(make_host) as sc, socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):  # control: it listens
            listener.accept()[0].close()
        paths = sc.host_paths()
        got = sc.gpu.launch(k_connect, [str(paths["admin"]), str(paths["mailbox"])], port).result(
            30
        )
        assert got == {str(paths["admin"]): "ENOENT", str(paths["mailbox"]): "ENOENT",
                       "tcp": "EAFNOSUPPORT"}  # fmt: skip
        listener.settimeout(0)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing came through
        pids = [sc.hp.pid, sc.engine_pid(0), sc.neighbour_pid, os.getpid(), 1]
        got = sc.gpu.launch(k_signal, pids).result(30)
        # outside its pid namespace nothing exists; its sandbox's init is not its to signal
        assert {got[str(p)] for p in pids[:-1]} == {"ESRCH"}, got
        assert got["1"] in ("EPERM", "ok")  # init ignores signals it has no handler for
        assert got["-1"] in ("ESRCH", "EPERM", "ok")
        assert sc.hp.alive() and sc.hp.admin.status()["pid"] == sc.hp.pid
        assert sc.neighbour_ok()
        assert sc.gpu.launch(lambda xp: 7).result(30) == 7  # and the attacker's engine lives


def test_no_process_creation_and_threads_are_capped(make_host: MakeHost) -> None:
    with hostile_scene(make_host) as sc:
        got = sc.gpu.launch(k_syscalls).result(30)
        denied = {k: v for k, v in got.items() if k not in ("clone3", "thread")}
        assert denied == dict.fromkeys(denied, "EPERM"), got
        assert got["clone3"] == "ENOSYS"  # so that glibc falls back to clone, which is filtered
        assert got["thread"] == "ok"
        assert sc.gpu.launch(k_fork_bomb, 400).result(60) == {"EPERM": 400}
        # 400 threads (allowed, unlike processes) hit the task limit
        bomb = sc.gpu.launch(k_threads, 400).result(60)
        assert bomb["started"] < DEFAULT_ENGINE_TASKS <= 400 and "thread" in bomb["error"], bomb
        assert sc.gpu.launch(k_threads, 4).result(30)["started"] == 4  # and they were released
        assert sc.neighbour_ok()


def test_a_left_behind_thread_stops_with_its_vf_and_dies_with_it(make_host: MakeHost) -> None:
    with hostile_scene(make_host) as sc:
        uid = sc.uid(1)
        engine = sc.engine_pid(1)
        assert sc.gpu.launch(k_spinner).result(30) >= 2
        assert len(thread_states(engine)) >= 2
        # VF 0 computes for a while; VF 1 has no work, so it is descheduled (idle) then
        sc.conn.send(("busy", 3.0))
        seen_idle = False
        while not sc.conn.poll():
            vfs = {v["index"]: v for v in sc.hp.admin.status()["vfs"]}
            if vfs[0]["running"] and not vfs[1]["running"]:
                states = thread_states(engine)
                # read again: the scheduler may have switched between the two reads
                if not sc.hp.admin.vf(1)["running"] and sc.hp.admin.vf(0)["running"]:
                    assert set(states.values()) == {"T"}, states
                    seen_idle = True
        assert sc.conn.recv() is True
        assert seen_idle
        # the spinner is a thread of it, no process: besides the engine, this VF's uid
        # runs only the spare engine started for its next FLR, which ran no tenant code
        others = [p for p in uid_processes(uid) if p != engine]
        assert engine in uid_processes(uid) and len(others) <= 1
        assert all(len(thread_states(p)) == 1 for p in others)
    # detached: the engine and everything it ran are gone (its spare has no tenant code)
    wait_state(sc.hp, 1, "AVAIL")
    assert engine not in uid_processes(uid)
    assert not os.path.exists(f"/proc/{engine}")
    assert all(len(thread_states(p)) == 1 for p in uid_processes(uid))  # no spinner anywhere
    hp = sc.hp
    with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)) as gpu:  # next tenant
        assert gpu.launch(lambda xp: 11).result(30) == 11
