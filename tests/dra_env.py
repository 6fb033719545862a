"""A node for the DRA driver's tests: a real host, the API-server stand-in, the driver
as its own process, and a kubelet stand-in speaking gRPC to it from the same stubs.

The kubelet stand-in does what the kubelet's plugin watcher and DRA manager do:
finds the registration socket in plugins_registry (once the plugin says it
serves), calls GetInfo, checks the type and versions, answers
NotifyRegistrationStatus, then calls NodePrepareResources and
NodeUnprepareResources on the endpoint GetInfo named.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpuvirt.device.sandbox.bwrap import interpreter_paths
from gpuvirt.host.process import HostProcess
from gpuvirt.k8s.proto.dra.v1 import api_pb2 as dra
from gpuvirt.k8s.proto.dra.v1 import api_pb2_grpc as dra_grpc
from gpuvirt.k8s.proto.pluginregistration.v1 import api_pb2 as reg
from gpuvirt.k8s.proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from k8s_apiserver import ApiServer

DRIVER = "gpuvirt.io"
READY_PREFIX = "gpuvirt dra-plugin: serving"


class Plugin:
    """`gpuvirt k8s dra-plugin` as a child process, ready once it prints that it serves."""

    def __init__(self, hp: HostProcess, api: ApiServer, work: Path, node: str) -> None:
        self.registry_dir = work / "plugins_registry"
        self.plugin_dir = work / "plugins" / DRIVER
        self.cdi_dir = work / "cdi"
        self.log = work / "dra-plugin.log"
        self.argv = [
            sys.executable, "-m", "gpuvirt", "k8s", "dra-plugin",
            "--config", str(hp.config_path), "--node-name", node,
            "--registry-dir", str(self.registry_dir), "--plugin-dir", str(self.plugin_dir),
            "--cdi-dir", str(self.cdi_dir), "--kubeconfig", str(api.kubeconfig(work / "kubeconfig")),
        ]  # fmt: skip
        self.proc: subprocess.Popen[str] | None = None
        self.ready_line = ""

    def start(self, timeout: float = 60.0) -> Plugin:
        log = open(self.log, "a")  # noqa: SIM115 - the child writes it
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
        )
        log.close()
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and sel.select(left), f"plugin not ready: {self.log.read_text()}"
            line = self.proc.stdout.readline()
            assert line, f"plugin exited with {self.proc.wait()}:\n{self.log.read_text()}"
            if line.startswith(READY_PREFIX):
                self.ready_line = line.strip()
                return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        return code


@dataclass
class Kubelet:
    """The kubelet's side of plugin registration and DRA v1."""

    registry_dir: Path
    info: reg.PluginInfo | None = None
    channels: list[grpc.Channel] = field(default_factory=list)

    def _channel(self, path: str | Path) -> grpc.Channel:
        ch = grpc.insecure_channel(f"unix://{path}")
        grpc.channel_ready_future(ch).result(timeout=10)
        self.channels.append(ch)
        return ch

    def register(self, accept: bool = True, error: str = "") -> reg.PluginInfo:
        sockets = sorted(self.registry_dir.glob("*.sock"))
        assert [s.name for s in sockets] == [f"{DRIVER}-reg.sock"], sockets
        stub = reg_grpc.RegistrationStub(self._channel(sockets[0]))
        self.info = stub.GetInfo(reg.InfoRequest(), timeout=10)
        stub.NotifyRegistrationStatus(
            reg.RegistrationStatus(plugin_registered=accept, error=error), timeout=10
        )
        return self.info

    @property
    def dra(self) -> dra_grpc.DRAPluginStub:
        assert self.info is not None, "register first"
        return dra_grpc.DRAPluginStub(self._channel(self.info.endpoint))

    def prepare(self, *claims: dict[str, Any]) -> dra.NodePrepareResourcesResponse:
        req = dra.NodePrepareResourcesRequest(claims=[_ref(c) for c in claims])
        return self.dra.NodePrepareResources(req, timeout=120)

    def unprepare(self, *claims: dict[str, Any]) -> dra.NodeUnprepareResourcesResponse:
        req = dra.NodeUnprepareResourcesRequest(claims=[_ref(c) for c in claims])
        return self.dra.NodeUnprepareResources(req, timeout=120)

    def close(self) -> None:
        for ch in self.channels:
            ch.close()


