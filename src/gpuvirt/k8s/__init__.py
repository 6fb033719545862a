"""Kubernetes integration: the device plugin (and the DRA driver), clients of a host's
admin API only; they never import the host's internals.

This module imports nothing heavy (no gRPC), so the CLI can read the defaults cheaply.
"""

from pathlib import Path

DEFAULT_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
DEFAULT_RESOURCE = "gpuvirt.io/vf"
