"""The gRPC face: plugin registration and the kubelet's DRA v1 service, thin over State.

Two sockets, as the kubelet's own plugin helper lays them out: the
registration socket in plugins_registry (the kubelet's plugin watcher finds
it there, calls GetInfo, then NotifyRegistrationStatus) and the DRA service
socket in the plugin's own directory (named in GetInfo's endpoint). A claim
that fails is reported in its own entry of the response; an RPC never fails
as a whole, so one bad claim never holds up the others.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from gpuvirt.errors import GpuvirtError
from gpuvirt.k8s.dra.params import DRIVER
from gpuvirt.k8s.dra.state import ClaimRef, State
from gpuvirt.k8s.proto.dra.v1 import api_pb2 as dra
from gpuvirt.k8s.proto.dra.v1 import api_pb2_grpc as dra_grpc
from gpuvirt.k8s.proto.pluginregistration.v1 import api_pb2 as reg
from gpuvirt.k8s.proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc

log = logging.getLogger("gpuvirt.k8s.dra")

PLUGIN_TYPE = "DRAPlugin"
SUPPORTED_VERSIONS = ("v1.DRAPlugin",)
DRA_SOCKET = "dra.sock"
REGISTRATION_SOCKET = f"{DRIVER}-reg.sock"


class Registration(reg_grpc.RegistrationServicer):
    def __init__(self, endpoint: Path, on_status: Callable[[bool, str], None]) -> None:
        self.endpoint = endpoint
        self.on_status = on_status

    def GetInfo(self, request: reg.InfoRequest, context: Any) -> reg.PluginInfo:
        return reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=DRIVER,
            endpoint=str(self.endpoint),
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: Any
    ) -> reg.RegistrationStatusResponse:
        self.on_status(request.plugin_registered, request.error)
        return reg.RegistrationStatusResponse()


class DRAPlugin(dra_grpc.DRAPluginServicer):
    def __init__(self, state: State) -> None:
        self.state = state

    def NodePrepareResources(
        self, request: dra.NodePrepareResourcesRequest, context: Any
    ) -> dra.NodePrepareResourcesResponse:
        resp = dra.NodePrepareResourcesResponse()
        for c in request.claims:
            entry = resp.claims[c.uid]
            try:
                for d in self.state.prepare(ClaimRef(c.namespace, c.name, c.uid)):
                    entry.devices.append(
                        dra.Device(
                            request_names=[d.request],
                            pool_name=d.pool,
                            device_name=d.device,
                            cdi_device_ids=d.cdi_ids,
                        )
                    )
            except Exception as e:
                entry.error = _failed("prepare", c, e)
        return resp

    def NodeUnprepareResources(
        self, request: dra.NodeUnprepareResourcesRequest, context: Any
    ) -> dra.NodeUnprepareResourcesResponse:
        resp = dra.NodeUnprepareResourcesResponse()
        for c in request.claims:
            entry = resp.claims[c.uid]
            try:
                self.state.unprepare(ClaimRef(c.namespace, c.name, c.uid))
            except Exception as e:
                entry.error = _failed("unprepare", c, e)
        return resp


def _failed(what: str, c: dra.Claim, e: Exception) -> str:
    if isinstance(e, GpuvirtError):
        message = str(e)
        log.warning("%s claim %s/%s (%s) failed: %s", what, c.namespace, c.name, c.uid, message)
    else:
        # Our bug, not the claim's: say so, keep serving.
        message = f"internal error in the {DRIVER} driver: {e!r}"
        log.exception("%s claim %s/%s (%s)", what, c.namespace, c.name, c.uid)
    return message


class Servers:
    """Both gRPC servers, with their sockets made on start and removed on stop."""

    def __init__(
        self,
        state: State,
        registry_dir: Path,
        plugin_dir: Path,
        on_status: Callable[[bool, str], None],
    ) -> None:
        self.dra_socket = plugin_dir / DRA_SOCKET
        self.registration_socket = registry_dir / REGISTRATION_SOCKET
        self._dra = _server(self.dra_socket)
        dra_grpc.add_DRAPluginServicer_to_server(DRAPlugin(state), self._dra)
        self._reg = _server(self.registration_socket)
        reg_grpc.add_RegistrationServicer_to_server(
            Registration(self.dra_socket, on_status), self._reg
        )

    def start(self) -> Servers:
        # The DRA service first: the kubelet calls it as soon as registration succeeds.
        self._dra.start()
        self._reg.start()
        return self

    def stop(self) -> None:
        # The registration socket goes first, so the kubelet deregisters us before
        # the service disappears.
        self._reg.stop(grace=1).wait()
        _unlink(self.registration_socket)
        self._dra.stop(grace=5).wait()
        _unlink(self.dra_socket)


def _server(socket: Path) -> grpc.Server:
    socket.parent.mkdir(parents=True, exist_ok=True)
    _unlink(socket)  # left by a plugin that died; ours now
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="dra-grpc"))
    try:
        port = server.add_insecure_port(f"unix://{socket}")
    except RuntimeError:
        port = 0
    if port == 0:
        raise GpuvirtError(f"cannot listen on {socket}")
    return server


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
