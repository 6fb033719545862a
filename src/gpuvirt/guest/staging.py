"""FB access through a staging area, for backends whose FB the guest cannot map (cuda).

The guest maps its VF's aperture: the reserved head (info blocks) and after it
a staging area that the engine has pinned. A write copies the data into
staging and asks the engine for COPY_IN (staging → FB, a DMA on the engine's
stream); a read asks for COPY_OUT and copies out of staging. Large transfers
go in chunks through two halves of a window, so the guest's memcpy of one
chunk overlaps the engine's DMA of the other.

The staging area is shared with NetGPU's receive path, so it is handed out by
a small allocator: StagedFB takes its window once, NetGPU takes its chunks.
`Copy.staging_offset` is an offset in the aperture, as the engine expects.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gpuvirt.errors import GpuvirtError, OutOfMemoryError, VFResetError
from gpuvirt.guest.memory import Allocator
from gpuvirt.protocol.command import Copy, Kind
from gpuvirt.protocol.info import RESERVED_SIZE

if TYPE_CHECKING:
    from gpuvirt.guest.queue import CommandQueue, LaunchFuture

# Biggest piece one COPY_IN/COPY_OUT moves. Big enough that the per-message round
# trip (tens of µs) is small beside the copy, small enough to pipeline a few MiB.
MAX_CHUNK = 2 << 20
PAGE = 4096


class StagingArea:
    """The part of the aperture the engine can DMA from and to, handed out in pieces."""

    def __init__(self, mem: Any, start: int, size: int) -> None:
        if size <= 0:
            raise GpuvirtError(f"staging area of {size} bytes at aperture offset {start}: empty")
        self.start = start
        self.size = size
        self.array: np.ndarray | None = np.frombuffer(mem, dtype=np.uint8, count=size, offset=start)
        self._alloc = Allocator(start, start + size)

    @classmethod
    def of_aperture(cls, mem: Any) -> StagingArea:
        """The cuda layout: everything after the reserved head."""
        return cls(mem, RESERVED_SIZE, len(mem) - RESERVED_SIZE)

    def alloc(self, nbytes: int) -> int:
        """A piece of staging; returns its aperture offset."""
        try:
            return self._alloc.alloc(nbytes)
        except OutOfMemoryError:
            raise OutOfMemoryError(
                f"staging area full: {nbytes} bytes requested, {self._alloc.free_bytes} of "
                f"{self.size} free; release NetGPU pools you no longer use"
            ) from None

    def free(self, offset: int) -> None:
        self._alloc.free(offset)

    @property
    def free_bytes(self) -> int:
        return self._alloc.free_bytes

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """Staging memory at aperture offset `offset` as uint8."""
        arr = self.array
        if arr is None:
            # A reset or detach closed it under a transfer in another thread.
            raise VFResetError("the VF's staging area is gone: the VF was reset or detached")
        i = offset - self.start
        return arr[i : i + nbytes]

    def close(self) -> None:
        # Drop our export of the aperture mapping so the client can close it.
        self.array = None


class StagedFB:
    """FB access through staging copies: the same interface as memory.MappedFB."""

    def __init__(
        self, staging: StagingArea, queue: CommandQueue, size: int, chunk: int | None = None
    ) -> None:
        if chunk is None:
            # Two halves of a window that leaves most of staging to NetGPU.
            chunk = min(MAX_CHUNK, staging.size // 4 // PAGE * PAGE)
        if chunk <= 0:
            raise GpuvirtError(f"staging area of {staging.size} bytes is too small to copy through")
        self.staging = staging
        self.queue = queue
        self.size = size
        self.chunk = chunk
        window = staging.alloc(2 * chunk)
        self._slots = (window, window + chunk)
        self._lock = threading.Lock()  # one transfer at a time owns the window

    def write(self, offset: int, data: np.ndarray) -> None:
        n = int(data.size)
        with self._lock:
            inflight: list[LaunchFuture | None] = [None, None]
            try:
                pos = 0
                i = 0
                while pos < n:
                    slot = i & 1
                    # The copy that last used this half must be done before we refill it.
                    _settle(inflight, slot)
                    k = min(self.chunk, n - pos)
                    soff = self._slots[slot]
                    self.staging.view(soff, k)[:] = data[pos : pos + k]
                    inflight[slot] = self.queue.copy(Kind.COPY_IN, Copy(offset + pos, soff, k))
                    pos += k
                    i += 1
            finally:
                _settle_all(inflight)

    def read(self, offset: int, out: np.ndarray) -> None:
        n = int(out.size)
        with self._lock:
            # (future, slot, position in out, length), oldest first; at most two.
            inflight: list[tuple[LaunchFuture, int, int, int]] = []
            try:
                pos = 0
                i = 0
                while pos < n or inflight:
                    while pos < n and len(inflight) < 2:
                        slot = i & 1
                        k = min(self.chunk, n - pos)
                        fut = self.queue.copy(
                            Kind.COPY_OUT, Copy(offset + pos, self._slots[slot], k)
                        )
                        inflight.append((fut, slot, pos, k))
                        pos += k
                        i += 1
                    fut, slot, at, k = inflight[0]
                    fut.result()
                    inflight.pop(0)
                    out[at : at + k] = self.staging.view(self._slots[slot], k)
            finally:
                # On an error, wait out the other copy: it still writes into our window.
                for fut, *_ in inflight:
                    if not fut.done():
                        fut.exception()

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        raise GpuvirtError(
            "Buffer.view() needs a FB mapped into this process (the emu backend); this VF's "
            "FB is device memory: use Buffer.read()/write(), or work on it in a kernel"
        )

    def upload(self, chunk: int, nchunks: int, batch: int | None = None) -> StagedUpload:
        """A ring of `nchunks` staging chunks of `chunk` bytes for pipelined copies into
        the FB (NetGPU's receive), `batch` chunks per copy message; its `close()` hands
        them back."""
        return StagedUpload(self.staging, self.queue, chunk, nchunks, batch)

    def close(self) -> None:
        self.staging.close()


@dataclass(frozen=True)
class StagingChunk:
    """One piece of staging to fill: its aperture offset and its memory."""

    offset: int
    array: np.ndarray  # uint8, writable: recv_into it

    @property
    def nbytes(self) -> int:
        return int(self.array.size)


class StagedUpload:
    """Pipelined host → FB copies through a ring of staging chunks (NetGPU on cuda).

    The caller fills a chunk (`sock.recv_into(chunk.array)`), then commits it with
    its FB destination, and fills the next one meanwhile. Commits are numbered 1, 2,
    ... (`committed`) and go to the engine in batches of `batch` chunks: one COPY_IN
    message, one DONE, one synchronize for the batch, since each message costs the
    guest a send, a reply to read and a future, and wakes the engine. A batch goes
    when it is full, or sooner when the caller needs it: `wait(n)` sends what it waits
    for, `submit()` sends what is pending. `landed(n)` says, without waiting, sending
    or asking, whether the first n are known to be in the FB. Copies complete in
    commit order (one channel, one stream). A chunk is handed out again only once its copy has
    completed, so a caller that outruns the copies waits in `acquire`: that wait is
    what stops it reading its socket (backpressure). Chunks are reused most recently
    freed first: the one a copy just finished with is the likeliest to be in cache.
    """

    def __init__(
        self,
        staging: StagingArea,
        queue: CommandQueue,
        chunk: int,
        nchunks: int,
        batch: int | None = None,
    ) -> None:
        if nchunks < 2:
            raise ValueError(f"nchunks = {nchunks}: need at least 2 to overlap copy and fill")
        self.staging = staging
        self.queue = queue
        self.chunk = chunk
        # By default a batch is all of the ring but the chunk the caller fills while it
        # copies: the fewer chunks a socket's copy is spread over, the less it costs
        # (providers/cuda_staging.py, RING_CHUNKS).
        self.batch = batch or nchunks - 1
        self._offsets: list[int] = []
        try:
            for _ in range(nchunks):
                self._offsets.append(staging.alloc(chunk))
        except BaseException:
            for off in self._offsets:
                staging.free(off)
            raise
        # One StagingChunk per slot, made once: a read takes one and gives it back, and
        # runs per MiB received, so it builds no view or object of its own.
        ring = [StagingChunk(off, staging.view(off, chunk)) for off in self._offsets]
        self._free: list[StagingChunk] = ring  # a stack: see the class docstring
        self._pending: list[bytes] = []  # committed, not yet sent: packed Copy descriptors
        self._pending_chunks: list[StagingChunk] = []
        # (batch, its chunks)
        self._sent: deque[tuple[LaunchFuture, list[StagingChunk]]] = deque()
        self._last: tuple[StagingChunk, int] | None = None  # the latest `receive`
        self._lock = threading.Lock()
        self.committed = 0  # copies committed, ever
        self._submitted = 0  # of those, sent to the engine
        self._completed = 0  # of those, known to have landed

    def acquire(self) -> StagingChunk:
        """A chunk to fill; waits for the oldest copy in flight when none is free."""
        with self._lock:
            if not self._free:
                self._reap()
            while not self._free:
                if not self._sent:
                    self._submit()  # every chunk is in the pending batch
                if not self._sent:
                    raise GpuvirtError(
                        f"all {len(self._offsets)} staging chunks are acquired and none "
                        "committed or given back"
                    )
                self._retire(wait=True)
            return self._free.pop()

    def commit(self, chunk: StagingChunk, fb_offset: int, nbytes: int) -> int:
        """Copy the first nbytes of the chunk to fb_offset; the chunk recycles when done.
        Returns the commit's number (`landed(it)` once the bytes are known to be in the
        FB)."""
        if not 0 < nbytes <= chunk.nbytes:
            raise ValueError(f"commit of {nbytes} bytes from a {chunk.nbytes}-byte chunk")
        with self._lock:
            return self._commit(chunk, fb_offset, nbytes)

    def receive(self, recv_into: Any, fb_offset: int, nbytes: int, flags: int) -> int:
        """acquire, `recv_into(chunk, min(nbytes, chunk), flags)` and commit what came to
        fb_offset, in one call: NetGPU's staged receive does this once per read, so it
        costs one call and one lock beyond the recv. Returns the byte count (0: the
        stream ended, nothing committed); an error (BlockingIOError included) gives the
        chunk back and propagates. `last_read()` is what it brought in."""
        chunk = self.acquire()
        try:
            n = recv_into(chunk.array, min(nbytes, self.chunk), flags)
        except BaseException:
            self.give_back(chunk)
            raise
        if not n:
            self.give_back(chunk)
            return 0
        with self._lock:
            self._last = (chunk, n)
            self._commit(chunk, fb_offset, n)
        return n

    def last_read(self) -> np.ndarray | None:
        """The staging bytes the latest `receive` brought in (valid until the next one)."""
        last = self._last
        return None if last is None else last[0].array[: last[1]]

    def give_back(self, chunk: StagingChunk) -> None:
        """Return a chunk that was acquired but not committed (the sender closed, say)."""
        with self._lock:
            self._free.append(chunk)

    def submit(self) -> None:
        """Send the pending commits to the engine now, without waiting for them."""
        with self._lock:
            self._submit()

    def completed(self) -> int:
        """How many commits (in commit order) have landed in the FB; never waits. Raises
        a failed copy's error (the engine refused it, or the VF was reset)."""
        with self._lock:
            self._reap()
            return self._completed

    def landed(self, n: int) -> bool:
        """Whether the first n commits are known to be in the FB, from the replies taken
        so far (by `acquire` once the ring runs out, `completed`, `wait`); never waits,
        sends or asks the channel. A receiver asks this once per read, and a look at the
        channel would be a system call per read; the ring running out, or `wait`, brings
        the news in batches."""
        return n <= self._completed

    def wait(self, n: int) -> None:
        """Wait until the first n commits have landed (sending them if they are pending);
        raise a failure among them."""
        with self._lock:
            if n > self._submitted:
                self._submit()
            while self._completed < n and self._sent:
                self._retire(wait=True)

    def drain(self) -> None:
        """Send what is pending and wait for every copy; raise the first failure once all
        are done."""
        first: BaseException | None = None
        with self._lock:
            try:
                self._submit()
            except BaseException as e:
                first = e
            while self._sent:
                try:
                    self._retire(wait=True)
                except BaseException as e:
                    first = first or e
        if first is not None:
            raise first

    @property
    def in_flight(self) -> int:
        """Chunks committed and not yet known to have landed."""
        return self.committed - self._completed

    def close(self) -> None:
        """Wait out the copies (they read our chunks), then hand the staging back."""
        try:
            self.drain()
        finally:
            for off in self._offsets:
                self.staging.free(off)
            self._offsets.clear()
            self._free.clear()
            self._last = None

    def _commit(self, chunk: StagingChunk, fb_offset: int, nbytes: int) -> int:
        self._pending.append(Copy.pack(fb_offset, chunk.offset, nbytes))
        self._pending_chunks.append(chunk)
        self.committed += 1
        if len(self._pending) >= self.batch:
            self._submit()
        return self.committed

    def _submit(self) -> None:
        pending = self._pending
        if not pending:
            return
        chunks = self._pending_chunks
        self._pending, self._pending_chunks = [], []
        try:
            fut = self.queue.copy_packed(Kind.COPY_IN, b"".join(pending))
        except BaseException:
            self._free.extend(chunks)  # never sent: nothing reads them
            self._completed += len(chunks)
            self._submitted += len(chunks)
            raise
        self._sent.append((fut, chunks))
        self._submitted += len(chunks)

    def _reap(self) -> None:
        # Replies that have arrived settle their futures; recycle the finished batches.
        sent = self._sent
        if sent and not sent[0][0].done():
            self.queue.reap()
        while sent and sent[0][0].done():
            self._retire(wait=False)

    def _retire(self, wait: bool) -> None:
        """The oldest batch is done (or, with wait, will be): its chunks are free again."""
        fut, chunks = self._sent.popleft()
        try:
            if wait:  # a batch takes longer than the poll window: sleep, do not spin
                self.queue.wait(fut, None, poll=False)
            exc = fut.exception()  # settled by now: this reads no reply
        finally:
            self._free.extend(chunks)
            self._completed += len(chunks)
        if exc is not None:
            raise exc


def _settle(inflight: list[LaunchFuture | None], slot: int) -> None:
    fut = inflight[slot]
    if fut is not None:
        inflight[slot] = None
        fut.result()


def _settle_all(inflight: list[LaunchFuture | None]) -> None:
    """Wait for every copy still in flight; raise the first failure after all are done."""
    first: BaseException | None = None
    for slot in range(len(inflight)):
        try:
            _settle(inflight, slot)
        except BaseException as e:  # a VF reset fails both; waiting is still right
            first = first or e
    if first is not None:
        raise first
