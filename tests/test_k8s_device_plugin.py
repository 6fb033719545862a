"""`gpuvirt k8s device-plugin` against a kubelet stand-in (tests/k8s_standin.py) and real hosts.

Every test runs the plugin as the real command, in its own process, beside a
real host; the stand-in plays the kubelet over the real gRPC API. A container
is played by bubblewrap with exactly the mounts and environment Allocate
returned, and no other view of this machine's files.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import gpuvirt
from gpuvirt.bench.common import host_config
from gpuvirt.bench.workers import hang
from gpuvirt.device.sandbox.bwrap import interpreter_paths
from gpuvirt.host.process import HostProcess
from helpers import last_seq, wait_event, wait_state
from k8s_standin import KubeletStandin, Plugin, allocate, next_update, preferred

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[1]
RESOURCE = "gpuvirt.io/vf"


def all_health(health: str):  # type: ignore[no-untyped-def]
    return lambda devices: devices and set(devices.values()) == {health}


@dataclass
class Node:
    """One Kubernetes node as the plugin sees it: a host, a kubelet, the plugin."""

    work: Path
    hp: HostProcess
    kubelet: KubeletStandin
    plugin: subprocess.Popen[str] | None = None

    @property
    def plugin_dir(self) -> Path:
        return self.kubelet.dir

    def start_plugin(self, *args: str) -> subprocess.Popen[str]:
        """The real command; its output is kept line by line (`said` waits for a line)."""
        self.log = self.work / "plugin.log"
        self.lines: queue.Queue[str] = queue.Queue()
        self.plugin = subprocess.Popen(
            [
                sys.executable, "-m", "gpuvirt", "k8s", "device-plugin",
                "--config", str(self.hp.config_path), "--plugin-dir", str(self.plugin_dir), *args,
            ],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        threading.Thread(target=self._keep, args=(self.plugin,), daemon=True).start()
        return self.plugin

    def _keep(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        with open(self.log, "a") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                self.lines.put(line)

    def said(self, words: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if words in line:
                return line

    def stop(self) -> None:
        if self.plugin is not None:
            print(f"--- {self.log}\n{self.log.read_text()}")  # shown when a test fails
        if self.plugin is not None and self.plugin.poll() is None:
            self.plugin.send_signal(signal.SIGTERM)
            self.plugin.wait(30)
        self.kubelet.stop()
        self.hp.stop()


@pytest.fixture
def make_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    nodes: list[Node] = []

    def make(
        *,
        dedicated_socket_dir: bool = False,
        tokens_beside_socket: bool = False,
        kubelet: bool = True,
        **sections: Any,
    ) -> Node:
        # Short paths: a Unix socket path has room for 107 bytes.
        work = Path(tempfile.mkdtemp(prefix="gv-k8s-"))
        if dedicated_socket_dir:
            sections.setdefault("host", {})["socket"] = str(work / "mailbox" / "host.sock")
        sections.setdefault("sriov", {"vf_num": 2})
        if tokens_beside_socket:
            n = sections["sriov"]["vf_num"]
            sections["vf"] = [
                {"index": i, "token_file": str(work / f"vf{i}.token")} for i in range(n)
            ]
        hp = HostProcess(host_config(work, **sections), work / "run").start()
        standin = KubeletStandin(work / "device-plugins")
        node = Node(work, hp, standin.start() if kubelet else standin)
        standin.dir.mkdir(exist_ok=True)
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.stop()
        shutil.rmtree(node.work, ignore_errors=True)


def registered(node: Node, *args: str) -> Plugin:
    node.start_plugin(*args)
    p = node.kubelet.registered()
    next_update(p, all_health("Healthy"))
    return p


# ---- registration and ListAndWatch --------------------------------------------------------


def test_registers_as_the_kubelet_expects_and_lists_one_device_per_vf(make_node) -> None:
    node = make_node(sriov={"vf_num": 3})
    p = registered(node)
    assert p.request.version == "v1beta1"
    assert p.request.resource_name == RESOURCE
    assert p.request.endpoint == "gpuvirt.io_vf.sock"
    assert (node.plugin_dir / p.request.endpoint).is_socket()
    assert p.request.options.get_preferred_allocation_available
    assert p.options.get_preferred_allocation_available and not p.options.pre_start_required
    assert p.history[-1].devices == {"vf0": "Healthy", "vf1": "Healthy", "vf2": "Healthy"}


def test_a_hung_kernel_takes_its_device_down_and_the_flr_brings_it_back(make_node) -> None:
    node = make_node(scheduler={"job_timeout_s": 0.5})
    p = registered(node)
    hp = node.hp
    after = last_seq(hp)
    with gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)) as gpu:
        fut = gpu.launch(hang)
        down = next_update(p, lambda d: d["vf1"] == "Unhealthy")
        up = next_update(p, lambda d: d["vf1"] == "Healthy")
        trace = _trace(hp, p, after)
        with pytest.raises(gpuvirt.VFResetError):
            fut.result(30)
        gpu.wait_ready()
        assert gpu.launch(lambda xp: 6 * 7).result(30) == 42
    assert down.devices["vf0"] == up.devices["vf0"] == "Healthy", "the neighbour stayed up"
    start = wait_event(hp, lambda e: e["kind"] == "flr.start" and e["vf"] == 1, after=after)
    assert start["data"]["reason"] == "job_timeout"
    print("\nListAndWatch through a VF reset (vf1, job_timeout):\n" + "\n".join(trace))
    assert [line.split()[1] for line in trace] == ["RESETTING", "AVAIL"]


def _trace(hp: HostProcess, p: Plugin, after: int) -> list[str]:
    """Each of VF1's transitions with the ListAndWatch update that carried it, and how
    long after the host logged the transition the update reached the kubelet."""
    moves = []
    for e in hp.admin.events(after=after, vf=1):
        new = e["data"].get("new") if e["kind"] == "transition" else None
        if (new == "RESETTING" and not moves) or (new == "AVAIL" and len(moves) == 1):
            moves.append(e)
    lines = []
    for e in moves:
        want = "Unhealthy" if e["data"]["new"] == "RESETTING" else "Healthy"
        u = next(u for u in p.history if u.at >= e["ts"] and u.devices["vf1"] == want)
        lines.append(
            f"host {e['data']['new']:<10} → update vf1 {want:<9} after {1000 * (u.at - e['ts']):7.1f} ms"
        )
    return lines


def test_disable_and_enable_follow_through(make_node) -> None:
    node = make_node()
    p = registered(node)
    node.hp.admin.vf(0, "disable")
    u = next_update(p, lambda d: d["vf0"] == "Unhealthy")
    assert u.devices["vf1"] == "Healthy"
    node.hp.admin.vf(0, "enable")
    next_update(p, all_health("Healthy"))


def test_a_quarantined_vf_stays_down_until_the_guard_is_cleared(make_node) -> None:
    node = make_node(reset={"guard_flr": "1/60s"})
    p = registered(node)
    hp = node.hp
    for _ in range(2):
        hp.admin.vf(1, "reset")
    wait_state(hp, 1, "QUARANTINED")
    next_update(p, lambda d: d["vf1"] == "Unhealthy")
    hp.admin.vf(1, "clear-guard")
    next_update(p, all_health("Healthy"))


# ---- Allocate and a container that uses it ------------------------------------------------


def _mounts(resp: Any) -> list[tuple[str, str, bool]]:
    return [(m.container_path, m.host_path, m.read_only) for m in resp.mounts]


def test_allocate_beside_token_files_mounts_the_socket_file_only(make_node) -> None:
    # As an admin may well lay it out: vfN.token files right beside host.sock.
    node = make_node(sriov={"vf_num": 3}, tokens_beside_socket=True)
    hp = node.hp
    p = registered(node)
    resp = allocate(p, "vf1")
    token1 = hp.config.vf_layout()[1].token_file
    assert dict(resp.envs) == {
        "GPUVIRT_SOCKET": "/run/gpuvirt/mailbox/host.sock",
        "GPUVIRT_VF": "1",
        "GPUVIRT_TOKEN_FILE": "/run/gpuvirt/tokens/vf1.token",
        "GPUVIRT_VFS": "1",
    }
    assert _mounts(resp) == [
        ("/run/gpuvirt/mailbox/host.sock", str(hp.socket), True),
        ("/run/gpuvirt/tokens/vf1.token", str(token1), True),
    ]
    _no_mount_reaches_another_token(resp, hp, own=1)
    assert (hp.socket.parent / "vf0.token").exists(), "the token files really are beside it"


def test_allocate_mounts_a_socket_directory_that_holds_nothing_else(make_node) -> None:
    node = make_node(dedicated_socket_dir=True)
    hp = node.hp
    p = registered(node)
    resp = allocate(p, "vf0")
    assert _mounts(resp)[0] == ("/run/gpuvirt/mailbox", str(hp.socket.parent), True)
    _no_mount_reaches_another_token(resp, hp, own=0)
    # The moment something else lands there, only the socket itself is mounted.
    (hp.socket.parent / "vf9.token").write_text("x")
    assert _mounts(allocate(p, "vf0"))[0] == (
        "/run/gpuvirt/mailbox/host.sock", str(hp.socket), True
    )  # fmt: skip


def _no_mount_reaches_another_token(resp: Any, hp: HostProcess, own: int) -> None:
    tokens = [p.token_file for p in hp.config.vf_layout()]
    for m in resp.mounts:
        host = Path(m.host_path)
        assert m.read_only
        if host.is_dir():
            assert not any(t.is_relative_to(host) for t in tokens), m
        else:
            assert host in (hp.socket, tokens[own]), m


@pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap (Debian: bubblewrap) plays the container"
)
def test_a_guest_in_a_container_attaches_with_only_what_allocate_returned(make_node) -> None:
    node = make_node(dedicated_socket_dir=True, sriov={"vf_num": 3})
    p = registered(node)
    resp = allocate(p, "vf2")
    tokens = [str(t.token_file) for t in node.hp.config.vf_layout()]
    out = _in_container(resp, GUEST, tokens)
    assert out["vf"] == 2 and out["sum"] == float(sum(range(1000)) * 3)
    assert out["tokens"] == ["vf2.token"], "no other VF's token in the container"
    assert out["mailbox"] == ["host.sock"]
    assert out["token_write"].startswith("OSError: [Errno 30] Read-only file system")
    assert out["other_token_paths_exist"] == []
    # The host agrees: VF2 had a guest, and only VF2.
    ev = [e for e in node.hp.admin.events() if e["kind"] == "attach"]
    assert [e["vf"] for e in ev] == [2]


GUEST = """
import json, os, sys
import numpy as np
import gpuvirt
out = {}
with gpuvirt.attach() as gpu:             # GPUVIRT_SOCKET, GPUVIRT_VF, GPUVIRT_TOKEN_FILE
    x = gpu.alloc(1000, np.float64)
    x.write(np.arange(1000, dtype=np.float64))
    def triple(xp, a):
        a *= 3
    gpu.launch(triple, x).result(30)
    out["vf"] = gpu.vf
    out["sum"] = float(x.read().sum())
