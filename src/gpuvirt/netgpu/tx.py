"""The sender side: a file or seeded synthetic bytes over N TCP streams, raw or framed.

The data is one byte sequence of `size` bytes split into N contiguous parts,
part i going over stream i (connections are opened in order, so a receiver
numbering raw streams by accept order numbers them the same way). Framed
streams cut their part into messages of `message_size` bytes, each behind a
32-byte NGPU header with stream id i and seq 0, 1, 2, ...

Synthetic data is deterministic so a receiver can check it: block k (1 MiB)
is `numpy.random.default_rng([seed, k]).bytes(1 MiB)`, and the data is the
blocks end to end, cut to `size`.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gpuvirt.protocol.frames import header_for

__all__ = [
    "SYNTH_BLOCK",
    "FileSource",
    "SendResult",
    "Source",
    "SyntheticSource",
    "send",
    "send_stream",
    "split",
]

SYNTH_BLOCK = 1 << 20
RAW_WRITE = 1 << 20  # bytes per sendall in raw mode
ACK_TIMEOUT_S = 30.0  # how long a sender waits for the receiver to close after the last byte


class Source:
    """`size` bytes that can be read from any offset."""

    size: int

    def read_into(self, offset: int, out: memoryview) -> None:
        raise NotImplementedError


class FileSource(Source):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = path.stat().st_size

    def read_into(self, offset: int, out: memoryview) -> None:
        # one descriptor per call: streams read their parts from several threads at once
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            done = 0
            while done < len(out):
                n = os.preadv(fd, [out[done:]], offset + done)
                if not n:
                    raise OSError(f"{self.path} shrank while it was being sent")
                done += n
        finally:
            os.close(fd)


class SyntheticSource(Source):
    def __init__(self, size: int, seed: int = 0) -> None:
        self.size = size
        self.seed = seed
        self._cache = threading.local()

    def block(self, k: int) -> bytes:
        cache = self._cache
        if getattr(cache, "k", None) != k:
            cache.k, cache.data = k, np.random.default_rng([self.seed, k]).bytes(SYNTH_BLOCK)
        return cache.data

    def read_into(self, offset: int, out: memoryview) -> None:
        done = 0
        while done < len(out):
            k, at = divmod(offset + done, SYNTH_BLOCK)
            n = min(SYNTH_BLOCK - at, len(out) - done)
            out[done : done + n] = self.block(k)[at : at + n]
            done += n

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end): what a receiver should have got (for checks and tests)."""
        out = bytearray(end - start)
        self.read_into(start, memoryview(out))
        return bytes(out)


def split(size: int, streams: int) -> list[tuple[int, int]]:
    """Contiguous parts [start, end) of `size` bytes, one per stream, sizes within one byte."""
    return [(i * size // streams, (i + 1) * size // streams) for i in range(streams)]


def send_stream(
    sock: socket.socket,
    source: Source,
    start: int,
    end: int,
    *,
    framed: bool,
    stream: int = 0,
    crc: bool = False,
    message_size: int = 1 << 20,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Send bytes [start, end) of `source` on `sock`; returns the payload bytes sent."""
    buf = bytearray(message_size if framed else RAW_WRITE)
    view = memoryview(buf)
    pos, seq = start, 0
    while pos < end:
        n = min(len(buf), end - pos)
        part = view[:n]
        source.read_into(pos, part)
        if framed:
            _sendmsg_all(sock, [header_for(stream, seq, part, crc=crc).encode(), part])
        else:
            sock.sendall(part)
        pos += n
        seq += 1
        if progress is not None:
            progress(n)
    return pos - start


def _sendmsg_all(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    views = [memoryview(p) for p in parts]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


@dataclass
class SendResult:
    bytes: int = 0
    seconds: float = 0.0
    parts: list[tuple[int, int]] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)  # stream → what went wrong

    @property
    def gbytes_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def send(
    addr: tuple[str, int],
    source: Source,
    *,
    streams: int = 1,
    framed: bool = False,
    crc: bool = False,
    message_size: int = 1 << 20,
    progress: Callable[[int], None] | None = None,
    connect_timeout: float = 10.0,
) -> SendResult:
    """Send all of `source` to `addr` over `streams` connections; wait until the receiver has it.

    Each stream ends with a half-close and then waits for the receiver to
    close its side, so the time covers delivery, not just buffering.
    """
    result = SendResult(parts=split(source.size, streams))
    socks = []
    try:
        for _ in range(streams):  # in order: raw receivers number streams by accept order
            s = socket.create_connection(addr, timeout=connect_timeout)
            s.settimeout(None)
            socks.append(s)
    except OSError as e:
        for s in socks:
            s.close()
        raise ConnectionError(f"cannot connect to {addr[0]}:{addr[1]}: {e.strerror or e}") from None
    lock = threading.Lock()

    def run(i: int, sock: socket.socket) -> None:
        start, end = result.parts[i]
        try:
            n = send_stream(
                sock, source, start, end, framed=framed, stream=i, crc=crc,
                message_size=message_size, progress=progress,
            )  # fmt: skip
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(ACK_TIMEOUT_S)
            while sock.recv(4096):  # the receiver sends nothing; this waits for its close
                pass
        except OSError as e:
            with lock:
                result.errors[i] = f"{type(e).__name__}: {e.strerror or e}"
            return
        finally:
            sock.close()
        with lock:
            result.bytes += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i, s), daemon=True) for i, s in enumerate(socks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.seconds = time.perf_counter() - t0
    return result
