"""NetGPU receive coalescing (`coalesce_ms`): a bulk stream makes one fragment per chunk,
a sparse one still gets every byte without waiting for more, and bad values are refused.

Real host, real VF, real loopback TCP. A stream read alone coalesces in recv
(MSG_WAITALL bounded by SO_RCVTIMEO); several streams through SO_RCVLOWAT and
epoll, with a sweep after each period and a low-water mark of one byte while idle.
"""

from __future__ import annotations

import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuvirt
from gpuvirt.bench.common import scratch_host
from gpuvirt.netgpu import NetGPUError
from gpuvirt.netgpu.coalesce import WINDOW_MARKS
from helpers import wait_until

pytestmark = pytest.mark.timeout(60)
RX_TIMEOUT = 10.0
CHUNK = 64 << 10
# long enough that a sender writing its next piece at once always lands within it
BULK_COALESCE_MS = 1000.0
BUSY_SENDER = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
block = bytes(1 << 16)
while True:
    s.sendall(block)
"""


@pytest.fixture(scope="module")
def gpu() -> Iterator[Any]:
    with scratch_host(sriov={"vf_num": 1}) as hp:
        g = gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0))
        yield g
        g.close()


def bulk_sender(addr: tuple[str, int], data: bytes, piece: int) -> None:
    """A plain writer in pieces smaller than a chunk, so uncoalesced reads would be too."""
    with socket.create_connection(addr) as s:
        for at in range(0, len(data), piece):
            s.sendall(data[at : at + piece])
        s.shutdown(socket.SHUT_WR)
        s.recv(1)


@pytest.mark.parametrize("streams", [1, 3])
def test_a_coalesced_bulk_stream_makes_one_fragment_per_chunk(gpu: Any, streams: int) -> None:
    rng = np.random.default_rng(streams)
    sent = [rng.bytes(16 * CHUNK) for _ in range(streams)]
    with gpu.netgpu.pool(nbytes=32 * CHUNK, chunk=CHUNK) as pool:
        rx = pool.listen(
            ("127.0.0.1", 0), streams=streams, timeout=RX_TIMEOUT, coalesce_ms=BULK_COALESCE_MS
        )
        threads = [
            threading.Thread(target=bulk_sender, args=(rx.address, d, CHUNK // 8), daemon=True)
            for d in sent
        ]
        for t in threads:
            t.start()
        got: dict[int, list[tuple[int, bytes]]] = {}
        for frag in rx:
            got.setdefault(frag.stream, []).append((frag.size, frag.array().tobytes()))
            pool.release([frag.token])
        for t in threads:
            t.join()
        assert pool.free_chunks == pool.nchunks and pool.tokens_out == 0
    # raw streams are numbered in accept order, so match them by content
    assert sorted(b"".join(d for _, d in frags) for frags in got.values()) == sorted(sent)
    if streams == 1:  # read alone, in recv: MSG_WAITALL holds each read until its chunk is full
        (frags,) = got.values()
        assert [n for n, _ in frags] == [CHUNK] * 16, "each read should have waited for its chunk"
    # Several: epoll reports a socket at SO_RCVLOWAT, but the kernel also reports one below
    # it while the TCP window is nearly closed (so that nothing deadlocks), so how many
    # fragments a stream makes is the kernel's to say; bench netgpu reports fragments/GB.


def sparse_sender(addr: tuple[str, int], messages: list[bytes], seen: threading.Semaphore) -> None:
    """Sends a message, then waits until the receiver has it before sending the next: a
    receiver that held bytes back for more would never see the second message."""
    with socket.create_connection(addr) as s:
        for m in messages:
            s.sendall(m)
            assert seen.acquire(timeout=RX_TIMEOUT), "the receiver never delivered a message"
        s.shutdown(socket.SHUT_WR)
        s.recv(1)


@pytest.mark.parametrize("streams", [1, 2])
def test_a_sparse_stream_is_delivered_without_waiting_for_more(gpu: Any, streams: int) -> None:
    messages = [b"ping" * 25, b"x", b"last message"]
    with gpu.netgpu.pool(nbytes=16 * CHUNK, chunk=CHUNK) as pool:
        rx = pool.listen(("127.0.0.1", 0), streams=streams, timeout=RX_TIMEOUT, coalesce_ms=5)
        seen = [threading.Semaphore(0) for _ in range(streams)]
        errors: list[BaseException] = []

        def send(i: int) -> None:
            try:
                sparse_sender(rx.address, messages, seen[i])
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(streams)]
        for t in threads:
            t.start()
        whole = [b"".join(messages[: k + 1]) for k in range(len(messages))]
        got: dict[int, bytes] = {}
        for frag in rx:
            got[frag.stream] = got.get(frag.stream, b"") + frag.array().tobytes()
            pool.release([frag.token])
            if got[frag.stream] in whole:  # a message is all in: its sender may go on
                seen[frag.stream].release()
        for t in threads:
            t.join()
    assert not errors, errors
    assert sorted(got.values()) == [b"".join(messages)] * streams


def test_several_coalesced_streams_keep_a_window_of_several_chunks(gpu: Any) -> None:
    """Setting a chunk's SO_RCVLOWAT, Linux clamps the socket's window to that chunk
    (tcp_set_rcvlowat). A window of one chunk closes just as epoll reports the socket, and
    the sender then stops at every chunk; a coalesced stream among several keeps
    WINDOW_MARKS chunks (as far as net.ipv4.tcp_rmem lets it) and still waits for one."""
    chunk = 1 << 20
    with open("/proc/sys/net/ipv4/tcp_rmem") as f:
        most = int(f.read().split()[2]) // 2  # the kernel's cap on a mark, and so the clamp
    with gpu.netgpu.pool(nbytes=8 * chunk, chunk=chunk) as pool:
        rx = pool.listen(("127.0.0.1", 0), streams=2, timeout=RX_TIMEOUT, coalesce_ms=5)
        peers = [socket.create_connection(rx.address) for _ in range(2)]
        for p in peers:
            p.sendall(b"x")  # below the mark: the sweep reads it within a period
        frag = next(rx)  # by now both connections are the Rx's streams
        pool.release([frag.token])
        socks = [s.sock for s in rx._all]  # the Rx's own sockets: no public view of them
        assert len(socks) == 2
        for sock in socks:
            clamp = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP)
            assert clamp >= min(WINDOW_MARKS * chunk, most) > chunk, clamp
        rx.close()
        for p in peers:
            p.close()


def test_a_silent_coalesced_stream_still_times_out(gpu: Any) -> None:
    with gpu.netgpu.pool(nbytes=4 * CHUNK, chunk=CHUNK) as pool:
        a, b = socket.socketpair()
        with b:
            rx = pool.receive(a, timeout=0.5, coalesce_ms=5)
            with pytest.raises(TimeoutError, match=r"nothing happened for 0\.5 s"):
                next(rx)
            rx.close()


@pytest.mark.parametrize("bad", [-1.0, 1000.5])
def test_coalesce_ms_out_of_range_says_so(gpu: Any, bad: float) -> None:
    with gpu.netgpu.pool(nbytes=4 * CHUNK, chunk=CHUNK) as pool:
        with pytest.raises(NetGPUError, match=f"coalesce_ms = {bad}: must be 0"):
            pool.listen(("127.0.0.1", 0), coalesce_ms=bad)
        a, b = socket.socketpair()
        with a, b, pytest.raises(NetGPUError, match="coalesce_ms"):
            pool.receive(a, coalesce_ms=bad)


def test_a_sparse_stream_beside_a_busy_one_is_not_held_back(gpu: Any) -> None:
    """The busy stream keeps epoll reporting; the sparse one's bytes sit below its mark and
    are read only by the sweep, which must come every period all the same."""
    messages = [b"a" * 10, b"b" * 20, b"c" * 30]
    sparse_done = threading.Event()
    errors: list[BaseException] = []

    def busy(addr: tuple[str, int]) -> subprocess.Popen[bytes]:
        # another process, as a real peer is: a thread here would pause for the GIL and
        # leave epoll quiet now and then, which would hide a missed sweep
        return subprocess.Popen([sys.executable, "-c", BUSY_SENDER, addr[0], str(addr[1])])

    def sparse(addr: tuple[str, int], seen: threading.Semaphore) -> None:
        try:
            sparse_sender(addr, messages, seen)
        except BaseException as e:
            errors.append(e)
        finally:
            sparse_done.set()

    with gpu.netgpu.pool(nbytes=16 * CHUNK, chunk=CHUNK) as pool:
        rx = pool.listen(("127.0.0.1", 0), streams=2, timeout=RX_TIMEOUT, coalesce_ms=5)
        seen = threading.Semaphore(0)
        sender = busy(rx.address)
        sparse_thread = threading.Thread(target=sparse, args=(rx.address, seen), daemon=True)
        # it sends until killed, once the sparse stream is all in; its end is then a FIN
        threading.Thread(target=lambda: sparse_done.wait() and sender.kill(), daemon=True).start()
        whole = {b"".join(messages[: k + 1]) for k in range(len(messages))}
        got: dict[int, bytes] = {}
        for frag in rx:
            data = frag.array().tobytes()
            pool.release([frag.token])
            if not sparse_thread.is_alive() and not sparse_done.is_set():
                sparse_thread.start()  # once the busy stream flows
            if data.strip(b"\0"):  # the sparse stream (the busy one sends zeros)
                got[frag.stream] = got.get(frag.stream, b"") + data
                if got[frag.stream] in whole:
                    seen.release()
        sender.wait()
    assert not errors, errors
    assert list(got.values()) == [b"".join(messages)]


def test_a_stream_idle_past_a_period_is_woken_by_a_single_byte(gpu: Any) -> None:
    """Read alone, a coalesced read waits in the kernel for its whole chunk (SO_RCVLOWAT);
    once a period passes with nothing the stream waits in poll, and there one byte must
    wake it: a poll that kept the chunk's mark would sleep until the receiver's timeout."""
    with gpu.netgpu.pool(nbytes=4 * CHUNK, chunk=CHUNK) as pool:
        with socket.create_server(("127.0.0.1", 0)) as ls:  # TCP: poll honours the mark
            b = socket.create_connection(ls.getsockname())
            a = ls.accept()[0]
        rx = pool.receive(a, timeout=RX_TIMEOUT, coalesce_ms=5)
        got: queue.Queue[bytes | BaseException] = queue.Queue()

        def receive() -> None:
            try:
                for frag in rx:
                    got.put(frag.array().tobytes())
                    pool.release([frag.token])
            except BaseException as e:
                got.put(e)

        reader = threading.Thread(target=receive, daemon=True)
        reader.start()
        wchan = Path(f"/proc/self/task/{reader.native_id}/wchan")
        with b:
            for byte in (b"a", b"b", b"c"):
                # parked in poll: a whole period went by with nothing
                wait_until(
                    lambda: "poll" in wchan.read_text(), RX_TIMEOUT, "the reader in poll", 0.001
                )
                b.sendall(byte)
                assert got.get(timeout=RX_TIMEOUT) == byte
        reader.join(RX_TIMEOUT)
        rx.close()