out["tokens"] = sorted(os.listdir("/run/gpuvirt/tokens"))
out["mailbox"] = sorted(os.listdir("/run/gpuvirt/mailbox"))
try:
    open(os.environ["GPUVIRT_TOKEN_FILE"], "w")
    out["token_write"] = "allowed"
except OSError as e:
    out["token_write"] = f"OSError: {e}"
out["other_token_paths_exist"] = [p for p in sys.argv[1:] if os.path.exists(p)]
print(json.dumps(out))
"""


def _in_container(resp: Any, code: str, argv: list[str]) -> dict[str, Any]:
    """Run `code` as a container runtime would start it from `resp`: a fresh root with the
    interpreter and gpuvirt read-only, /tmp and /run empty, exactly resp's mounts and
    environment, and its own pid, ipc, uts and network namespaces."""
    prefix = Path(sys.base_prefix)
    args = [
        "bwrap", "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
        "--unshare-net", "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/bin", "/bin",
        # /tmp and /run first: a checkout or venv under /tmp (a CI clone) goes on top
        "--tmpfs", "/tmp", "--tmpfs", "/run",
        "--ro-bind", str(prefix), str(prefix), "--ro-bind", str(REPO), str(REPO),
        *(a for p in interpreter_paths() for a in ("--ro-bind", p, p)),
        "--proc", "/proc", "--dev", "/dev", "--clearenv",
    ]  # fmt: skip
    for m in resp.mounts:
        args += ["--ro-bind" if m.read_only else "--bind", m.host_path, m.container_path]
    for k, v in {**dict(resp.envs), "PATH": "/usr/bin:/bin"}.items():
        args += ["--setenv", k, v]
    r = subprocess.run(
        [*args, sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_allocate_refuses_what_it_cannot_hand_out(make_node) -> None:
    import grpc

    node = make_node()
    p = registered(node)
    for bad, words in (("vf7", "the host has no VF 7"), ("gpu0", "not one of this plugin's")):
        with pytest.raises(grpc.RpcError) as e:
            allocate(p, bad)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert words in e.value.details()


def test_preferred_allocation_takes_free_vfs_then_the_largest_fb(make_node) -> None:
    node = make_node(sriov={"vf_num": 3})
    p = registered(node)
    hp = node.hp
    hp.admin.vf_set(1, fb="100MiB")
    hp.admin.vf_set(2, fb="200MiB")
    every = ["vf0", "vf1", "vf2"]
    assert preferred(p, every, [], 3) == ["vf0", "vf2", "vf1"]  # 320, 200, 100 MiB
    with gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)):
        assert preferred(p, every, [], 2) == ["vf2", "vf1"]
        assert preferred(p, every, [], 3) == ["vf2", "vf1", "vf0"]
        assert preferred(p, every, ["vf0"], 2) == ["vf0", "vf2"]
        assert preferred(p, ["vf1", "vf0"], [], 1) == ["vf1"]


# ---- the kubelet and the host come and go ---------------------------------------------


def test_a_kubelet_restart_is_followed_by_a_new_registration(make_node) -> None:
    node = make_node()
    first = registered(node)
    node.kubelet.restart()
    again = node.kubelet.registered()
    assert again is not first and again.request.resource_name == RESOURCE
    next_update(again, all_health("Healthy"))
    assert (node.plugin_dir / again.request.endpoint).is_socket()
    assert allocate(again, "vf0").envs["GPUVIRT_VF"] == "0"


def test_the_plugin_waits_for_a_kubelet_that_is_not_there_yet(make_node) -> None:
    node = make_node(kubelet=False)
    node.start_plugin()
    node.said("no kubelet at")
    node.kubelet.start()
    p = node.kubelet.registered()
    next_update(p, all_health("Healthy"))
    node.said("registered gpuvirt.io/vf with the kubelet")


def test_a_host_restart_is_ridden_out(make_node) -> None:
    node = make_node()
    p = registered(node)
    node.hp.stop()
    next_update(p, all_health("Unhealthy"))
    node.hp.start()
    next_update(p, all_health("Healthy"))
    assert node.plugin.poll() is None
    assert node.kubelet.plugins.empty(), "no new registration was needed"
    with gpuvirt.attach(vf=0, socket=node.hp.socket, token=node.hp.token(0)) as gpu:
        assert gpu.launch(lambda xp: 1).result(30) == 1


@pytest.mark.parametrize(
    ("refuse", "args", "words"),
    [
        ("resource gpuvirt.io/vf is already registered", (), "already registered"),
        (None, ("--resource", "no-slash"), 'the ResourceName "no-slash" is invalid'),
    ],
)
def test_a_refused_registration_ends_the_plugin_with_the_reason(
    make_node, refuse: str | None, args: tuple[str, ...], words: str
) -> None:
    node = make_node()
    node.kubelet.refuse = refuse
    plugin = node.start_plugin(*args)
    assert plugin.wait(60) == 1
    line = node.said("refused to register")
    assert line.startswith("error: the kubelet at ") and words in line
    left = sorted(p.name for p in node.plugin_dir.iterdir())
    assert left == ["kubelet.sock"], "it removed its own socket"


def test_a_second_plugin_for_the_same_resource_is_refused(make_node) -> None:
    node = make_node()
    registered(node)
    r = subprocess.run(
        [sys.executable, "-m", "gpuvirt", "k8s", "device-plugin", "--config",
         str(node.hp.config_path), "--plugin-dir", str(node.plugin_dir)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 1 and "another device plugin is serving" in r.stderr
    assert os.path.exists(node.plugin_dir / "gpuvirt.io_vf.sock")
