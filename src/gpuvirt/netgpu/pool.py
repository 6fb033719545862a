"""The page pool: fixed-size chunks of a VF's FB, a token per fragment handed out.

    pool = gpu.netgpu.pool(nbytes=64 << 20, chunk=1 << 20)
    for frag in pool.receive(sock):
        use(frag.array())
        pool.release([frag.token])

Theory of operation. Every chunk has a reference count. A receiver holds one
reference on the chunk it is filling ("current"), one per piece of a message
it has received but not yet delivered, and each delivered fragment's token
holds one. A chunk whose count drops to zero goes back on the free list;
receivers take from it. When the list is empty a receiver stops reading its
socket (TCP flow control then stops the sender) and sleeps on an eventfd that
`release` signals; nothing is ever dropped.

Tokens are issued from a counter and never reused, which is what lets
`release` tell "already released" from "never handed out".

After a VF reset the pool's memory belongs to nobody (the VF's allocator
starts over): every operation then raises BufferLostError.
"""

from __future__ import annotations

import os
import socket
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from gpuvirt.errors import BufferLostError
from gpuvirt.guest.api import ALIGN, register_netgpu
from gpuvirt.netgpu.errors import NetGPUError, TokenError
from gpuvirt.netgpu.providers import Provider, Selection, select_provider

if TYPE_CHECKING:
    from gpuvirt.guest.api import Gpu
    from gpuvirt.netgpu.rx import Rx

__all__ = ["DEFAULT_CHUNK", "DEFAULT_POOL", "NetGPU", "Pool"]

DEFAULT_POOL = 64 << 20
DEFAULT_CHUNK = 1 << 20


class NetGPU:
    """`gpu.netgpu`: makes pools in the VF's FB and counts what they receive."""

    def __init__(self, gpu: Gpu) -> None:
        self._gpu = gpu
        self.rx_bytes = 0  # payload bytes received into the FB, all pools; reported in VF2PF
        self._selection: Selection | None = None
        self._pools: weakref.WeakSet[Pool] = weakref.WeakSet()

    def selection(self, provider: str = "auto") -> Selection:
        """Which provider serves this VF, and why the others do not."""
        if provider != "auto":
            return select_provider(self._gpu, provider)
        if self._selection is None:
            self._selection = select_provider(self._gpu)
        return self._selection

    def pool(
        self, nbytes: int = DEFAULT_POOL, chunk: int = DEFAULT_CHUNK, provider: str = "auto"
    ) -> Pool:
        """A page pool of `nbytes` (whole chunks) in the VF's FB."""
        pool = Pool(self, nbytes, chunk, self.selection(provider).provider)
        self._pools.add(pool)
        return pool

    def vf_lost(self) -> None:
        """The VF is being reset or detached: stop every receive into its FB now.

        For the guest library to call when it drops the VF (before it answers
        READY_TO_RESET), so that no recv still parked on a socket can write into
        memory the host is about to scrub and hand out again. Receivers then
        raise BufferLostError.
        """
        for pool in list(self._pools):
            for rx in list(pool._rxs):
                rx.interrupt()


register_netgpu(NetGPU)


