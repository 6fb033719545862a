"""One TCP connection's reader: where its bytes go in the pool, and the fragments they make.

Placement (docs/netgpu.md has pictures):
- raw: each read lands at the fill position of the stream's current chunk
  and becomes one fragment; a full chunk is retired and a fresh one taken.
- framed: the 32-byte header is read into host memory; the payload goes
  into the current chunk at the next 64-byte boundary if it fits, else into
  a fresh chunk; a payload larger than a chunk fills whole chunks, one
  fragment per chunk. A message is delivered (all its fragments at once)
  only when its last byte, and its crc32 if flagged, is in.
- auto: the first 4 bytes decide; b"NGPU" means framed, anything else raw
  (those 4 bytes are then copied into the pool as the first payload).

A problem with the stream (bad header, truncation, oversize, disconnect)
ends this connection only: its undelivered chunks go back to the pool and
the error goes to the Rx, which lets the other streams go on.

The reader never touches payload bytes with the CPU, except to compute the
crc32 when the header asks for one and the receiver agreed to check it.
"""

from __future__ import annotations

import contextlib
import select
import socket
import zlib
from collections import deque
from typing import TYPE_CHECKING

from gpuvirt.netgpu.errors import StreamError
from gpuvirt.netgpu.frag import Frag, make_frag
from gpuvirt.protocol.errors import ProtocolError
from gpuvirt.protocol.frames import (
    FLAG_CRC,
    HEADER_SIZE,
    HEADER_STRUCT,
    NGPU_MAGIC,
    NGPU_VERSION,
    unpack_header,
)

if TYPE_CHECKING:
    from gpuvirt.netgpu.rx import Rx

__all__ = ["BLOCKED", "DRY", "ENDED", "MSG_ALIGN", "OK", "Stream"]

_unpack = HEADER_STRUCT.unpack
MSG_ALIGN = 64  # a framed payload starts on this boundary, so typed views of it are aligned
# What one step of a reader did: progressed, found no data, found no free chunk, or ended.
OK, BLOCKED, DRY, ENDED = range(4)


