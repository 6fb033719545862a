"""Receivers: TCP streams into pool chunks, handed out as Frags in order per stream.

An Rx is an iterator driven by its consumer: each `next()` reads sockets
until at least one fragment is ready, so there is no receive thread and no
hand-off per fragment. Sockets are non-blocking and read only right after
epoll says they are readable (or a read filled all it asked for), which keeps
the gap between "is the pool still ours?" and the write into it to one
syscall: a VF reset can never find a receive parked inside recv().

Placement (see docs/netgpu.md):
- raw: each read lands at the fill position of the stream's current chunk
  and becomes one fragment; a full chunk is retired and a new one taken.
- framed: the header is read into host memory; the payload goes into the
  current chunk at the next 64-byte boundary if it fits, else into a fresh
  chunk; a payload larger than a chunk fills whole chunks, one fragment per
  chunk. A message is delivered (all its fragments at once) only when its
  last byte, and crc32 if flagged, is in.

Per-connection problems (bad header, truncation, oversize, disconnect) end
that connection only: its undelivered chunks go back to the pool, the error
is recorded in `rx.errors`, and the others go on. When every stream has
ended the iterator raises RxError if any failed, else stops.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
import zlib
from collections import deque
from typing import TYPE_CHECKING

from gpuvirt.errors import GpuvirtError
from gpuvirt.netgpu.errors import NetGPUError, RxError, StreamError
from gpuvirt.netgpu.frag import Frag
from gpuvirt.protocol.errors import ProtocolError
from gpuvirt.protocol.frames import FLAG_CRC, HEADER_SIZE, NGPU_MAGIC, Header

if TYPE_CHECKING:
    from gpuvirt.netgpu.pool import Pool

__all__ = ["MSG_ALIGN", "Rx"]

MSG_ALIGN = 64  # a framed payload starts on this boundary, so typed views of it are aligned
OK, DRY, ENDED = range(3)
_EPOLLIN = select.EPOLLIN | select.EPOLLRDHUP


class Rx:
    """Fragments from one or more streams; iterate it (one consumer thread)."""

    def __init__(
        self,
        pool: Pool,
        *,
        framed: bool | None,
        crc: bool | None,
        timeout: float | None,
        streams: int,
    ) -> None:
        if framed is False and crc:
            raise NetGPUError("crc=True needs framed mode; a raw stream carries no checksum")
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
        self._conns: list[_Conn] = []
        self._hot: list[_Conn] = []  # may have data: read without asking epoll
        self._dry: list[_Conn] = []  # waiting for a free chunk
        self._by_fd: dict[int, _Conn] = {}
        self._owners: dict[int, str] = {}  # framed stream id → peer that claimed it
        self._live = 0
        self._listener: socket.socket | None = None
        self._accepted = 0
        self._epoll = select.epoll()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self._wake, select.EPOLLIN)
        self._io = threading.Lock()  # held by the consuming thread while it reads
        self._closed = False
        self._finished = False
        self._solo: _Conn | None = None  # the one stream left, read blocking

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
        if not ready:
            with self._io:
                self._fill()
        return ready.popleft()

    @property
    def bytes(self) -> int:
        """Payload bytes received so far, all streams."""
        return sum(c.bytes for c in self._conns)

    def _fill(self) -> None:
        ready, hot = self._ready, self._hot
        pool = self.pool
        gpu = pool._gpu
        while not ready:
            if self._closed:
                raise StopIteration
            if pool.generation != gpu.generation or gpu.closed or pool.closed:
                pool.check_live()  # raises: the pool is lost or closed
            solo = self._solo
            if solo is None and self._live == 1 and self._listener is None and not self._dry:
                solo = self._go_solo()
            if solo is not None:
                try:
                    st = solo.pump(ready)
                except BlockingIOError:  # SO_RCVTIMEO ran out
                    raise self._timeout() from None
                except OSError as e:
                    st = solo.fail(f"receive failed: {e.strerror or e}")
                if st == DRY:
                    self._wait_dry()
                continue
            if hot:
                for conn in tuple(hot):
                    try:
                        st = conn.pump(ready)
                    except BlockingIOError:
                        st = OK
                        conn.drained = True
                    except OSError as e:
                        st = conn.fail(f"receive failed: {e.strerror or e}")
                    if st == OK:
                        if conn.drained:
                            hot.remove(conn)
                    else:
                        hot.remove(conn)
                        if st == DRY:
                            self._dry.append(conn)
                continue
            if not self._live and self._listener is None:
                self._finish()
            self._wait()

    def _go_solo(self) -> _Conn:
        """With one stream left and nobody to accept, read it blocking.

        A blocking recv is one syscall per read where poll-then-read is two;
        on loopback that is about a tenth of the receive's CPU cost. What the
        poll bought, reading only right after a check that the pool is still
        ours, comes instead from `NetGPU.vf_lost` shutting the socket down.
        """
        conn = next(c for c in self._conns if not c.done)
        self._unregister(conn)
        conn.sock.setblocking(True)
        if self.timeout is not None:  # a kernel timeout: Python's own would poll before each read
            sec = int(self.timeout)
            usec = int((self.timeout - sec) * 1e6)
            conn.sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, usec)
            )
        self._hot.clear()
        self._solo = conn
        return conn

    def _wait_dry(self) -> None:
        """Block until a release frees a chunk (the solo stream's socket stays unread)."""
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

    def _timeout(self) -> TimeoutError:
        pool = self.pool
        waiting = self.streams - self._accepted if self._listener is not None else 0
        return TimeoutError(
            f"NetGPU receive: nothing happened for {self.timeout} s ({self._live} streams "
            f"open, {waiting} not yet connected; pool {pool.free_chunks} of "
            f"{pool.nchunks} chunks free, {pool.tokens_out} tokens out)"
        )

    def _wait(self) -> None:
        dry, hot = self._dry, self._hot
        pool = self.pool
        if dry:
            if pool.wait_free(self._wake):
                hot.extend(dry)
                dry.clear()
                return
            for conn in dry:  # a dry stream must not wake us just for being readable
                self._unregister(conn)
        try:
            events = self._epoll.poll(-1 if self.timeout is None else self.timeout)
        finally:
            if dry:
                pool.unwait(self._wake)
        if not events:
            raise self._timeout()
        for fd, _ in events:
            if fd == self._wake:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake)
                for conn in dry:
                    self._register(conn)
                hot.extend(dry)
                dry.clear()
            elif self._listener is not None and fd == self._listener.fileno():
                self._accept()
            else:
                conn = self._by_fd.get(fd)
                if conn is not None and not conn.done and conn not in hot and conn not in dry:
                    conn.drained = False
                    hot.append(conn)

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
        conn = _Conn(self, sock, stream, _peer(sock))
        self._conns.append(conn)
        self._by_fd[sock.fileno()] = conn
        self._register(conn)
        self._hot.append(conn)
        self._live += 1

    def _register(self, conn: _Conn) -> None:
        if not conn.done and not conn.registered:
            self._epoll.register(conn.fd, _EPOLLIN)
            conn.registered = True

    def _unregister(self, conn: _Conn) -> None:
        if conn.registered:
            conn.registered = False
            if not self._epoll.closed:
                self._epoll.unregister(conn.fd)

    def claim(self, stream: int, conn: _Conn) -> str | None:
        """Reserve a framed stream id for `conn`; the reason it cannot, if another has it."""
        owner = self._owners.get(stream)
        if owner is not None:
            return f"stream id {stream} is already used by the connection from {owner}"
        self._owners[stream] = conn.peer
        return None

    def ended(self, conn: _Conn, error: StreamError | None) -> None:
        self._live -= 1
        self._unregister(conn)
        self._by_fd.pop(conn.fd, None)
        if error is not None and not self._closed:
            self.errors.append(error)
        if conn is self._solo:
            self._solo = None

    def interrupt(self) -> None:
        """Cut every stream now (from any thread): a reader blocked in recv returns at once."""
        for conn in self._conns:
            if not conn.done:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            os.eventfd_write(self._wake, 1)

    def _finish(self) -> None:
        self._finished = True
        self._cleanup()
        self._closed = True
        if self.errors:
            raise RxError(list(self.errors))
        raise StopIteration

    # ---- closing ----------------------------------------------------------------------

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
        for conn in self._conns:
            if not conn.done:
                conn.abort()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._ready:
            tokens = [f.token for f in self._ready]
            self._ready.clear()
            with contextlib.suppress(GpuvirtError):  # a closed or lost pool took them along
                self.pool.release(tokens)
        self.pool.unwait(self._wake)
        if not self._epoll.closed:
            self._epoll.close()
            os.close(self._wake)

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


