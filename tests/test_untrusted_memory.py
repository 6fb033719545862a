"""A guest attacks the memory it was given: the host and its other tenants never notice.

The reported attack: a guest found its FB descriptor under /proc/self/fd and
called ftruncate(fd, 0); the host died of SIGBUS at its next read of the VF2PF
block, taking every VF with it. The memfds are now sealed against shrinking
and growing, so the call fails with EPERM and the host keeps serving.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import numpy as np
import pytest

import gpuvirt
from gpuvirt.device.memfd import SEALS, sealed_memfd
from gpuvirt.errors import DeviceError
from helpers import MakeHost, wait_until

pytestmark = pytest.mark.timeout(120)


def _square(xp, b) -> None:
    b *= b


def own_fb_fds(vf: int) -> list[int]:
    """This process's descriptors of VF `vf`'s FB, found as a tenant would find them."""
    out = []
    for entry in Path("/proc/self/fd").iterdir():
        try:
            target = entry.readlink().as_posix()
        except OSError:
            continue
        if target.startswith(f"/memfd:gpuvirt-vf{vf}-fb"):
            out.append(int(entry.name))
    return out


def checked_square(gpu: gpuvirt.Gpu, n: int) -> None:
    x = gpu.alloc(n, np.int64)
    x.write(np.arange(n))
    gpu.launch(_square, x).result(10)
    assert x.read().tolist() == [i * i for i in range(n)]


def wait_vf2pf_read(hp, vf: int, after: float, timeout: float = 30) -> None:
    """Until the host has read VF `vf`'s VF2PF block from its mapping since `after`."""
    wait_until(
        lambda: (hp.admin.vf(vf)["vf2pf_read_at"] or 0) > after, timeout,
        "the host reading the VF2PF block again", every=0.5,
    )  # fmt: skip


@pytest.mark.parametrize("size", [0, 4096, 1 << 40])
def test_a_guest_cannot_resize_its_fb_and_the_host_keeps_serving(
    make_host: MakeHost, size: int
) -> None:
    hp = make_host()
    with (
        gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as honest,
        gpuvirt.attach(vf=1, socket=hp.socket, token=hp.token(1)) as hostile,
    ):
        checked_square(hostile, 16)
        fds = own_fb_fds(1)
        assert fds, "the guest holds its FB descriptor (the attack's starting point)"
        attacked_at = time.time()
        for fd in fds:
            with pytest.raises(PermissionError) as err:
                os.ftruncate(fd, size)
            assert err.value.errno == errno.EPERM
        # The host reads both info blocks from its own mappings after the attempt,
        # and both tenants' kernels still give the right numbers.
        wait_vf2pf_read(hp, 1, attacked_at)
        wait_vf2pf_read(hp, 0, attacked_at)
        checked_square(honest, 64)
        checked_square(hostile, 64)
    assert hp.alive()
    assert {v["state"] for v in hp.status()["vfs"]} == {"AVAIL"}


def test_sealed_memfd_refuses_resizing_but_allows_scrub() -> None:
    fd = sealed_memfd("gpuvirt-test", 1 << 20)
    try:
        import fcntl

        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
        for size in (0, 1 << 19, 2 << 20):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        with pytest.raises(PermissionError):  # nobody can lift the seals either
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        os.pwrite(fd, b"\xab" * 4096, 8192)
        from gpuvirt.device.emu import punch_hole

        punch_hole(fd, 1 << 20)  # the scrub still works on a sealed FB
        assert os.pread(fd, 4096, 8192) == bytes(4096)
        assert os.fstat(fd).st_size == 1 << 20
    finally:
        os.close(fd)


def test_sealed_memfd_reports_a_bad_size() -> None:
    with pytest.raises(DeviceError, match="memfd gpuvirt-test of -1 bytes"):
        sealed_memfd("gpuvirt-test", -1)


def test_garbage_in_the_vf2pf_block_is_an_event_not_a_host_crash(make_host: MakeHost) -> None:
    import mmap
    import threading

    from gpuvirt.bench.hostile import RawGuest
    from gpuvirt.config import parse_token
    from gpuvirt.protocol.info import BLOCK_SIZE, VF2PF_OFFSET
    from gpuvirt.protocol.mailbox import Frame, GuestMsg, HostMsg
    from helpers import last_seq, wait_event

    hp = make_host()
    after = last_seq(hp)
    with (
        gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as honest,
        RawGuest.attached(hp.socket, 1, parse_token(hp.token(1))) as g,
    ):
        assert g.init().msg == HostMsg.READY_TO_ACCESS_GPU
        g.send(Frame(GuestMsg.REL_GPU_INIT_ACCESS))
        assert g.recv().msg == HostMsg.SUCCESS  # ACTIVE: the host reads VF2PF from now on
        aperture = g.fds[0]
        mem = mmap.mmap(aperture, os.fstat(aperture).st_size, mmap.MAP_SHARED)
        rng = np.random.default_rng(3)
        garbage = rng.integers(0, 256, BLOCK_SIZE, dtype=np.uint8).tobytes()
        mem[VF2PF_OFFSET : VF2PF_OFFSET + BLOCK_SIZE] = garbage
        threading.Thread(target=g.drain, daemon=True).start()
        ev = wait_event(hp, lambda e: e["kind"] == "vf2pf.untrusted" and e["vf"] == 1, after=after)
        assert "no longer read" in ev["message"]
        assert hp.admin.vf(1)["vf2pf_untrusted"] is True
        checked_square(honest, 32)  # the neighbour never noticed
        mem.close()
    assert hp.alive()
