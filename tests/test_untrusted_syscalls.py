"""Hostile tenant: kernel interfaces outside the seccomp filter's first list (issue 31).

io_uring (its SQPOLL thread runs off the device's CPU, and its socket op never
passes the filter), socket families smuggled past a 64-bit comparison in the
high bits the kernel ignores, and AF_VSOCK (no network namespace; the
hypervisor on a VM). Each is tried for real by a kernel on VF 1 of a root
host with confinement required; the same call made here, unconfined, is the
control that shows the attack is real on this machine. No test connects,
binds or sends to any vsock address: the socket itself is what is refused.
"""

from __future__ import annotations

import socket

import pytest

from confine_env import hostile_scene
from helpers import MakeHost
from hostile import k_io_uring, k_socket_families

pytestmark = pytest.mark.timeout(180)

HIGH = 1 << 32  # above the 32 bits of `int family` the kernel reads
REFUSED = {
    "AF_INET": socket.AF_INET, "AF_INET6": socket.AF_INET6, "AF_NETLINK": socket.AF_NETLINK,
    "AF_PACKET": socket.AF_PACKET, "AF_VSOCK": socket.AF_VSOCK,
    "AF_INET+high": HIGH | socket.AF_INET, "AF_INET6+high": HIGH | socket.AF_INET6,
    "AF_NETLINK+high": HIGH | socket.AF_NETLINK, "AF_VSOCK+high": HIGH | socket.AF_VSOCK,
    # AF_UNIX itself, but spelled so that only the low 32 bits say so: refused too,
    # the filter allows one exact value
    "AF_UNIX+high": HIGH | socket.AF_UNIX,
}  # fmt: skip


def test_io_uring_is_refused(make_host: MakeHost) -> None:
    control = k_io_uring(None)  # here, as root, with no filter
    assert control["io_uring_setup"] == "ok", control
    with hostile_scene(make_host) as sc:
        got = sc.gpu.launch(k_io_uring).result(30)
        assert got == dict.fromkeys(got, "ENOSYS"), got  # as on a kernel without io_uring
        assert sc.neighbour_ok()


def test_only_unix_sockets_whatever_the_high_bits(make_host: MakeHost) -> None:
    control = k_socket_families(None, {"AF_INET+high": HIGH | socket.AF_INET})
    assert control["socket AF_INET+high"] == "ok", control  # the kernel reads 32 bits
    vsock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)  # never connected nor bound
    vsock.close()
    with hostile_scene(make_host) as sc:
        got = sc.gpu.launch(k_socket_families, {**REFUSED, "AF_UNIX": socket.AF_UNIX}).result(30)
        assert got.pop("socket AF_UNIX") == "ok"  # the engine's own channels
        assert got.pop("socketpair AF_UNIX") == "ok"
        assert got == dict.fromkeys(got, "EAFNOSUPPORT"), got
        assert sc.neighbour_ok()
