"""`gpuvirt k8s device-plugin`: the kubelet's device plugin API v1beta1 over gRPC.

The plugin serves DevicePlugin on its own socket in the kubelet's plugin
directory, then registers with the kubelet's Registration service on
``kubelet.sock`` there. One device per VF (``vf0``, ``vf1``, ...); health comes
from the host (hostwatch.py), the answers from devices.py; this file is only
the gRPC face and the registration's life:

- the kubelet restarts: it removes the sockets in its directory and creates a
  new ``kubelet.sock``; both are seen through inotify, and the plugin serves
  anew and registers again;
- the host restarts: the plugin keeps serving, every device Unhealthy until the
  host answers again;
- the kubelet refuses the registration (a version or resource name it does not
  take): `RegistrationRefused`, and the command exits saying why.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from inotify_simple import INotify
from inotify_simple import flags as in_flags

from gpuvirt.errors import GpuvirtError
from gpuvirt.k8s import DEFAULT_PLUGIN_DIR, DEFAULT_RESOURCE
from gpuvirt.k8s import devices as dev
from gpuvirt.k8s.hostwatch import HostWatcher
from gpuvirt.k8s.proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuvirt.k8s.proto.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from gpuvirt.paths import socket_served

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
REGISTER_TIMEOUT_S = 10.0
STREAM_CHECK_S = 1.0  # how often an idle ListAndWatch looks whether the kubelet left
WORKERS = 8  # ListAndWatch holds one per kubelet connection; the rest are unary calls


class RegistrationRefused(GpuvirtError):
    """The kubelet answered Register with an error: the plugin cannot run here."""


class DevicePluginService(pb_grpc.DevicePluginServicer):
    """The DevicePlugin service: thin, over the host watcher and devices.py."""

    def __init__(self, watcher: HostWatcher, stopping: threading.Event) -> None:
        self.watcher = watcher
        self.stopping = stopping

    def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        )

    def ListAndWatch(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        view, updates = self.watcher.subscribe()
        try:
            sent: dict[str, str] | None = None
            while context.is_active() and not self.stopping.is_set():
                health = view.health()
                if health != sent:
                    yield pb.ListAndWatchResponse(
                        devices=[pb.Device(ID=d, health=h) for d, h in health.items()]
                    )
                    sent = health
                with contextlib.suppress(queue.Empty):
                    view = updates.get(timeout=STREAM_CHECK_S)
        finally:
            self.watcher.unsubscribe(updates)

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        view = self.watcher.fresh()
        return pb.PreferredAllocationResponse(
            container_responses=[
                pb.ContainerPreferredAllocationResponse(
                    deviceIDs=dev.preferred(
                        view,
                        list(r.available_deviceIDs),
                        list(r.must_include_deviceIDs),
                        r.allocation_size,
                    )
                )
                for r in request.container_requests
            ]
        )

    def Allocate(
        self, request: pb.AllocateRequest, context: grpc.ServicerContext
    ) -> pb.AllocateResponse:
        view = self.watcher.fresh()
        out = []
        for r in request.container_requests:
            try:
                a = dev.allocate(view, list(r.devices_ids))
            except dev.AllocateError as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            out.append(
                pb.ContainerAllocateResponse(
                    envs=a.envs,
                    mounts=[
                        pb.Mount(
                            container_path=m.container_path,
                            host_path=m.host_path,
                            read_only=m.read_only,
                        )
                        for m in a.mounts
                    ],
                )
            )
        return pb.AllocateResponse(container_responses=out)

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()  # not asked for (pre_start_required=False)


def endpoint_name(resource: str) -> str:
    """The plugin's socket file name: ``gpuvirt.io/vf`` → ``gpuvirt.io_vf.sock``."""
    return resource.replace("/", "_") + ".sock"


@dataclass
class PluginConfig:
    plugin_dir: Path = DEFAULT_PLUGIN_DIR
    resource: str = DEFAULT_RESOURCE