def _ref(claim: dict[str, Any]) -> dra.Claim:
    m = claim["metadata"]
    return dra.Claim(namespace=m["namespace"], name=m["name"], uid=m["uid"])


def claim(
    node: str,
    devices: list[str],
    parameters: dict[str, Any] | None = None,
    name: str | None = None,
    class_parameters: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ResourceClaim as the scheduler leaves it: allocated `devices` of this node's pool,
    with `parameters` from the claim (and `class_parameters` from its DeviceClass)."""
    name = name or f"claim-{uuid.uuid4().hex[:8]}"
    config = []
    for source, params in (("FromClass", class_parameters), ("FromClaim", parameters)):
        if params is not None:
            config.append(
                {"source": source, "requests": ["vf"],
                 "opaque": {"driver": DRIVER, "parameters": params}}
            )  # fmt: skip
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4())},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "vf",
                        "exactly": {"deviceClassName": "vf.gpuvirt.io", "count": len(devices)},
                    }
                ],
                "config": [
                    {"requests": ["vf"], "opaque": {"driver": DRIVER, "parameters": parameters}}
                ]
                if parameters is not None
                else [],
            }
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "vf", "driver": DRIVER, "pool": node, "device": d}
                        for d in devices
                    ],
                    "config": config,
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [node]}
                            ]
                        }
                    ]
                },
            }
        },
    }


def cdi_device(cdi_dir: Path, cdi_id: str) -> dict[str, Any]:
    """The CDI device `cdi_id` names, looked up as a container runtime does: every spec
    file in the directory, matched on kind and device name."""
    kind, name = cdi_id.split("=", 1)
    found = []
    for path in sorted(cdi_dir.glob("*.json")):
        spec = json.loads(path.read_text())
        if spec["kind"] == kind:
            found += [d for d in spec["devices"] if d["name"] == name]
    assert len(found) == 1, f"{cdi_id}: {len(found)} devices in {cdi_dir}"
    return found[0]


def container(edits: dict[str, Any], code: str) -> subprocess.Popen[str]:
    """Python `code` run as a container would be with these CDI containerEdits: a fresh
    mount namespace (bubblewrap) where the node's /tmp, /run and /var are hidden, only
    the edits' mounts and env reach in, and nothing else of the host's environment.
    Its stdin and stdout are pipes."""
    argv = [
        "bwrap", "--die-with-parent", "--unshare-pid", "--unshare-ipc",
        "--ro-bind", "/", "/", "--tmpfs", "/tmp", "--tmpfs", "/run", "--tmpfs", "/var",
        "--proc", "/proc", "--dev", "/dev", "--clearenv",
        "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
    ]  # fmt: skip
    # the interpreter and gpuvirt where they live under a hidden tree (a CI clone in /tmp)
    for p in interpreter_paths():
        if p.startswith(("/tmp/", "/run/", "/var/")):
            argv += ["--ro-bind", p, p]
    for m in edits.get("mounts", []):
        flag = "--ro-bind" if "ro" in m.get("options", []) else "--bind"
        argv += [flag, m["hostPath"], m["containerPath"]]
    for e in edits.get("env", []):
        k, v = e.split("=", 1)
        argv += ["--setenv", k, v]
    argv += [sys.executable, "-c", code]
    return subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@contextlib.contextmanager
def node(make_host: Any, **host_sections: Any) -> Any:
    """(host, API server, plugin, kubelet) for one test; all stopped at the end."""
    hp = make_host(**host_sections)
    api = ApiServer().start()
    name = f"node-{uuid.uuid4().hex[:6]}"
    # Short paths, not pytest's tmp_path: a Unix socket path has room for 107 bytes, and
    # the plugin's sockets sit two levels down (tmp_path under xdist is long enough to
    # leave them no room).
    work = Path(tempfile.mkdtemp(prefix="gv-dra-"))
    plugin = Plugin(hp, api, work, name).start()
    kubelet = Kubelet(plugin.registry_dir)
    try:
        yield Node(name, hp, api, plugin, kubelet)
    finally:
        kubelet.close()
        if plugin.proc and plugin.proc.poll() is None:
            plugin.stop()
        api.stop()
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class Node:
    name: str
    host: HostProcess
    api: ApiServer
    plugin: Plugin
    kubelet: Kubelet
