"""A kubelet stand-in: the kubelet's side of the device plugin API, as its device manager does it.

It serves the real Registration service (from the same generated stubs the
plugin uses) on ``kubelet.sock`` in a plugin directory. On a Register it checks
what the kubelet checks (API version, an extended resource name, an endpoint in
its directory), answers, then dials the plugin back, asks its options and keeps
a ListAndWatch stream open, recording every update with the time it arrived.
`allocate` and `preferred` call the plugin as the kubelet does before it starts
a container. `restart` does what a restarting kubelet does: stop, remove every
socket in its directory, and serve a new ``kubelet.sock``.
"""

from __future__ import annotations

import contextlib
import queue
import re
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gpuvirt.k8s.proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuvirt.k8s.proto.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc

SUPPORTED_VERSIONS = ("v1beta1",)
# The kubelet's own test for an extended resource name: a DNS-1123 subdomain prefix,
# a slash, a name (pkg/apis/core/helper IsExtendedResourceName).
_RESOURCE = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


@dataclass(frozen=True)
class Update:
    at: float  # time.time() when the stand-in received it
    devices: dict[str, str]  # ID -> health


@dataclass
class Plugin:
    """One registered plugin, as the kubelet's endpoint object holds it."""

    request: pb.RegisterRequest
    channel: grpc.Channel
    stub: pb_grpc.DevicePluginStub
    options: pb.DevicePluginOptions | None = None
    updates: queue.Queue[Update] = field(default_factory=queue.Queue)
    history: list[Update] = field(default_factory=list)
    stream: grpc.Future | None = None


class KubeletStandin(pb_grpc.RegistrationServicer):
    def __init__(self, plugin_dir: Path, refuse: str | None = None) -> None:
        self.dir = plugin_dir
        self.refuse = refuse
        self.socket = plugin_dir / "kubelet.sock"
        self.plugins: queue.Queue[Plugin] = queue.Queue()
        self._server: grpc.Server | None = None
        self._open: list[Plugin] = []

    # ---- the kubelet's life -------------------------------------------------------------

    def start(self) -> KubeletStandin:
        self.dir.mkdir(parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RegistrationServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0).wait()
            self._server = None
        for p in self._open:
            p.channel.close()
        self._open.clear()

    def restart(self) -> None:
        """Like a kubelet restarting: gone, its directory emptied, then back."""
        self.stop()
        for path in self.dir.iterdir():
            if path.is_socket():
                path.unlink()
        self.start()

    # ---- Registration, the service the kubelet serves --------------------------------

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        if self.refuse is not None:
            context.abort(grpc.StatusCode.UNKNOWN, self.refuse)
        if request.version not in SUPPORTED_VERSIONS:
            context.abort(
                grpc.StatusCode.UNKNOWN,
                f"requested API version {request.version!r} is not supported by kubelet. "
                f"Supported versions are {list(SUPPORTED_VERSIONS)}",
            )
        if not _RESOURCE.fullmatch(request.resource_name):
            context.abort(
                grpc.StatusCode.UNKNOWN,
                f'the ResourceName "{request.resource_name}" is invalid',
            )
        if "/" in request.endpoint or not (self.dir / request.endpoint).is_socket():
            context.abort(
                grpc.StatusCode.UNKNOWN, f"no plugin socket {request.endpoint!r} in {self.dir}"
            )
        # The kubelet answers first and dials the plugin back afterwards.
        threading.Thread(target=self._connect, args=(request,), daemon=True).start()
        return pb.Empty()

    def _connect(self, request: pb.RegisterRequest) -> None:
        channel = grpc.insecure_channel(f"unix://{self.dir / request.endpoint}")
        p = Plugin(request, channel, pb_grpc.DevicePluginStub(channel))
        p.options = p.stub.GetDevicePluginOptions(pb.Empty(), timeout=10)
        self._open.append(p)
        threading.Thread(target=self._watch, args=(p,), daemon=True).start()
        self.plugins.put(p)

    def _watch(self, p: Plugin) -> None:
        with contextlib.suppress(grpc.RpcError):  # the stream ends with the plugin or with us
            for resp in p.stub.ListAndWatch(pb.Empty()):
                u = Update(time.time(), {d.ID: d.health for d in resp.devices})
                p.history.append(u)
                p.updates.put(u)

    # ---- what the kubelet asks of a registered plugin ------------------------------------

    def registered(self, timeout: float = 30) -> Plugin:
        return self.plugins.get(timeout=timeout)


def next_update(p: Plugin, match, timeout: float = 30) -> Update:  # type: ignore[no-untyped-def]
    """The first update from now on that `match` accepts."""
    deadline = time.monotonic() + timeout
    while True:
        u = p.updates.get(timeout=max(0.0, deadline - time.monotonic()))
        if match(u.devices):
            return u


def allocate(p: Plugin, *devices: str) -> pb.ContainerAllocateResponse:
    req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=devices)])
    return p.stub.Allocate(req, timeout=10).container_responses[0]


def preferred(p: Plugin, available: list[str], must: list[str], size: int) -> list[str]:
    req = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
            )
        ]
    )
    return list(p.stub.GetPreferredAllocation(req, timeout=10).container_responses[0].deviceIDs)