class DevicePlugin:
    """Serves, registers, and does both again whenever the kubelet restarts."""

    def __init__(
        self, watcher: HostWatcher, config: PluginConfig, log: Callable[[str], None] = print
    ) -> None:
        self.watcher = watcher
        self.config = config
        self.log = log
        self.endpoint = config.plugin_dir / endpoint_name(config.resource)
        self.kubelet = config.plugin_dir / KUBELET_SOCKET
        self.stopping = threading.Event()
        self._server: grpc.Server | None = None
        self._served_inode: int | None = None
        self._registered_with: int | None = None  # the inode of the kubelet.sock we registered at
        self._waiting_logged = False  # "no kubelet yet" said once per wait

    def run(self) -> None:
        """Until `stop()`. Raises RegistrationRefused when the kubelet says no."""
        if not self.config.plugin_dir.is_dir():
            raise GpuvirtError(
                f"kubelet plugin directory {self.config.plugin_dir} does not exist; "
                "is this a Kubernetes node (or is --plugin-dir wrong)?"
            )
        _refuse_if_served(self.endpoint)
        self.watcher.start()
        with INotify() as inotify:
            inotify.add_watch(
                self.config.plugin_dir, in_flags.CREATE | in_flags.DELETE | in_flags.MOVED_TO
            )
            try:
                self._serve()
                self._register()
                seen = self._log_health(None)
                while not self.stopping.is_set():
                    events = inotify.read(timeout=int(STREAM_CHECK_S * 1000))
                    serve, register = self._after(events)
                    if serve:
                        self.log("the kubelet cleared its directory; serving again")
                        self._serve()
                        self._registered_with = None
                    # A kubelet socket that exists but refused us was caught between its
                    # bind and its listen: no further event comes, so try again each tick.
                    retry = self._registered_with is None and self.kubelet.exists()
                    if serve or register or retry:
                        self._register()
                    seen = self._log_health(seen)
            finally:
                self._shutdown()

    def stop(self) -> None:
        self.stopping.set()
        self.watcher.stop()

    def _log_health(self, seen: dict[str, str] | None) -> dict[str, str]:
        view = self.watcher.view
        health = view.health()
        if health != seen:
            states = {dev.device_id(v.index): v.state for v in view.vfs}
            error = self.watcher.last_error
            where = "" if view.reachable else f" (host unreachable: {error or 'not tried yet'})"
            self.log(
                "devices: " + ", ".join(f"{d} {h} ({states[d]})" for d, h in health.items()) + where
            )
        return health

    def _after(self, events: list[Any]) -> tuple[bool, bool]:
        """(serve again, register again) after these directory events. A restarting
        kubelet removes the sockets there (ours too) and creates a new kubelet.sock."""
        serve = register = False
        for ev in events:
            if ev.name == self.endpoint.name and ev.mask & in_flags.DELETE and not self._serving():
                serve = True
            if ev.name == KUBELET_SOCKET and ev.mask & in_flags.DELETE:
                self._registered_with = None  # that kubelet is gone (an inode may be reused)
            if ev.name == KUBELET_SOCKET and ev.mask & (in_flags.CREATE | in_flags.MOVED_TO):
                register = register or self._inode(self.kubelet) != self._registered_with
        return serve, register

    @staticmethod
    def _inode(path: Path) -> int | None:
        try:
            return os.stat(path).st_ino
        except OSError:
            return None

    def _serving(self) -> bool:
        return self._served_inode is not None and self._inode(self.endpoint) == self._served_inode

    def _serve(self) -> None:
        self._shutdown()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS))
        pb_grpc.add_DevicePluginServicer_to_server(
            DevicePluginService(self.watcher, self.stopping), server
        )
        with contextlib.suppress(FileNotFoundError):
            self.endpoint.unlink()
        server.add_insecure_port(f"unix://{self.endpoint}")
        server.start()
        self._server = server
        self._served_inode = os.stat(self.endpoint).st_ino

    def _shutdown(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1).wait()
            self._server = None
            if self._serving():
                self.endpoint.unlink()
            self._served_inode = None

    def _register(self) -> bool:
        """True once registered; False while no kubelet listens (it will create its
        socket when it starts, and inotify tells us)."""
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=self.endpoint.name,
            resource_name=self.config.resource,
            options=pb.DevicePluginOptions(get_preferred_allocation_available=True),
        )
        inode = self._inode(self.kubelet)
        with grpc.insecure_channel(f"unix://{self.kubelet}") as channel:
            try:
                pb_grpc.RegistrationStub(channel).Register(request, timeout=REGISTER_TIMEOUT_S)
            except grpc.RpcError as e:
                code = e.code()
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    if not self._waiting_logged:
                        self.log(f"no kubelet at {self.kubelet} yet; registering once it is there")
                        self._waiting_logged = True
                    return False
                raise RegistrationRefused(
                    f"the kubelet at {self.kubelet} refused to register {self.config.resource} "
                    f"(endpoint {self.endpoint.name}, API {API_VERSION}): {code.name}: {e.details()}"
                ) from None
        self._registered_with = inode
        self._waiting_logged = False
        self.log(f"registered {self.config.resource} with the kubelet at {self.kubelet}")
        return True


def _refuse_if_served(path: Path) -> None:
    """Never take over the socket of another plugin that is still serving."""
    if not socket_served(path):
        return
    raise GpuvirtError(
        f"another device plugin is serving at {path}; stop it or give this one another --resource"
    )
