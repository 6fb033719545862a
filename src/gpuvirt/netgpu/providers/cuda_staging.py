"""``cuda-staging``: NetGPU receive where the FB is device memory the guest cannot map.

DESIGN.md: receive into pinned staging chunks, copy asynchronously into the
VF's device pool, recycle staging chunks when the copy completes, device
chunks when the app releases the token.

Each read takes a chunk of the VF's staging area (pinned by the engine),
`recv_into`s it, and commits a COPY_IN of what arrived to the read's place in
the pool; the engine DMAs it on its stream while the receiver reads the next
chunk (guest/staging.py, StagedUpload). A staging chunk comes back when its
copy has completed; a receiver that outruns the copies waits for the oldest
one, and while it waits it does not read its socket: TCP backpressure. The CPU
touches the payload once, in the kernel's socket copy into staging; the DMA
moves it to the device.

What differs from ``userspace`` for the receiver (rx.py): there is no host view
of the pool, so a read is addressed by FB offset (a DeviceRange), bytes the
receiver already holds go through `write_at`, and a fragment may be handed out
only once its copy has completed: `copies` (the StagedUpload) numbers the reads
(`committed`), says without waiting whether the first n are known to be in device
memory (`landed(n)`) and waits for them (`wait(n)`); `flush()` waits for all.
settled.py's SettledRx hands each fragment out once its own reads have landed, and
reads on meanwhile: it never waits for a copy while the socket has data for the next
read (docs/netgpu.md, "The staged path").
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from gpuvirt.netgpu.errors import NetGPUError
from gpuvirt.netgpu.providers.base import Provider, Reader

if TYPE_CHECKING:
    from gpuvirt.guest.api import Gpu, StagedFB, StagedUpload
    from gpuvirt.netgpu.pool import Pool

# One read moves at most this much. Large enough that the per-copy round trip to the
# engine (tens of µs) is small beside the copy; small enough that several are in flight.
STAGING_CHUNK = 1 << 20
MIN_CHUNK = 64 << 10
# Chunks per COPY_IN: one message, one reply and one engine wake-up per batch. Fewer
# cost the engine more messages where it shares the receiver's CPU: on a 2-CPU VM,
# batches of 1 / 2 / 4 ran framed · 4 at 2.95 / 3.30 / 4.32 GB/s (medians).
BATCH_CHUNKS = 4
# A ring of one batch and one chunk more: the receiver fills that chunk while the batch
# copies. A larger ring overlaps more but spreads the socket's copy over more chunks,
# and a receiver's CPU per GB grows with the chunks it cycles through (a plain receiver
# on the 2-CPU AMD VM: 0.056 s/GB over 1 chunk, 0.071 over 5, 0.087 over 8). A ring of
# 8 (two batches) against 5, 12 alternations of the full `bench netgpu`: staged
# throughput 0.464 against 0.532 × raw, CPU 2.42 against 1.97 × (medians;
# docs/netgpu-staged-log.md, "A seventh look").
RING_CHUNKS = BATCH_CHUNKS + 1


class DeviceRange(NamedTuple):
    """A range of the FB, where a host view would have given a memoryview slice."""

    fb_offset: int
    nbytes: int


class DeviceWindow:
    """An unmapped pool's stand-in for its host view, so a receiver (stream.py) addresses
    it the same way: a slice is a DeviceRange to receive into; assigning to a slice
    places bytes the receiver already holds (auto mode's first bytes) with `write_at`."""

    def __init__(self, provider: CudaStagingProvider, fb_offset: int, nbytes: int) -> None:
        self._provider = provider
        self._fb_offset = fb_offset
        self._nbytes = nbytes

    def __len__(self) -> int:
        return self._nbytes

    def __getitem__(self, where: slice) -> DeviceRange:
        start, stop, step = where.indices(self._nbytes)
        if step != 1:
            raise ValueError("a pool window is sliced contiguously")
        return DeviceRange(self._fb_offset + start, max(0, stop - start))

    def __setitem__(self, where: slice, data: bytes) -> None:
        target = self[where]
        if len(data) != target.nbytes:
            raise ValueError(f"{len(data)} bytes for a {target.nbytes}-byte range")
        self._provider.write_at(target.fb_offset, data)


class CudaStagingProvider(Provider):
    name = "cuda-staging"
    placement = "receiver"
    # Pool memory is device memory: Pool must not ask the FB for a host view of it.
    mapped: ClassVar[bool] = False

    def __init__(self) -> None:
        self._up: StagedUpload | None = None

    @classmethod
    def probe(cls, gpu: Gpu) -> str | None:
        staged = gpu.staging()
        if staged is None:
            return (
                "cuda-staging serves VFs of a cuda host (an NVIDIA GPU driven through CuPy, "
                'device.backend = "cuda"); this VF\'s FB is mapped into this process (emu '
                "backend), and `userspace` receives straight into it without a staging copy "
                "(gpu.add_staging() gives an emu VF the staging path, to test or measure it)"
            )
        free = staged.staging.free_bytes
        if free < 2 * MIN_CHUNK:
            return (
                f"the VF's staging area has {free} bytes free, less than two "
                f"{MIN_CHUNK}-byte chunks; close other NetGPU pools of this VF"
            )
        return None

    # ---- Provider ------------------------------------------------------------------------

    def bind(self, pool: Pool) -> None:
        gpu = pool._gpu
        staged = gpu.staging()
        if staged is None:
            raise NetGPUError(f"VF{gpu.vf} has no staging area; cuda-staging cannot serve it")
        self.attach(staged, max_chunk=pool.chunk)

    def unbind(self, pool: Pool) -> None:
        self.detach()

    def window(self, pool: Pool) -> DeviceWindow:
        return DeviceWindow(self, pool.offset, pool.nbytes)

    def reader(self, sock: socket.socket) -> Reader:
        """recv_into's shape over the pool's window: a DeviceRange (a slice of the window)
        is received through staging (StagedUpload.receive: into a staging chunk, then its
        copy to the range is committed); host memory (a header) directly."""
        receive = self._upload().receive
        recv_into = sock.recv_into

        def recv(target: Any, nbytes: int = 0, flags: int = 0) -> int:
            if target.__class__ is DeviceRange:
                return receive(recv_into, target.fb_offset, nbytes or target.nbytes, flags)
            return recv_into(target, nbytes, flags)

        return recv

    def received(self) -> Any:
        """The bytes of the latest read, in staging (for a crc32): there is no host view."""
        return self._upload().last_read()

    # ---- the staging path --------------------------------------------------------------

    def attach(self, staged: StagedFB, max_chunk: int | None = None) -> None:
        """Take a ring of staging chunks for this pool's reads."""
        free = staged.staging.free_bytes
        chunk = min(STAGING_CHUNK, max_chunk or STAGING_CHUNK, free // 2)
        chunk = chunk // 4096 * 4096
        if chunk < 4096:
            raise NetGPUError(f"staging area has {free} bytes free; too little to receive through")
        nchunks = max(2, min(RING_CHUNKS, free // chunk))
        self._up = staged.upload(chunk, nchunks)  # batches of nchunks - 1

    def detach(self) -> None:
        up, self._up = self._up, None
        if up is not None:
            up.close()

    def write_at(self, fb_offset: int, data: bytes) -> None:
        """Place bytes the receiver already holds (auto mode's first bytes) at fb_offset."""
        up = self._upload()
        pos = 0
        while pos < len(data):
            chunk = up.acquire()
            k = min(len(data) - pos, chunk.nbytes)
            chunk.array[:k] = memoryview(data)[pos : pos + k]
            up.commit(chunk, fb_offset + pos, k)
            pos += k

    @property
    def copies(self) -> StagedUpload:
        """The ring the reads go through (StagedUpload): `committed` numbers the reads
        (and write_at pieces) whose copy has started, `completed()` how many of them are
        in device memory, `landed(n)` says without waiting whether the first n are,
        `wait(n)` waits for them. A receiver asks these per fragment, directly."""
        return self._upload()

    def flush(self) -> None:
        """Wait until every read so far is in device memory."""
        if self._up is not None:
            self._up.drain()

    def _upload(self) -> StagedUpload:
        if self._up is None:
            raise NetGPUError("cuda-staging provider is not bound to a pool")
        return self._up