class Stream:
    def __init__(self, rx: Rx, sock: socket.socket, stream: int, peer: str) -> None:
        pool = rx.pool
        self.rx = rx
        self.pool = pool
        self.net = pool._net
        self.view = pool.view
        self.csize = pool.chunk
        self.sock = sock
        self.fd = sock.fileno()
        self.recv = pool.provider.reader(sock)
        self.received = pool.received  # the bytes a read just brought in (for a crc32)
        self.peer = peer
        self.stream = stream  # framed: replaced by the header's id once the first one is read
        self.stream_known = False
        self.raw = False
        self.done = False
        self.registered = False  # with the Rx's epoll
        self.blocking = False  # the Rx reads this one blocking (the only stream left)
        # framed reads on a blocking socket wait for the whole piece in the kernel: one
        # syscall per piece instead of one per arriving burst (delivery waits for it anyway)
        self.wait_all = 0
        # raw mode, coalescing (Rx.coalesce): MSG_WAITALL, bounded by SO_RCVTIMEO, and
        # the poll that waits out an idle stream once a period passed with nothing
        self.raw_flags = 0
        self.idle_poll: select.poll | None = None
        self.lowat = False  # several streams, coalescing: epoll says when a chunk's worth is in
        self.rcvlowat = 1  # the socket's SO_RCVLOWAT as last set (set_lowat)
        self.drained = False  # the last read got less than it asked for: ask epoll first
        self.bytes = 0  # payload bytes
        self.seq = 0  # fragments handed out
        self.messages = 0
        # where the next bytes go: the current chunk and (framed) the fill position in it
        self.chunk: int | None = None
        self.base = 0
        self.pos = 0
        self.fill = 0  # raw mode: the absolute pool positions of the fill and the chunk end
        self.end = 0
        # framed mode
        self.hdr = bytearray(HEADER_SIZE)
        self.hdr_view = memoryview(self.hdr)
        self.hdr_got = 0
        self.pending = b""  # auto mode: first bytes that turned out to be raw payload
        # the message being received: its header's seq (-1: between messages), length, crc
        self.msg = -1
        self.msg_len = 0
        self.msg_crc = 0
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

    def set_lowat(self, nbytes: int) -> None:
        """SO_RCVLOWAT: the kernel wakes a reader of this socket (epoll or a blocked recv)
        only once `nbytes` are queued (or its window is nearly closed, or the stream ends)."""
        self.rcvlowat = nbytes
        with contextlib.suppress(OSError):  # a socket already reset ends on its next read
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)

    # ---- raw --------------------------------------------------------------------------

    def _become_raw(self) -> None:
        self.stream_known = True
        self.raw = True
        self.pump = self._pump_raw
        if self.blocking:
            self.rx.coalesce(self)

    def _pump_raw(self, out: deque[Frag]) -> int:
        got = self.read_raw()
        if got.__class__ is int:
            return got  # type: ignore[return-value]
        out.append(got)  # type: ignore[arg-type]
        return OK

    def read_raw(self) -> Frag | int:
        """One read, one fragment; or DRY / ENDED. The hot path: kept flat on purpose.

        It runs once per read, so what it costs beyond the recv is paid per ~100 KB:
        raw mode keeps absolute pool positions (`fill`, `end`) instead of chunk-relative
        ones, and takes the pool's lock once per read, not twice when a read fills a chunk.
        """
        pool = self.pool
        c = self.chunk
        if c is None:
            c = pool.take()
            if c is None:
                return DRY
            self.chunk = c
            start = self.fill = c * self.csize
            end = self.end = start + self.csize
        else:
            start, end = self.fill, self.end
        if self.pending:
            n = len(self.pending)
            self.view[start : start + n] = self.pending
            self.pending = b""
        else:
            if self.raw_flags and end - start != self.rcvlowat:
                self.set_lowat(end - start)  # wake once, when the read can complete
            n = self.recv(self.view[start:end], 0, self.raw_flags)
            if not n:
                return self.finish()
        fill = start + n
        self.drained = self.lowat or fill < end
        lock = pool._lock
        lock.acquire()
        try:  # a token for the fragment (inlined pool.issue: this runs per read)
            t = pool._next_token
            pool._next_token = t + 1
            pool._tokens[t] = c
            if fill < end:
                pool._refs[c] += 1  # one more reference: the chunk stays current
            else:
                self.chunk = None  # full: the current reference becomes the token's
        finally:
            lock.release()
        self.fill = fill
        seq = self.seq
        self.seq = seq + 1
        self.bytes += n
        self.net.rx_bytes += n
        return make_frag(Frag, (pool.offset + start, n, t, self.stream, seq, None, True, pool))

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
        if self.msg < 0:
            st = self._read_header()
            # a blocking reader goes straight on to the payload: one step per message
            if st != OK or self.msg < 0 or not self.blocking:
                return st
        if self.piece_pos == self.piece_end and not self._next_piece():
            return DRY
        pos, end = self.piece_pos, self.piece_end
        if self.blocking and end - pos != self.rcvlowat:
            self.set_lowat(end - pos)  # the sender owes us the piece: wake once, when it is in
        n = self.recv(self.view[pos:end], 0, self.wait_all)
        if not n:
            return self.fail(
                f"disconnected mid-message: message {self.msg} ended after "
                f"{self.msg_len - self.left} of {self.msg_len} payload bytes"
            )
        self.drained = pos + n < end
        if self.check_crc:  # the one case where the CPU reads payload: it was asked to
            self.crc = zlib.crc32(self.received(pos, n), self.crc)
        self.piece_pos = pos + n
        self.left -= n
        self.bytes += n
        self.net.rx_bytes += n
        if not self.left:
            return self._deliver(out)
        return OK

    def _read_header(self) -> int:
        view = self.hdr_view[self.hdr_got :]
        n = -1
        if self.blocking and self.rcvlowat > len(view):
            # The last payload's mark would hold this wait back until a payload's worth
            # is queued, and a sender may owe us no more than the header: take a queued
            # header as it is, and lower the mark to the header only to wait for one.
            try:
                n = self.recv(view, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                self.set_lowat(len(view))
        if n < 0:
            n = self.recv(view, 0, self.wait_all)
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
        # A plain header of the next message of this stream, the usual case: accepted on one
        # comparison chain; anything else gets unpack_header's and the checks below' reasons.
        magic, version, flags, stream, seq, length, crc, reserved = _unpack(self.hdr)
        if (
            seq == self.next_msg
            and stream == self.stream
            and magic == NGPU_MAGIC
            and version == NGPU_VERSION
            and not (flags or crc or reserved or rx.crc)
            and 0 < length <= rx.max_message
        ):
            self.messages += 1
            self.next_msg = seq + 1
            self.check_crc = False
            self.msg, self.msg_len, self.msg_crc, self.left, self.crc = seq, length, 0, length, 0
            return OK
        try:
            stream, seq, length, flags, crc = unpack_header(self.hdr, rx.max_message)
        except ProtocolError as e:
            why = f"bad header for message {self.messages} of the stream: {e}"
            if e.field == "NGPU length":
                pool = self.pool
                why += (
                    f" (a pool of {pool.nchunks} × {pool.chunk} B shared by {rx.streams} "
                    "stream(s) cannot hold it)"
                )
            return self.fail(why)
        if stream != self.stream or not self.stream_known:
            if self.stream_known:
                return self.fail(
                    f"header names stream {stream} in the middle of stream {self.stream}; "
                    "one connection carries one stream"
                )
            taken = rx.claim(stream, self.peer)
            if taken:
                return self.fail(taken)
            self.stream, self.stream_known = stream, True
        if seq != self.next_msg and self.next_msg is not None:
            return self.fail(
                f"message seq {seq} where {self.next_msg} was expected; messages are "
                "numbered consecutively per stream (lost or reordered data?)"
            )
        self.next_msg = seq + 1
        if flags & FLAG_CRC:
            self.check_crc = rx.crc is not False
        elif rx.crc:
            return self.fail(f"message {seq} carries no crc32 and this receive requires one")
        else:
            self.check_crc = False
        self.messages += 1
        if not length:  # carries no data, so no fragment; its seq still counted above
            return OK
        self.msg, self.msg_len, self.msg_crc, self.left, self.crc = seq, length, crc, length, 0
        return OK

    def _next_piece(self) -> bool:
        """Room for the next piece of the message; False when the pool is dry."""
        pool, csize = self.pool, self.csize
        size = min(self.left, csize)
        c = self.chunk
        if c is not None:
            start = -(-self.pos // MSG_ALIGN) * MSG_ALIGN
            end = start + size
            if end > csize:  # does not fit: retire the current chunk, take a fresh one
                pool.unref(c)
                c = self.chunk = None
            elif end == csize:  # fills it: the piece's reference is the current one's
                self.chunk = None
            else:
                pool.ref(c)
        if c is None:
            # one reference for the piece, one more if the chunk stays current
            start, end = 0, size
            c = pool.take(2 if size < csize else 1)
            if c is None:
                return False
            self.base = c * csize
            if size < csize:
                self.chunk = c
        pos = self.base + start
        self.pieces.append((c, pos, size))
        self.piece_pos, self.piece_end = pos, pos + size
        self.pos = end
        return True

    def _deliver(self, out: deque[Frag]) -> int:
        msg = self.msg
        if self.check_crc and self.crc != self.msg_crc:
            return self.fail(
                f"message {msg}: payload crc32 is 0x{self.crc:08x}, the header says "
                f"0x{self.msg_crc:08x} (corrupted in transit)"
            )
        pool, pieces = self.pool, self.pieces
        if len(pieces) == 1:  # a message within a chunk: one fragment (pool.issue, inlined)
            c, pos, size = pieces[0]
            lock = pool._lock
            lock.acquire()
            try:
                t = pool._next_token
                pool._next_token = t + 1
                pool._tokens[t] = c
            finally:
                lock.release()
            seq = self.seq
            self.seq = seq + 1
            out.append(
                make_frag(Frag, (pool.offset + pos, size, t, self.stream, seq, msg, True, pool))
            )
            self.pieces = []
            self.msg = -1
            return OK
        token = pool.issue([p[0] for p in pieces])
        last = len(pieces) - 1
        for i, (_, pos, size) in enumerate(pieces):
            frag = (
                pool.offset + pos,
                size,
                token + i,
                self.stream,
                self.seq,
                msg,
                i == last,
                pool,
            )
            out.append(make_frag(Frag, frag))
            self.seq += 1
        self.pieces = []
        self.msg = -1
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
        self.msg = -1
        if self.chunk is not None:
            pool.unref(self.chunk)
            self.chunk = None
        self.rx.ended(self, error)
        self.sock.close()  # unread data makes this a reset: the sender learns at once