class Pool:
    def __init__(self, net: NetGPU, nbytes: int, chunk: int, provider: Provider) -> None:
        if chunk <= 0 or chunk % ALIGN:
            raise NetGPUError(f"chunk = {chunk}: must be a positive multiple of {ALIGN} bytes")
        if nbytes < chunk:
            raise NetGPUError(f"nbytes = {nbytes}: a pool needs at least one {chunk}-byte chunk")
        gpu = net._gpu
        gpu.check_attached()
        self._net = net
        self._gpu = gpu
        self.chunk = chunk
        self.nchunks = nbytes // chunk
        self.nbytes = self.nchunks * chunk
        self.provider = provider
        self.generation = gpu.generation
        self.offset = gpu.alloc_range(self.nbytes)
        # What receivers slice for recv_into: the mapped FB, or (cuda) the provider's
        # window onto device memory, which this process cannot map.
        self.memory: np.ndarray | None = None
        self.view: Any
        if provider.mapped:
            self.memory = gpu.host_view(self.offset, self.nbytes)
            if self.memory is None:
                gpu.free_range(self.offset, self.generation)
                raise NetGPUError(f"{provider.name} needs the FB mapped; VF{gpu.vf}'s is not")
            self.view = memoryview(self.memory)
        else:
            self.view = provider.window(self)
        self.closed = False
        self._lock = threading.Lock()
        # LIFO: a consumer that keeps up keeps reusing the same few (cache-warm) chunks.
        self._free = list(range(self.nchunks - 1, -1, -1))
        self._refs = [0] * self.nchunks
        self._tokens: dict[int, int] = {}  # token → chunk
        self._next_token = 1
        self._waiters: set[int] = set()  # eventfds of receivers waiting for a free chunk
        self._rxs: weakref.WeakSet[Rx] = weakref.WeakSet()
        self.dry_waits = 0  # times a receiver found the pool dry and had to wait
        try:
            provider.bind(self)
        except BaseException:
            gpu.free_range(self.offset, self.generation)
            raise

    def _rx_class(self) -> type[Rx]:
        from gpuvirt.netgpu.rx import Rx
        from gpuvirt.netgpu.settled import SettledRx

        return Rx if self.provider.mapped else SettledRx

    def received(self, pos: int, n: int) -> Any:
        """Bytes a receiver just read into [pos, pos + n) of the pool, from host memory."""
        if self.memory is not None:
            return self.view[pos : pos + n]
        return self.provider.received()

    def __repr__(self) -> str:
        return (
            f"<NetGPU pool VF{self._gpu.vf} {self.nchunks}×{self.chunk} B at "
            f"FB+0x{self.offset:x}, {self.free_chunks} free, {len(self._tokens)} tokens out>"
        )

    # ---- the tenant's API ------------------------------------------------------------

    def receive(
        self,
        sock: socket.socket,
        *,
        framed: bool | None = False,
        crc: bool | None = None,
        stream: int = 0,
        timeout: float | None = None,
        coalesce_ms: float = 0.0,
    ) -> Rx:
        """Receive one TCP stream into the pool; iterate the result for Frags.

        framed: False = every byte is payload (any sender); True = NGPU-framed
        messages; None = decide from the stream's first 4 bytes. crc: None =
        check messages whose header carries a crc32, True = also refuse those
        without one, False = never read payload bytes. The Rx owns `sock` and
        closes it when the stream ends. `stream` names a raw stream (framed
        streams carry their id in the header). coalesce_ms: a raw stream read alone
        waits up to this long for each chunk to fill, so a bulk stream costs one
        fragment per chunk (0: each read is a fragment as soon as it lands; see
        Rx.coalesce).
        """
        rx = self._rx_class()(
            self, framed=framed, crc=crc, timeout=timeout, streams=1, coalesce_ms=coalesce_ms
        )
        rx.add_socket(sock, stream=stream)
        return self._track(rx)

    def listen(
        self,
        addr: tuple[str, int],
        *,
        streams: int = 1,
        framed: bool | None = False,
        crc: bool | None = None,
        timeout: float | None = None,
        max_message: int | None = None,
        coalesce_ms: float = 0.0,
    ) -> Rx:
        """Accept `streams` TCP connections on `addr` and receive them all into the pool.

        The socket is listening when this returns (`rx.address` has the port).
        Raw streams are numbered in accept order. A framed message may be at
        most `max_message` bytes, by default the pool's share per stream.
        coalesce_ms as for `receive`; while several streams are open, epoll reports a
        socket once a chunk's worth is queued, and the sockets holding less are read
        every period (netgpu/coalesce.py).
        """
        if streams < 1:
            raise NetGPUError(f"streams = {streams}: need at least one")
        if streams > self.nchunks:
            raise NetGPUError(
                f"streams = {streams}: a pool of {self.nchunks} chunks can serve at most "
                f"{self.nchunks} streams (each fills a chunk of its own)"
            )
        rx = self._rx_class()(
            self, framed=framed, crc=crc, timeout=timeout, streams=streams,
            coalesce_ms=coalesce_ms,
        )  # fmt: skip
        if max_message is not None:
            rx.max_message = min(max_message, rx.max_message)
        rx.listen(addr)
        return self._track(rx)

    def release(self, tokens: Iterable[int]) -> None:
        """Give fragments back (like SO_DEVMEM_DONTNEED).

        All or nothing: if any token is bad, none is released and TokenError says which and why.
        """
        # An application calls this once per fragment, so a one-token list takes a short
        # path; both paths check the same things in the same order.
        cls = tokens.__class__
        batch = tokens if cls is list or cls is tuple else self._as_batch(tokens)
        lock = self._lock
        lock.acquire()
        try:
            gpu = self._gpu
            if self.generation != gpu.generation or gpu.closed or self.closed:
                self._check_live()
            table, refs = self._tokens, self._refs
            if len(batch) == 1:
                t = batch[0]
                if t.__class__ is not int or t not in table:  # bool is an int, and hashes as one
                    raise self._token_error(t)
                c = table.pop(t)
                left = refs[c] - 1
                refs[c] = left
                if not left:
                    self._free.append(c)
                    if self._waiters:
                        self._wake()
                return
            for t in batch:
                if t.__class__ is not int or t not in table:
                    raise self._token_error(t)
            if len(set(batch)) != len(batch):
                dup = next(t for t in batch if batch.count(t) > 1)
                raise TokenError(dup, "appears twice in one release; each token is released once")
            freed = False
            for t in batch:
                c = table.pop(t)
                refs[c] -= 1
                if not refs[c]:
                    self._free.append(c)
                    freed = True
            if freed and self._waiters:
                self._wake()
        finally:
            lock.release()

    @staticmethod
    def _as_batch(tokens: Iterable[int]) -> list[int] | tuple[int, ...]:
        if isinstance(tokens, int):
            raise TokenError(tokens, f"pass a list of tokens: pool.release([{tokens}])")
        return tokens if isinstance(tokens, list | tuple) else list(tokens)

    @property
    def free_chunks(self) -> int:
        return len(self._free)

    @property
    def tokens_out(self) -> int:
        return len(self._tokens)

    def close(self) -> None:
        """Stop every receive on this pool and give its memory back to the VF.

        Fragments still out become invalid; their views must no longer be used.
        """
        if self.closed:
            return
        for rx in list(self._rxs):
            rx.close()
        with self._lock:
            self.closed = True
            self._tokens.clear()
            self._wake()
        self.provider.unbind(self)
        self._gpu.free_range(self.offset, self.generation)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- for fragments ---------------------------------------------------------------

    def check_token(self, token: int) -> None:
        """Raise BufferLostError unless `token`'s fragment is still held (its bytes are valid)."""
        self._check_live()
        if token not in self._tokens:
            raise BufferLostError(
                f"fragment with token {token} was released; its chunk may already hold other "
                "data. Use a fragment's memory only before releasing its token"
            )

    # ---- for receivers (rx.py) -------------------------------------------------------

    def check_live(self) -> None:
        self._check_live()

    def take(self, refs: int = 1) -> int | None:
        """A free chunk with `refs` references (the caller's), or None when the pool is dry."""
        with self._lock:
            self._check_live()
            if not self._free:
                return None
            c = self._free.pop()
            self._refs[c] = refs
            return c

    def ref(self, c: int) -> None:
        with self._lock:
            self._refs[c] += 1

    def unref(self, c: int) -> None:
        with self._lock:
            self._refs[c] -= 1
            if not self._refs[c]:
                self._free.append(c)
                if self._waiters:
                    self._wake()

    def issue(self, chunks: list[int]) -> int:
        """Turn references the receiver holds on `chunks` into tokens, one each (consecutive,
        from the one returned)."""
        with self._lock:
            first = self._next_token
            self._next_token = first + len(chunks)
            for i, c in enumerate(chunks):
                self._tokens[first + i] = c
            return first

    def wait_free(self, eventfd: int) -> bool:
        """True if a chunk is free now; else register `eventfd` to be signalled by a release."""
        with self._lock:
            self._check_live()
            if self._free:
                return True
            self._waiters.add(eventfd)
            self.dry_waits += 1
            return False

    def unwait(self, eventfd: int) -> None:
        with self._lock:
            self._waiters.discard(eventfd)

    # ---- internals -------------------------------------------------------------------

    def _track(self, rx: Rx) -> Rx:
        self._rxs.add(rx)
        return rx

    def _wake(self) -> None:
        for fd in self._waiters:
            os.eventfd_write(fd, 1)
        self._waiters.clear()

    def _check_live(self) -> None:
        gpu = self._gpu
        if self.generation != gpu.generation or gpu.closed:
            why = "detached" if gpu.closed else "reset"
            raise BufferLostError(
                f"NetGPU pool at FB+0x{self.offset:x} was lost when VF{gpu.vf} was {why}; "
                "its fragments are gone. Make a new pool (after gpu.wait_ready()) and receive again"
            )
        if self.closed:
            raise NetGPUError("this NetGPU pool is closed; make a new one with gpu.netgpu.pool()")

    def _token_error(self, t: Any) -> TokenError:
        if not isinstance(t, int) or isinstance(t, bool):
            return TokenError(t, f"not a token (a {type(t).__name__}); pass Frag.token values")
        if 1 <= t < self._next_token:
            return TokenError(
                t, "already released; a fragment's token goes back to the pool exactly once"
            )
        return TokenError(t, "was never handed out by this pool; pass Frag.token values")
