"""Pinned upstream Kubernetes .proto files and the Python stubs generated from them.

The stubs are committed; `python -m gpuvirt.k8s.proto.generate` rewrites them, and
tests/test_k8s_stubs.py checks that doing so changes nothing.
"""
