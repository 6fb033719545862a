"""`gpuvirt k8s dra-plugin`: the DRA kubelet plugin process, wired together.

Start order: checkpoint (a damaged one stops us here, before anything is
served) → ResourceSlice publisher → gRPC servers → wait. Stop (SIGTERM, or the
kubelet refusing the registration): servers down, slices deleted. The host is
reached only through its admin API, so it may restart under us; the slice
shows its VFs Unhealthy meanwhile and prepares fail until it is back.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from gpuvirt.admin_client import AdminClient
from gpuvirt.config import HostConfig
from gpuvirt.errors import GpuvirtError
from gpuvirt.k8s.dra.checkpoint import Checkpoint
from gpuvirt.k8s.dra.driver import Servers
from gpuvirt.k8s.dra.kube import Kube, api_client
from gpuvirt.k8s.dra.slices import SlicePublisher
from gpuvirt.k8s.dra.state import State

log = logging.getLogger("gpuvirt.k8s.dra")

READY_PREFIX = "gpuvirt dra-plugin: serving"
CHECKPOINT = "checkpoint.json"


@dataclass(frozen=True, slots=True)
class Options:
    node: str
    registry_dir: Path
    plugin_dir: Path
    cdi_dir: Path
    kubeconfig: Path | None


def run(config: HostConfig, opts: Options) -> int:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
    )
    host = AdminClient(config.host.admin_address(create=False))
    kube = Kube(api_client(opts.kubeconfig))
    checkpoint = Checkpoint(opts.plugin_dir / CHECKPOINT).load()
    state = State(opts.node, host, kube.claim, checkpoint, opts.cdi_dir)

    stop = threading.Event()
    refused: list[str] = []

    def on_status(registered: bool, error: str) -> None:
        if registered:
            log.info("registered with the kubelet as DRA driver gpuvirt.io")
        else:
            refused.append(error)
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    publisher = SlicePublisher(kube, host, opts.node).start()
    servers = Servers(state, opts.registry_dir, opts.plugin_dir, on_status).start()
    print(
        f"{READY_PREFIX} {servers.dra_socket}, registration {servers.registration_socket},"
        f" node {opts.node}, {len(checkpoint.claims)} prepared claim(s) from the checkpoint",
        flush=True,
    )
    stop.wait()
    servers.stop()
    try:
        publisher.stop()
    except GpuvirtError as e:
        log.warning("ResourceSlices of node %s not removed: %s", opts.node, e)
    if refused:
        print(f"gpuvirt dra-plugin: the kubelet refused the registration: {refused[0]}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0
