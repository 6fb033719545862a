"""Kubernetes integration: the device plugin (and the DRA driver), clients of a host's
admin API only; they never import the host's internals."""
