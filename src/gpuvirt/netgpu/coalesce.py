"""Receive coalescing (`coalesce_ms`): make each read worth the work a fragment costs.

A fragment costs the receiver the same bookkeeping whatever its size (a token,
a Frag, a release), and loopback TCP hands a reader that asks whenever data is
there ~200 KB bursts, so a bulk stream pays that work five times per 1 MiB
chunk. Coalescing makes a read wait, a bounded time, for its chunk to fill,
as a NIC's rx-usecs holds an interrupt back:

- a stream read alone (blocking): MSG_WAITALL, bounded by SO_RCVTIMEO = the
  period (the kernel rounds it up to its tick), with SO_RCVLOWAT = what the read
  asks for, so the blocked recv wakes once, not at every burst that lands (Linux's
  tcp_mmap selftest does the same); a period that passes with
  nothing at all ends in EAGAIN, and the stream then waits in poll with the
  Rx's own timeout (Rx._read_error);
- several streams (epoll): SO_RCVLOWAT = a chunk, so epoll reports a socket
  once a chunk's worth is queued (or the TCP window is nearly closed: the
  kernel's own guard against deadlock), with a receive window of WINDOW_MARKS
  chunks (open_window), so that the sender goes on while the reader is away;
  once every period the Rx reads the
  sockets holding anything below the mark, so a sparse stream's bytes wait at
  most a period even while other streams keep epoll busy. A sweep that finds
  nothing, with nothing reported, makes the Rx idle: a mark of one byte and
  the Rx's own timeout, until a byte wakes it.

Off (0, the default) every read is a fragment as soon as it lands.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import time
from typing import TYPE_CHECKING

from gpuvirt.netgpu.errors import NetGPUError
from gpuvirt.poll import queued_bytes

if TYPE_CHECKING:
    from gpuvirt.netgpu.stream import Stream

__all__ = ["MAX_COALESCE_MS", "WINDOW_MARKS", "Coalescer", "open_window", "set_rcvtimeo"]

MAX_COALESCE_MS = 1000.0  # beyond this a "coalesced" read is just a stalled stream
# The receive window a stream read at a mark keeps, in marks. Setting SO_RCVLOWAT, Linux
# grows the socket's buffer to twice the mark and clamps its window to the mark itself
# (tcp_set_rcvlowat: 1 MiB gives 2 MiB and a 1 MiB clamp), so a window of one mark
# closes just as epoll reports the socket: the sender stops at every chunk, and the ACK
# that reopens the window runs its queued transmits on the reader's CPU, inside the
# reader's recv (on loopback). Framed · 4, staged, on a 2-CPU VM, 10 alternations: 4.62
# GB/s (median) with one mark's window, 5.29 with four (docs/netgpu-staged-log.md, "A sixth look").
WINDOW_MARKS = 4


class Coalescer:
    """One Rx's coalescing, for `streams` streams of a pool with `chunk`-byte chunks."""

    def __init__(self, coalesce_ms: float, chunk: int, streams: int) -> None:
        if not 0 <= coalesce_ms <= MAX_COALESCE_MS:
            raise NetGPUError(
                f"coalesce_ms = {coalesce_ms}: must be 0 (off) to {MAX_COALESCE_MS:g} ms"
            )
        self.period = coalesce_ms / 1e3
        self.chunk = chunk
        self.several = streams > 1
        self.idle = False  # the last sweep found nothing anywhere
        self.sweep_at = 0.0

    def solo(self, s: Stream) -> None:
        """`s` is read alone now, blocking: not through epoll, so not at a chunk's mark;
        if raw, each read waits in recv for its chunk (its mark set per read by
        Stream.read_raw), as framed reads already wait for their piece."""
        if s.lowat:  # read alone it waits in recv, not for epoll
            s.lowat = False
            s.set_lowat(1)
        if not self.period or not s.raw:
            return
        set_rcvtimeo(s.sock, self.period)
        s.raw_flags = socket.MSG_WAITALL
        s.idle_poll = select.poll()
        s.idle_poll.register(s.fd, select.POLLIN | select.POLLRDHUP)

    def added(self, s: Stream) -> None:
        """A new stream among several: epoll reports it at a chunk's worth, unless idle;
        its window holds WINDOW_MARKS chunks either way (open_window)."""
        if self.period and self.several:
            open_window(s.sock, self.chunk)
            s.lowat = not self.idle
            s.set_lowat(1 if self.idle else self.chunk)

    def poll_timeout(self, live: int, idle_wait: float) -> float:
        """How long the Rx may wait in epoll: until the next sweep while streams are busy."""
        if not self.period or self.idle or not live:
            return idle_wait
        return max(0.0, self.sweep_at - time.monotonic())

    def after_poll(self, streams: list[Stream], hot: list[Stream], reported: bool) -> bool:
        """Sweep when one is due (the streams holding bytes join `hot`); False when a wait
        that reported nothing is the Rx's own timeout running out."""
        if not self.period or self.idle:
            if reported and self.idle:
                self._mark(streams, self.chunk)
            return reported
        now = time.monotonic()
        if now < self.sweep_at:
            return True
        self.sweep_at = now + self.period
        for s in streams:
            if s.registered and not s.done and s not in hot and _queued(s.fd):
                s.drained = False
                hot.append(s)
        if not reported and not hot:
            self._mark(streams, 1)
        return True

    def _mark(self, streams: list[Stream], nbytes: int) -> None:
        self.idle = nbytes == 1
        for s in streams:
            if not s.done and not s.blocking:
                s.lowat = not self.idle
                s.set_lowat(nbytes)


def _queued(fd: int) -> int:
    """Bytes waiting in a socket's receive queue."""
    try:
        return queued_bytes(fd)
    except OSError:
        return 1  # let a read find out what is wrong


def open_window(sock: socket.socket, mark: int) -> None:
    """Let `sock`'s receive window grow to WINDOW_MARKS × `mark`; the caller sets the mark
    itself next. A mark set this high first grows the buffer and the window clamp for it
    (the mark is capped at half of net.ipv4.tcp_rmem's maximum, the buffer at all of it),
    and the lower mark set next leaves both as they are; the kernel's autotuning may
    grow them further. SO_RCVBUF would turn autotuning off, and net.core.rmem_max caps
    it for a process without CAP_NET_ADMIN."""
    with contextlib.suppress(OSError):  # a socket already reset ends on its next read
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, WINDOW_MARKS * mark)


def set_rcvtimeo(sock: socket.socket, seconds: float) -> None:
    """SO_RCVTIMEO: a blocking recv gives up after `seconds` (0 would mean never)."""
    sec = int(seconds)
    usec = round((seconds - sec) * 1e6) or (0 if sec else 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, usec))
