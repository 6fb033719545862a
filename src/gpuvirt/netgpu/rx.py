"""Rx: the iterator of fragments over one or more streams, driven by its consumer.

Each `next()` reads sockets until at least one fragment is ready, in the
consumer's own thread: no receive thread, no hand-off per fragment. With
several streams the sockets are non-blocking and multiplexed with epoll; a
socket whose last read came up short is read again only once epoll says so.
With one stream left (and nothing to accept) it is read blocking, since a
poll before each read costs about a tenth of a loopback receive's CPU; a VF
reset then reaches a reader parked in recv() through `interrupt()`.

When the pool is dry, streams that need a chunk are parked and the Rx waits
on an eventfd that `pool.release` signals; their sockets are not read, so
TCP flow control holds the senders back. Nothing is dropped.

Streams end on their own (see stream.py); errors are collected in
`rx.errors` and raised together as RxError once every stream has ended.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING

from gpuvirt.errors import GpuvirtError
from gpuvirt.netgpu.coalesce import Coalescer, set_rcvtimeo
from gpuvirt.netgpu.errors import NetGPUError, RxError, StreamError
from gpuvirt.netgpu.frag import Frag
from gpuvirt.netgpu.stream import BLOCKED, DRY, OK, Stream

if TYPE_CHECKING:
    from gpuvirt.netgpu.pool import Pool

__all__ = ["Rx"]

_EPOLLIN = select.EPOLLIN | select.EPOLLRDHUP


class Rx:
    """Fragments from one or more streams; iterate it from one thread."""

    def __init__(
        self,
        pool: Pool,
        *,
        framed: bool | None,
        crc: bool | None,
        timeout: float | None,
        streams: int,
        coalesce_ms: float = 0.0,
    ) -> None:
        if framed is False and crc:
            raise NetGPUError("crc=True needs framed mode; a raw stream carries no checksum")
        self._coalesce = Coalescer(coalesce_ms, pool.chunk, streams)
        self.pool = pool
        self.framed = framed
        self.crc = crc
        self.timeout = timeout
        self.streams = streams
        # Every stream can always finish its message: the shares add up to the pool.
        self.max_message = (pool.nchunks // streams) * pool.chunk
        self.errors: list[StreamError] = []
        self.address: tuple[str, int] | None = None
        self._ready: deque[Frag] = deque()
        self._all: list[Stream] = []
        self._hot: list[Stream] = []  # may have data: read without asking epoll
        self._dry: list[Stream] = []  # waiting for a free chunk
        self._solo: Stream | None = None  # the one stream left, read blocking
        self._by_fd: dict[int, Stream] = {}
        self._owners: dict[int, str] = {}  # framed stream id → peer that claimed it
        self._live = 0
        self._listener: socket.socket | None = None
        self._accepted = 0
        self._epoll = select.epoll()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._close_wake = weakref.finalize(self, os.close, self._wake)  # also if never closed
        self._epoll.register(self._wake, select.EPOLLIN)
        self._io = threading.Lock()  # held by the consuming thread while it reads
        self._closed = False

    def __repr__(self) -> str:
        where = f" on {self.address[0]}:{self.address[1]}" if self.address else ""
        return f"<NetGPU Rx{where}: {self._live} of {self.streams} streams open, {self.bytes} B>"

    # ---- setup (pool.receive / pool.listen) --------------------------------------------

    def add_socket(self, sock: socket.socket, *, stream: int) -> None:
        self._add(sock, stream)

    def listen(self, addr: tuple[str, int]) -> None:
        try:
            self._listener = socket.create_server(addr, backlog=max(8, self.streams))
        except OSError as e:
            self.close()
            raise NetGPUError(f"cannot listen on {addr[0]}:{addr[1]}: {e.strerror}") from None
        self._listener.setblocking(False)
        self.address = self._listener.getsockname()[:2]
        self._epoll.register(self._listener.fileno(), select.EPOLLIN)

    # ---- iteration --------------------------------------------------------------------

    def __iter__(self) -> Rx:
        return self

    def __next__(self) -> Frag:
        ready = self._ready
        if ready:
            return ready.popleft()
        solo = self._solo
        if solo is not None:
            # the common case, one stream, without the general loop's bookkeeping; it runs
            # once per read (raw) or message (framed), so the lock is taken by hand and
            # _stale() is inlined. Whatever a step leaves undone, _fill() picks up.
            io = self._io
            io.acquire()
            try:
                pool = self.pool
                gpu = pool._gpu
                if not (
                    self._closed or pool.closed or gpu.closed or pool.generation != gpu.generation
                ):
                    try:
                        if solo.raw:
                            got = solo.read_raw()
                            if got.__class__ is Frag:
                                return got  # type: ignore[return-value]
                        else:
                            solo.pump(ready)
                    except OSError as e:
                        self._read_error(solo, e)
                    if ready:
                        return ready.popleft()
            finally:
                io.release()
        with self._io:
            self._fill()
        return ready.popleft()

    @property
    def bytes(self) -> int:
        """Payload bytes received so far, all streams."""
        return sum(s.bytes for s in self._all)

    def _stale(self) -> bool:
        pool = self.pool
        gpu = pool._gpu
        return pool.generation != gpu.generation or gpu.closed or pool.closed

    def _read_error(self, s: Stream, e: OSError) -> int:
        if isinstance(e, BlockingIOError):
            if s.idle_poll is not None:  # a coalescing period with nothing: wait for data
                s.set_lowat(1)  # for any byte, not for the read's mark
                if not s.idle_poll.poll(None if self.timeout is None else self.timeout * 1e3):
                    raise self._timeout() from None
                return BLOCKED
            if s.blocking:  # SO_RCVTIMEO ran out
                raise self._timeout() from None
            s.drained = True
            return BLOCKED
        return s.fail(f"receive failed: {e.strerror or e}")

    def _fill(self) -> None:
        ready, hot = self._ready, self._hot
        pool = self.pool
        gpu = pool._gpu
        while not ready:
            if self._closed:
                raise StopIteration
            # _stale(), inlined: it is asked before every read
            if pool.generation != gpu.generation or gpu.closed or pool.closed:
                pool.check_live()  # raises: the pool is lost or closed
            solo = self._solo
            if solo is None and self._live == 1 and self._listener is None and not self._dry:
                solo = self._go_solo()
            if solo is not None:
                try:
                    st = solo.pump(ready)
                except OSError as e:
                    st = self._read_error(solo, e)
                if st == DRY:
                    self._wait_dry()
                continue
            if hot:
                for s in tuple(hot):
                    try:
                        if s.raw:  # what _pump_raw does, a call layer less: this runs per read
                            got = s.read_raw()
                            if got.__class__ is Frag:
                                ready.append(got)  # type: ignore[arg-type]
                                st = OK
                            else:
                                st = got  # type: ignore[assignment]
                        else:
                            st = s.pump(ready)
                    except OSError as e:
                        st = self._read_error(s, e)
                    if st == OK:
                        if s.drained:
                            hot.remove(s)
                    else:
                        hot.remove(s)
                        if st == DRY:
                            self._dry.append(s)
                continue
            if not self._live and self._listener is None:
                self._finish()
            self._wait()

    def _go_solo(self) -> Stream:
        s = next(s for s in self._all if not s.done)
        self._unregister(s)
        s.sock.setblocking(True)
        if self.timeout is not None:  # the kernel's timeout: Python's own polls before each read
            set_rcvtimeo(s.sock, self.timeout)
        s.blocking = True
        s.wait_all = socket.MSG_WAITALL
        self.coalesce(s)
        self._hot.clear()
        self._solo = s
        return s

    def coalesce(self, s: Stream) -> None:
        """`s` is read alone now, or turned out raw while it was (coalesce.py)."""
        self._coalesce.solo(s)

    def _wait_dry(self) -> None:
        """Block until a release frees a chunk; the solo stream's socket stays unread meanwhile."""
        pool = self.pool
        if pool.wait_free(self._wake):
            return
        try:
            events = self._epoll.poll(-1 if self.timeout is None else self.timeout)
        finally:
            pool.unwait(self._wake)
        if not events:
            raise self._timeout()
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._wake)

    def _wait(self) -> None:
        dry, hot = self._dry, self._hot
        pool = self.pool
        if dry:
            if pool.wait_free(self._wake):
                self._undry()
                return
            for s in dry:  # a dry stream must not wake us just for being readable
                self._unregister(s)
        co = self._coalesce
        wait = co.poll_timeout(self._live, -1 if self.timeout is None else self.timeout)
        try:
            events = self._epoll.poll(wait)
        finally:
            if dry:
                pool.unwait(self._wake)
        if not co.after_poll(self._all, hot, bool(events)):
            raise self._timeout()
        for fd, _ in events:
            if fd == self._wake:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake)
                self._undry()
            elif self._listener is not None and fd == self._listener.fileno():
                self._accept()
            else:
                s = self._by_fd.get(fd)
                if s is not None and not s.done and s not in hot and s not in dry:
                    s.drained = False
                    hot.append(s)

    def _undry(self) -> None:
        """A chunk came free: the streams waiting for one read again."""
        for s in self._dry:
            self._register(s)
        self._hot.extend(self._dry)
        self._dry.clear()

    def _timeout(self) -> TimeoutError:
        pool = self.pool
        waiting = self.streams - self._accepted if self._listener is not None else 0
        return TimeoutError(
            f"NetGPU receive: nothing happened for {self.timeout} s ({self._live} streams "
            f"open, {waiting} not yet connected; pool {pool.free_chunks} of "
            f"{pool.nchunks} chunks free, {pool.tokens_out} tokens out)"
        )

    # ---- streams ----------------------------------------------------------------------

    def _accept(self) -> None:
        listener = self._listener
        while listener is not None:
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return
            self._add(sock, self._accepted)
            self._accepted += 1
            if self._accepted == self.streams:
                self._epoll.unregister(listener.fileno())
                listener.close()
                self._listener = listener = None

    def _add(self, sock: socket.socket, stream: int) -> None:
        sock.setblocking(False)
        s = Stream(self, sock, stream, _peer(sock))
        self._all.append(s)
        self._by_fd[s.fd] = s
        self._register(s)
        self._hot.append(s)
        self._live += 1
        self._coalesce.added(s)

    def _register(self, s: Stream) -> None:
        if not s.done and not s.registered and not s.blocking:
            self._epoll.register(s.fd, _EPOLLIN)
            s.registered = True

    def _unregister(self, s: Stream) -> None:
        if s.registered:
            s.registered = False
            if not self._epoll.closed:
                self._epoll.unregister(s.fd)

    def claim(self, stream: int, peer: str) -> str | None:
        """Reserve a framed stream id for `peer`; the reason it cannot, if another has it."""
        owner = self._owners.get(stream)
        if owner is not None:
            return f"stream id {stream} is already used by the connection from {owner}"
        self._owners[stream] = peer
        return None

    def ended(self, s: Stream, error: StreamError | None) -> None:
        """A stream's end (stream.py calls this before it closes its socket)."""
        self._live -= 1
        self._unregister(s)
        self._by_fd.pop(s.fd, None)
        if error is not None and not self._closed:
            self.errors.append(error)
        if s is self._solo:
            self._solo = None

    def _finish(self) -> None:
        self._cleanup()
        self._closed = True
        if self.errors:
            raise RxError(list(self.errors))
        raise StopIteration

    # ---- stopping ---------------------------------------------------------------------

    def interrupt(self) -> None:
        """Cut every stream now, from any thread: a reader blocked in recv returns at once."""
        for s in self._all:
            if not s.done:
                with contextlib.suppress(OSError):
                    s.sock.shutdown(socket.SHUT_RDWR)
        if self._close_wake.alive:  # a closed fd's number may already belong to someone else
            with contextlib.suppress(OSError):
                os.eventfd_write(self._wake, 1)

    def close(self) -> None:
        """Stop receiving: streams are cut, undelivered data goes back to the pool.

        Fragments already handed out stay valid until released. Safe to call
        from another thread than the one iterating.
        """
        if self._closed:
            return
        self._closed = True
        self.interrupt()  # a reader in another thread wakes, sees _closed and stops
        with self._io:
            self._cleanup()

    def _cleanup(self) -> None:
        for s in self._all:
            if not s.done:
                s.abort()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._ready:
            tokens = [f.token for f in self._ready]
            self._ready.clear()
            with contextlib.suppress(GpuvirtError):  # a closed or lost pool took them along
                self.pool.release(tokens)
        self.pool.unwait(self._wake)
        self._epoll.close()
        self._close_wake()

    def __enter__(self) -> Rx:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _peer(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "?"
    if isinstance(name, tuple):
        return f"{name[0]}:{name[1]}"
    return str(name) or "a local socket"
