"""`gpuvirt k8s dra-plugin`: the DRA driver's kubelet plugin (see gpuvirt.k8s.dra)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated

import typer

from gpuvirt.cli.common import ConfigOpt, config_or_exit, fail
from gpuvirt.errors import GpuvirtError


def dra_plugin(
    config: ConfigOpt = None,
    node_name: Annotated[
        str | None,
        typer.Option(
            help="This node's name in the cluster (default: $NODE_NAME, else the hostname)"
        ),
    ] = None,
    registry_dir: Annotated[
        Path, typer.Option(help="The kubelet's plugin registration directory")
    ] = Path("/var/lib/kubelet/plugins_registry"),
    plugin_dir: Annotated[
        Path, typer.Option(help="This plugin's directory: its DRA socket and checkpoint")
    ] = Path("/var/lib/kubelet/plugins/gpuvirt.io"),
    cdi_dir: Annotated[
        Path, typer.Option(help="Where the container runtime reads CDI specs")
    ] = Path("/var/run/cdi"),
    kubeconfig: Annotated[
        Path | None,
        typer.Option(
            help="API server access (default: the pod's service account, else $KUBECONFIG)"
        ),
    ] = None,
) -> None:
    """Serve the DRA driver gpuvirt.io: publish this node's VFs, prepare claims for pods."""
    from gpuvirt.k8s.dra.plugin import Options, run

    cfg = config_or_exit(config)
    node = node_name or os.environ.get("NODE_NAME") or socket.gethostname()
    opts = Options(node, registry_dir, plugin_dir, cdi_dir, kubeconfig)
    try:
        code = run(cfg, opts)
    except GpuvirtError as e:
        raise fail(str(e)) from None
    raise typer.Exit(code)
