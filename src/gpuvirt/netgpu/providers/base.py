"""The provider interface: how received bytes get into a pool's device memory.

A provider is the one part of NetGPU that knows the data path under the
socket; pools, receivers and tokens are the same for every provider.

- ``userspace`` (now): the receiver chooses where bytes go; the provider
  hands back a function that ``recv_into``s the mapped FB. TCP/IP runs in the
  kernel, the copy out of the socket lands directly in device memory.
- ``devmem`` (later, Linux devmem TCP): the pool's memory is a dma-buf bound
  to a NIC rx queue (netlink ``NETDEV_CMD_BIND_RX``); the NIC splits headers
  from payload and DMAs payload into the dma-buf; ``recvmsg(MSG_SOCK_DEVMEM)``
  reports each fragment as (offset, size, token) in an ``SCM_DEVMEM_DMABUF``
  cmsg, and ``setsockopt(SO_DEVMEM_DONTNEED)`` returns tokens.
- ``io_uring-zcrx`` (later): the same split, with the refill ring in place of
  ``SO_DEVMEM_DONTNEED``.

The kernel-placed kinds choose the offset themselves, so they will add a
``placement = "kernel"`` implementation of the receive step; ``probe`` and
``bind``/``unbind`` already fit them, and Frag/token/release need no change
because a pool fragment already is (offset, size, token).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import socket

    from gpuvirt.guest.api import Gpu
    from gpuvirt.netgpu.pool import Pool

Reader = Callable[[memoryview, int, int], int]
"""recv_into's shape, (view, nbytes, flags) → bytes received into the view (device
memory), 0 at the end of the stream; flags are MSG_* flags (MSG_WAITALL)."""


class Provider(ABC):
    name: ClassVar[str]
    # "receiver": the receiver says where each read lands (recv_into).
    # "kernel": the kernel/NIC places the data and reports where (devmem, zcrx).
    placement: ClassVar[str] = "receiver"
    # Whether the pool's memory is mapped into this process (pool.memory, frag.array());
    # False: device memory only the engine reaches, and `window` stands in for the view.
    mapped: ClassVar[bool] = True

    @classmethod
    @abstractmethod
    def probe(cls, gpu: Gpu) -> str | None:
        """None when this provider can serve the VF, else the reason it cannot (for people)."""

    @abstractmethod
    def bind(self, pool: Pool) -> None:
        """Make the pool's memory ready to receive into, before any socket is read."""

    def unbind(self, pool: Pool) -> None:
        """Undo `bind` when the pool closes."""

    def window(self, pool: Pool) -> Any:
        """An unmapped provider's stand-in for the pool's host view (see cuda_staging)."""
        raise NotImplementedError(f"{self.name} maps the pool; it needs no window")

    def received(self) -> Any:
        """An unmapped provider: the bytes of its latest read, in host memory (a crc32)."""
        raise NotImplementedError(f"{self.name} maps the pool; read them there")

    def flush(self) -> None:
        """Wait until every read so far is in device memory; at once where reads land
        in place (a mapped pool)."""

    @abstractmethod
    def reader(self, sock: socket.socket) -> Reader:
        """The function a receiver calls to move bytes from `sock` into device memory."""