class _Conn:
    """One TCP connection: its read state machine and where its bytes go."""

    def __init__(self, rx: Rx, sock: socket.socket, stream: int, peer: str) -> None:
        pool = rx.pool
        self.rx = rx
        self.pool = pool
        self.net = pool._net
        self.sock = sock
        self.fd = sock.fileno()
        self.recv = pool.provider.reader(sock)
        self.peer = peer
        self.raw_stream = stream
        self.stream = stream  # framed: replaced by the header's id once the first one is read
        self.stream_known = False
        self.done = False
        self.registered = False
        self.drained = False  # the last read got less than it asked for: ask epoll first
        self.bytes = 0  # payload bytes
        self.seq = 0  # fragments handed out
        self.messages = 0
        # where the next bytes go: the current chunk and the fill position in it
        self.chunk: int | None = None
        self.base = 0
        self.pos = 0
        # framed mode
        self.hdr = bytearray(HEADER_SIZE)
        self.hdr_view = memoryview(self.hdr)
        self.hdr_got = 0
        self.pending = b""  # auto mode: first bytes that turned out to be raw payload
        self.msg: Header | None = None
        self.left = 0
        self.pieces: list[tuple[int, int, int]] = []  # (chunk, pool position, size), undelivered
        self.piece_pos = 0
        self.piece_end = 0
        self.check_crc = False
        self.crc = 0
        self.next_msg: int | None = None
        if rx.framed is None:
            self.pump = self._pump_detect
        elif rx.framed:
            self.pump = self._pump_framed
        else:
            self._become_raw()

    # ---- raw --------------------------------------------------------------------------

    def _become_raw(self) -> None:
        self.stream_known = True
        self.pump = self._pump_raw

    def _pump_raw(self, out: deque[Frag]) -> int:
        pool = self.pool
        if self.chunk is None:
            c = pool.take()
            if c is None:
                return DRY
            self.chunk, self.base, self.pos = c, c * pool.chunk, 0
        start = self.base + self.pos
        end = self.base + pool.chunk
        if self.pending:
            n = len(self.pending)
            pool.view[start : start + n] = self.pending
            self.pending = b""
        else:
            n = self.recv(pool.view[start:end])
            if not n:
                return self.finish()
            self.drained = start + n < end
        out.append(Frag(pool, pool.offset + start, n, pool.hold(self.chunk), self.stream, self.seq))
        self.seq += 1
        self.bytes += n
        self.net.rx_bytes += n
        self.pos += n
        if start + n == end:
            pool.unref(self.chunk)
            self.chunk = None
        return OK

    # ---- auto -------------------------------------------------------------------------

    def _pump_detect(self, out: deque[Frag]) -> int:
        n = self.recv(self.hdr_view[self.hdr_got : len(NGPU_MAGIC)])
        self.hdr_got += n
        if n and self.hdr_got < len(NGPU_MAGIC):
            self.drained = True
            return OK
        if self.hdr[: len(NGPU_MAGIC)] == NGPU_MAGIC:
            self.pump = self._pump_framed
            return OK
        self.pending = bytes(self.hdr[: self.hdr_got])
        self.hdr_got = 0
        self._become_raw()
        if self.rx.crc:
            return self.fail("crc=True, but this stream is raw (it does not start with NGPU)")
        if not self.pending:
            return self.finish()
        return OK

    # ---- framed -----------------------------------------------------------------------

    def _pump_framed(self, out: deque[Frag]) -> int:
        if self.msg is None:
            return self._read_header()
        pool = self.pool
        if self.piece_pos == self.piece_end and not self._next_piece():
            return DRY
        pos, end = self.piece_pos, self.piece_end
        n = self.recv(pool.view[pos:end])
        if not n:
            h = self.msg
            return self.fail(
                f"disconnected mid-message: message {h.seq} ended after "
                f"{h.length - self.left} of {h.length} payload bytes"
            )
        self.drained = pos + n < end
        if self.check_crc:  # the one case where the CPU reads payload: it was asked to
            self.crc = zlib.crc32(pool.view[pos : pos + n], self.crc)
        self.piece_pos = pos + n
        self.left -= n
        self.bytes += n
        self.net.rx_bytes += n
        if not self.left:
            return self._deliver(out)
        return OK

    def _read_header(self) -> int:
        n = self.recv(self.hdr_view[self.hdr_got :])
        if not n:
            if not self.hdr_got:
                return self.finish()
            return self.fail(
                f"truncated header: the connection closed after {self.hdr_got} of "
                f"{HEADER_SIZE} header bytes"
            )
        self.hdr_got += n
        if self.hdr_got < HEADER_SIZE:
            self.drained = True
            return OK
        self.hdr_got = 0
        self.drained = False
        rx = self.rx
        try:
            h = Header.decode(self.hdr, max_length=rx.max_message)
        except ProtocolError as e:
            why = f"bad header for message {self.messages} of the stream: {e}"
            if e.field == "NGPU length":
                pool = self.pool
                why += (
                    f" (a pool of {pool.nchunks} × {pool.chunk} B shared by {rx.streams} "
                    "stream(s) cannot hold it)"
                )
            return self.fail(why)
        if not self.stream_known:
            taken = rx.claim(h.stream, self)
            if taken:
                return self.fail(taken)
            self.stream, self.stream_known = h.stream, True
        elif h.stream != self.stream:
            return self.fail(
                f"header names stream {h.stream} in the middle of stream {self.stream}; "
                "one connection carries one stream"
            )
        if self.next_msg is not None and h.seq != self.next_msg:
            return self.fail(
                f"message seq {h.seq} where {self.next_msg} was expected; messages are "
                "numbered consecutively per stream (lost or reordered data?)"
            )
        self.next_msg = h.seq + 1
        flagged = bool(h.flags & FLAG_CRC)
        if rx.crc and not flagged:
            return self.fail(f"message {h.seq} carries no crc32 and this receive requires one")
        self.check_crc = flagged and rx.crc is not False
        self.messages += 1
        if not h.length:  # carries no data, so no fragment; its seq still counted above
            return OK
        self.msg, self.left, self.crc = h, h.length, 0
        return OK

    def _next_piece(self) -> bool:
        """Room for the next piece of the message; False when the pool is dry."""
        pool = self.pool
        size = min(self.left, pool.chunk)
        if self.chunk is not None:
            start = -(-self.pos // MSG_ALIGN) * MSG_ALIGN
            if start + size <= pool.chunk:
                pool.ref(self.chunk)
                self._place(self.chunk, start, size)
                return True
            pool.unref(self.chunk)
            self.chunk = None
        c = pool.take()
        if c is None:
            return False
        pool.ref(c)  # one for being current, one for the piece
        self.chunk, self.base = c, c * pool.chunk
        self._place(c, 0, size)
        return True

    def _place(self, c: int, start: int, size: int) -> None:
        pos = self.base + start
        self.pieces.append((c, pos, size))
        self.piece_pos, self.piece_end = pos, pos + size
        self.pos = start + size
        if self.pos == self.pool.chunk:
            self.pool.unref(c)
            self.chunk = None

    def _deliver(self, out: deque[Frag]) -> int:
        h = self.msg
        assert h is not None
        if self.check_crc and self.crc != h.crc:
            return self.fail(
                f"message {h.seq}: payload crc32 is 0x{self.crc:08x}, the header says "
                f"0x{h.crc:08x} (corrupted in transit)"
            )
        pool, pieces = self.pool, self.pieces
        tokens = pool.issue([p[0] for p in pieces])
        last = len(pieces) - 1
        for i, (_, pos, size) in enumerate(pieces):
            frag = Frag(pool, pool.offset + pos, size, tokens[i], self.stream, self.seq)
            frag.message, frag.last = h.seq, i == last
            out.append(frag)
            self.seq += 1
        self.pieces = []
        self.msg = None
        return OK

    # ---- ending -----------------------------------------------------------------------

    def fail(self, reason: str) -> int:
        self._end(StreamError(self.stream if self.stream_known else None, self.peer, reason))
        return ENDED

    def finish(self) -> int:
        self._end(None)
        return ENDED

    def abort(self) -> None:
        self._end(None)

    def _end(self, error: StreamError | None) -> None:
        if self.done:
            return
        self.done = True
        pool = self.pool
        for c, _, _ in self.pieces:  # received but never delivered: back to the pool
            pool.unref(c)
        self.pieces = []
        self.msg = None
        if self.chunk is not None:
            pool.unref(self.chunk)
            self.chunk = None
        self.rx.ended(self, error)
        self.sock.close()  # unread data makes this a reset: the sender learns at once
