"""`gpuvirt k8s ...`: run this node's gpuvirt host as Kubernetes resources."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from gpuvirt.admin_client import AdminClient
from gpuvirt.cli.common import ConfigOpt, config_or_exit, fail
from gpuvirt.cli.k8s_dra import dra_plugin
from gpuvirt.errors import GpuvirtError
from gpuvirt.k8s import DEFAULT_PLUGIN_DIR, DEFAULT_RESOURCE

app = typer.Typer(help="Kubernetes: hand this node's VFs to pods.", no_args_is_help=True)


@app.command("device-plugin")
def device_plugin(
    config: ConfigOpt = None,
    plugin_dir: Annotated[
        Path, typer.Option(help="The kubelet's device plugin directory (holds kubelet.sock).")
    ] = DEFAULT_PLUGIN_DIR,
    resource: Annotated[
        str, typer.Option(help="Extended resource name pods ask for.")
    ] = DEFAULT_RESOURCE,
) -> None:
    """Kubernetes device plugin (API v1beta1): one device per VF of the host, health
    following its state; Allocate hands a container the mailbox socket and its VF's token."""
    from gpuvirt.k8s.deviceplugin import DevicePlugin, PluginConfig
    from gpuvirt.k8s.hostwatch import HostWatcher

    cfg = config_or_exit(config)
    watcher = HostWatcher(AdminClient(cfg.host.admin_address(create=False)), cfg.sriov.vf_num)
    plugin = DevicePlugin(
        watcher,
        PluginConfig(plugin_dir, resource),
        lambda m: print(f"gpuvirt k8s: {m}", flush=True),
    )
    # The plugin runs on the main thread, which gets the signals; it looks at its
    # stop flag at least once a second.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: plugin.stop())
    try:
        plugin.run()
    except GpuvirtError as e:
        raise fail(str(e)) from None


app.command("dra-plugin")(dra_plugin)
