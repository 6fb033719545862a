"""``userspace``: recv_into straight into the guest's mapping of its FB.

On ``emu`` the guest maps its whole FB, so a pool chunk is plain memory the
kernel's TCP receive can copy into: the one copy every socket read makes
(socket buffer → user memory) lands in device memory, and no intermediate
buffer or second copy exists.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from gpuvirt.netgpu.providers.base import Provider, Reader
from gpuvirt.protocol.info import FEATURE_FB_MAPPED

if TYPE_CHECKING:
    from gpuvirt.guest.api import Gpu
    from gpuvirt.netgpu.pool import Pool


class UserspaceProvider(Provider):
    name = "userspace"

    @classmethod
    def probe(cls, gpu: Gpu) -> str | None:
        if gpu.info is None or not gpu.info.feature_flags & FEATURE_FB_MAPPED:
            return (
                "userspace receive needs the guest to map its FB (the emu backend); this VF's "
                "FB is device memory: cuda-staging serves it"
            )
        return None

    def bind(self, pool: Pool) -> None:
        # Touch every page now: the first write to a page of the FB's memfd
        # allocates it, and that should happen here, not inside recv at line rate.
        pool.memory.fill(0)

    def reader(self, sock: socket.socket) -> Reader:
        return sock.recv_into
