"""NetGPU end to end: a real host, a real VF, real TCP sockets on 127.0.0.1.

One host for the module (starting one costs more than most of these tests);
VF0 serves every test that does not reset its VF, VF1 is reset, VF2 is left
to the CLI tests.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import socket
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuvirt
from gpuvirt.bench.common import scratch_host
from gpuvirt.errors import BufferLostError, GpuvirtError
from gpuvirt.host.process import HostProcess
from gpuvirt.netgpu import Frag, NetGPUError, Pool, RxError, StreamError, TokenError
from gpuvirt.netgpu.providers import select_provider
from gpuvirt.netgpu.tx import SYNTH_BLOCK, SyntheticSource, split
from gpuvirt.protocol.frames import FLAG_CRC, Header, header_for
from helpers import last_seq, wait_event, wait_until

pytestmark = pytest.mark.timeout(30)
RX_TIMEOUT = 10.0  # a receive that waits this long for anything is a failed test, not a hang


@pytest.fixture(scope="module")
def host() -> Iterator[HostProcess]:
    with scratch_host(sriov={"vf_num": 3}) as hp:
        yield hp


@pytest.fixture(scope="module")
def gpu(host: HostProcess) -> Iterator[Any]:
    g = gpuvirt.attach(vf=0, socket=host.socket, token=host.token(0))
    yield g
    g.close()


# ---- senders that are not ours ---------------------------------------------------------


def send_messages(
    addr: tuple[str, int],
    stream: int,
    payloads: list[bytes],
    crc: bool = False,
    first_seq: int = 0,
) -> None:
    """A framed sender written from the wire format, not from gpuvirt.netgpu.tx."""
    with socket.create_connection(addr) as s:
        for i, p in enumerate(payloads):
            s.sendall(header_for(stream, first_seq + i, p, crc=crc).encode() + p)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # until the receiver closes: every byte was taken


def in_thread(fn: Callable[..., Any], *args: Any) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def collect(rx: Any, pool: Pool) -> dict[int, list[tuple[Frag, bytes]]]:
    """Every fragment of every stream with its bytes (read from the FB), released as we go."""
    out: dict[int, list[tuple[Frag, bytes]]] = {}
    for frag in rx:
        out.setdefault(frag.stream, []).append((frag, frag.array().tobytes()))
        pool.release([frag.token])
    return out


def check_placement(pool: Pool, frags: list[Frag]) -> None:
    for f in frags:
        rel = f.offset - pool.offset
        assert rel >= 0 and rel + f.size <= pool.nbytes
        assert rel // pool.chunk == (rel + f.size - 1) // pool.chunk, f"{f} spans chunks"
    assert [f.seq for f in frags] == list(range(len(frags)))


# ---- the sender's data ---------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(size=st.integers(0, 3 * SYNTH_BLOCK), streams=st.integers(1, 5), seed=st.integers(0, 9))
def test_synthetic_data_is_one_seeded_sequence_split_in_parts(
    size: int, streams: int, seed: int
) -> None:
    src = SyntheticSource(size, seed)
    whole = src.read(0, size)
    assert len(whole) == size and whole == SyntheticSource(size, seed).read(0, size)
    bounds = split(size, streams)
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert b"".join(src.read(a, b) for a, b in bounds) == whole


# ---- data arrives intact, in order ------------------------------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, int, int, list[list[int]]]:
    chunk = draw(st.sampled_from([256, 512, 1024, 4096, 65536]))
    nchunks = draw(st.integers(2, 12))
    streams = draw(st.integers(1, min(3, nchunks)))
    share = (nchunks // streams) * chunk
    sizes = st.lists(st.integers(0, min(share, 3 * chunk + 7)), min_size=1, max_size=12)
    return chunk, nchunks, streams, [draw(sizes) for _ in range(streams)]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(layout=layouts(), seed=st.integers(0, 2**32 - 1))
def test_framed_streams_arrive_intact_and_in_order(gpu: Any, layout: Any, seed: int) -> None:
    chunk, nchunks, streams, sizes = layout
    rng = np.random.default_rng(seed)
    sent = [[rng.bytes(n) for n in per] for per in sizes]
    with gpu.netgpu.pool(nbytes=nchunks * chunk, chunk=chunk) as pool:
        rx = pool.listen(("127.0.0.1", 0), streams=streams, framed=True, timeout=RX_TIMEOUT)
        senders = [in_thread(send_messages, rx.address, i, sent[i]) for i in range(streams)]
        got = collect(rx, pool)
        for t in senders:
            t.join()
        assert pool.free_chunks == pool.nchunks and pool.tokens_out == 0
    for i in range(streams):
        frags = [f for f, _ in got.get(i, [])]
        check_placement(pool, frags)
        by_message: dict[int, list[tuple[Frag, bytes]]] = {}
        for f, data in got.get(i, []):
            by_message.setdefault(f.message, []).append((f, data))
        # empty messages carry nothing and make no fragment; every other one is whole
        want = {seq: p for seq, p in enumerate(sent[i]) if p}
        assert sorted(by_message) == sorted(want)
        for seq, parts in by_message.items():
            assert b"".join(d for _, d in parts) == want[seq]
            assert [f.last for f, _ in parts] == [False] * (len(parts) - 1) + [True]
            # one fragment when it fits in a chunk; else whole chunks, then the rest
            whole, rest = divmod(len(want[seq]), chunk)
            cut = [chunk] * whole + ([rest] if rest else [])
            assert [f.size for f, _ in parts] == cut


def test_raw_mode_takes_any_writer(gpu: Any) -> None:
    rng = np.random.default_rng(3)
    data = rng.bytes(3 * 1024 * 1024 + 12345)
    a, b = socket.socketpair()

    def writer() -> None:  # a plain socket writer, uneven writes, not gpuvirt's sender
        pos = 0
        for n in rng.integers(1, 200_000, size=10_000):
            if pos >= len(data):
                break
            b.sendall(data[pos : pos + int(n)])
            pos += int(n)
        b.close()

    with gpu.netgpu.pool(nbytes=1 << 20, chunk=64 << 10) as pool:
        t = in_thread(writer)
        got = collect(pool.receive(a, timeout=RX_TIMEOUT), pool)
        t.join()
    frags = [f for f, _ in got[0]]
    check_placement(pool, frags)
    assert b"".join(d for _, d in got[0]) == data
    assert all(f.message is None and f.last for f in frags)


@pytest.mark.parametrize("sender_framed", [True, False])
def test_auto_mode_tells_framed_from_raw(gpu: Any, sender_framed: bool) -> None:
    payloads = [b"first" * 100, bytes(range(256)) * 9]
    with gpu.netgpu.pool(nbytes=256 << 10, chunk=16 << 10) as pool:
        rx = pool.listen(("127.0.0.1", 0), framed=None, timeout=RX_TIMEOUT)
        if sender_framed:
            t = in_thread(send_messages, rx.address, 7, payloads)
        else:
            t = in_thread(lambda: socket.create_connection(rx.address).sendall(b"".join(payloads)))
        got = collect(rx, pool)
        t.join()
    (stream,) = got
    assert b"".join(d for _, d in got[stream]) == b"".join(payloads)
    if sender_framed:
        assert stream == 7 and [f.message for f, _ in got[stream]] == [0, 1]
    else:
        assert stream == 0 and got[stream][0][0].message is None


def test_crc_is_checked_when_the_header_carries_one(gpu: Any) -> None:
    payloads = [np.random.default_rng(5).bytes(5000) for _ in range(4)]
    with gpu.netgpu.pool(nbytes=256 << 10, chunk=8 << 10) as pool:
        rx = pool.listen(("127.0.0.1", 0), framed=True, crc=True, timeout=RX_TIMEOUT)
        t = in_thread(send_messages, rx.address, 0, payloads, True)
        got = collect(rx, pool)
        t.join()
    assert [d for _, d in got[0]] == payloads


# ---- fragments in the engine -------------------------------------------------------------


def double(xp: Any, a: Any) -> None:
    a *= 2


def test_a_kernel_sums_a_fragment_where_it_landed(gpu: Any) -> None:
    values = np.random.default_rng(11).integers(0, 1 << 20, size=50_000, dtype=np.int32)
    payload = values.tobytes()
    with gpu.netgpu.pool(nbytes=1 << 20, chunk=256 << 10) as pool:
        rx = pool.listen(("127.0.0.1", 0), framed=True, timeout=RX_TIMEOUT)
        t = in_thread(send_messages, rx.address, 0, [payload])
        (frag,) = list(rx)
        t.join()
        total = gpu.launch(lambda xp, a: int(a.sum(dtype=xp.int64)), frag.buffer(np.int32))
        assert total.result(10) == int(values.sum(dtype=np.int64))
        # the kernel can also write the fragment in place; the guest sees it through its view
        gpu.launch(double, frag.buffer(np.int32)).result(10)
        np.testing.assert_array_equal(frag.array(np.int32), values * 2)
        with pytest.raises(NetGPUError, match="release its token"):
            frag.buffer().free()
        pool.release([frag.token])
        with pytest.raises(BufferLostError, match="released"):
            gpu.launch(lambda xp, a: 0, frag.buffer())


# ---- tokens --------------------------------------------------------------------------------


def test_token_misuse_is_a_clear_error(gpu: Any) -> None:
    with gpu.netgpu.pool(nbytes=64 << 10, chunk=4 << 10) as pool:
        rx = pool.listen(("127.0.0.1", 0), framed=True, timeout=RX_TIMEOUT)
        t = in_thread(send_messages, rx.address, 0, [b"a" * 100, b"b" * 100])
        f1, f2 = list(rx)
        t.join()
        assert issubclass(TokenError, GpuvirtError)
        with pytest.raises(TokenError, match=rf"token {f1.token + 1000}: was never handed out"):
            pool.release([f1.token + 1000])
        with pytest.raises(
            TokenError, match=rf"pass a list of tokens: pool.release\(\[{f1.token}\]\)"
        ):
            pool.release(f1.token)  # type: ignore[arg-type]
        with pytest.raises(TokenError, match="not a token"):
            pool.release(["x"])  # type: ignore[list-item]
        with pytest.raises(TokenError, match="appears twice"):
            pool.release([f1.token, f1.token])
        with pytest.raises(TokenError, match=rf"token {f2.token + 99}"):
            pool.release([f1.token, f2.token + 99])  # all or nothing: f1 stays held
        assert pool.tokens_out == 2
        pool.release([f1.token])
        with pytest.raises(TokenError, match=rf"token {f1.token}: already released"):
            pool.release([f1.token])
        with pytest.raises(BufferLostError, match=f"token {f1.token} was released"):
            f1.array()
        assert f2.array().tobytes() == b"b" * 100
        pool.release([f2.token])
        assert pool.tokens_out == 0 and pool.free_chunks == pool.nchunks


def test_a_dry_pool_holds_the_sender_back_and_loses_nothing(gpu: Any) -> None:
    data = np.random.default_rng(9).bytes(8 << 20)
    chunk = 64 << 10
    with gpu.netgpu.pool(nbytes=4 * chunk, chunk=chunk) as pool:
        # small socket buffers, so the pool, not the kernel, is what holds the bytes
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
        ls.bind(("127.0.0.1", 0))
        ls.listen()
        done = threading.Event()

        def sender() -> None:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)
            s.connect(ls.getsockname())
            s.sendall(data)
            s.close()
            done.set()

        t = in_thread(sender)
        conn, _ = ls.accept()
        rx = pool.receive(conn, timeout=RX_TIMEOUT)
        held: list[Frag] = []
        while sum(f.size for f in held) < pool.nbytes:  # the app holds every token
            held.append(next(rx))
        assert pool.free_chunks == 0 and pool.tokens_out == len(held)
        assert not done.is_set()  # 8 MiB cannot fit in a full pool and two small buffers

        # a reader now waits for the pool, not for the socket; another thread's release wakes it
        waits = pool.dry_waits
        box: list[Frag] = []
        reader = in_thread(lambda: box.append(next(rx)))
        wait_until(lambda: pool.dry_waits != waits, RX_TIMEOUT, "the reader waiting", every=0.001)
        assert not box and not done.is_set()
        received = b"".join(f.array().tobytes() for f in held)
        pool.release([f.token for f in held])
        reader.join(RX_TIMEOUT)
        assert box
        received += box[0].array().tobytes()
        pool.release([box[0].token])
        for frag in rx:
            received += frag.array().tobytes()
            pool.release([frag.token])
        t.join()
        ls.close()
    assert done.is_set() and received == data


# ---- bad input: that stream fails, the rest go on ---------------------------------------


def _good_header(length: int, stream: int = 1, seq: int = 0) -> bytes:
    return Header(stream, seq, length).encode()


# what the bad stream sends, why it must fail, and what it delivers before it does
BAD_STREAMS: dict[str, tuple[bytes, str, list[bytes]]] = {
    "corrupt magic": (b"NGPX" + _good_header(10)[4:] + b"x" * 10, "NGPU magic", []),
    "bad version": (
        _good_header(10)[:4] + b"\x09" + _good_header(10)[5:] + b"x" * 10,
        "NGPU version",
        [],
    ),
    "truncated header": (_good_header(10)[:20], "truncated header: .* after 20 of 32", []),
    "mid-message disconnect": (_good_header(5000) + b"x" * 1234, "after 1234 of 5000 payload", []),
    "oversize length": (_good_header(1 << 40), "exceeds the limit", []),
    "wrong crc": (
        Header(1, 0, 4, FLAG_CRC, zlib.crc32(b"abcd") ^ 1).encode() + b"abcd",
        "crc32 .*corrupted in transit",
        [],
    ),
    "seq gap": (
        _good_header(3) + b"abc" + _good_header(3, seq=5) + b"def",
        "seq 5 where 1",
        [b"abc"],
    ),
    "stream id taken": (_good_header(3, stream=0) + b"abc", "stream id 0 is already used", []),
}


@pytest.mark.parametrize("case", list(BAD_STREAMS))
def test_bad_input_fails_only_its_stream(gpu: Any, host: HostProcess, case: str) -> None:
    junk, reason, delivered = BAD_STREAMS[case]
    good = [np.random.default_rng(i).bytes(3000) for i in range(20)]
    with gpu.netgpu.pool(nbytes=128 << 10, chunk=8 << 10) as pool:
        rx = pool.listen(("127.0.0.1", 0), streams=2, framed=True, timeout=RX_TIMEOUT)

        def bad() -> None:
            with contextlib.suppress(OSError), socket.create_connection(rx.address) as s:
                s.sendall(junk)  # the receiver may cut it off (a reset) once it has seen enough

        threads = [in_thread(send_messages, rx.address, 0, good)]
        got: dict[int, list[bytes]] = {}
        with pytest.raises(RxError) as caught:
            for frag in rx:
                if not got:  # the bad stream starts once the good one is flowing (and owns id 0)
                    threads.append(in_thread(bad))
                got.setdefault(frag.stream, []).append(frag.array().tobytes())
                pool.release([frag.token])
        for t in threads:
            t.join()
        (err,) = caught.value.errors
        assert isinstance(err, StreamError) and err.stream != 0
        assert re.search(reason, str(err)), str(err)
        # the good stream is whole, and the failed one gave every chunk back
        assert got[0] == good and got.get(1, []) == delivered
        assert pool.free_chunks == pool.nchunks and pool.tokens_out == 0
    assert gpu.launch(lambda xp: 40 + 2).result(10) == 42  # the guest goes on
    assert host.alive()


# ---- limits and providers ------------------------------------------------------------------


def test_pool_and_receive_limits_say_what_is_wrong(gpu: Any) -> None:
    with pytest.raises(NetGPUError, match="multiple of 256"):
        gpu.netgpu.pool(nbytes=1 << 20, chunk=1000)
    with pytest.raises(NetGPUError, match="at least one"):
        gpu.netgpu.pool(nbytes=1000, chunk=4096)
    with gpu.netgpu.pool(nbytes=16 << 10, chunk=4 << 10) as pool:
        with pytest.raises(NetGPUError, match="at most 4 streams"):
            pool.listen(("127.0.0.1", 0), streams=5)
        a, _b = socket.socketpair()
        with pytest.raises(NetGPUError, match="needs framed mode"):
            pool.receive(a, framed=False, crc=True)


def test_userspace_is_chosen_and_devmem_says_why_not(gpu: Any) -> None:
    sel = gpu.netgpu.selection()
    assert sel.provider.name == "userspace"
    assert "dma-buf" in sel.skipped["devmem"] and "header split" in sel.skipped["devmem"]
    assert "io_uring-zcrx" in sel.skipped
    with pytest.raises(NetGPUError, match=r"devmem.*cannot serve VF0.*dma-buf"):
        select_provider(gpu, "devmem")


def test_rx_bytes_counts_payload_for_the_vf2pf_block(gpu: Any) -> None:
    before = gpu.netgpu.rx_bytes
    with gpu.netgpu.pool(nbytes=64 << 10, chunk=4 << 10) as pool:
        rx = pool.listen(("127.0.0.1", 0), framed=True, timeout=RX_TIMEOUT)
        t = in_thread(send_messages, rx.address, 0, [b"z" * 1000] * 5)
        collect(rx, pool)
        t.join()
    assert gpu.netgpu.rx_bytes - before == 5000  # payload only: headers are not counted


# ---- VF reset ------------------------------------------------------------------------------


def test_after_a_vf_reset_the_pool_is_lost(host: HostProcess) -> None:
    with gpuvirt.attach(vf=1, socket=host.socket, token=host.token(1)) as g:
        pool = g.netgpu.pool(nbytes=64 << 10, chunk=4 << 10)
        a, b = socket.socketpair()
        rx = pool.receive(a, timeout=RX_TIMEOUT)
        b.sendall(b"before")
        frag = next(rx)
        after = last_seq(host)
        g.request_reset()
        wait_event(host, lambda e: e["kind"] == "flr.done" and e["vf"] == 1, after=after)
        g.wait_ready()
        with contextlib.suppress(OSError):  # the VF's loss shut the receiver down
            b.sendall(b"after the reset")
        for use in (lambda: next(rx), frag.array, lambda: pool.release([frag.token])):
            with pytest.raises(BufferLostError, match="was reset"):
                use()
        with g.netgpu.pool(nbytes=64 << 10, chunk=4 << 10) as fresh:  # a new pool works
            assert fresh.free_chunks == 16
        b.close()


def _wchan(thread: threading.Thread) -> str:
    """Where in the kernel `thread` sleeps ("0" when it runs), as /proc reports it."""
    return Path(f"/proc/self/task/{thread.native_id}/wchan").read_text()


def test_framed_messages_sent_one_at_a_time_are_each_delivered_without_waiting_for_more(
    gpu: Any,
) -> None:
    """Request/response: the sender waits for each message to be delivered before it sends
    the next. A read alone waits in the kernel for the whole piece it expects (SO_RCVLOWAT,
    MSG_WAITALL); a header read that kept the last payload's mark would wait for bytes
    this sender will never send, and the test would end in the receiver's timeout."""
    chunk = 16 << 10
    payloads = [bytes([i]) * n for i, n in enumerate([chunk, 100, chunk, 1, 5 * chunk // 2, 7])]
    delivered = threading.Semaphore(0)
    errors: list[BaseException] = []

    def send(addr: tuple[str, int]) -> None:
        try:
            with socket.create_connection(addr) as s:
                for i, p in enumerate(payloads):
                    s.sendall(header_for(3, i, p).encode() + p)
                    assert delivered.acquire(timeout=RX_TIMEOUT), f"message {i} never delivered"
                s.shutdown(socket.SHUT_WR)
                s.recv(1)
        except BaseException as e:
            errors.append(e)

    with gpu.netgpu.pool(nbytes=16 * chunk, chunk=chunk) as pool:
        rx = pool.listen(("127.0.0.1", 0), framed=True, timeout=RX_TIMEOUT)
        sender = in_thread(send, rx.address)
        got: list[bytes] = []
        part = b""
        for frag in rx:
            part += frag.array().tobytes()
            pool.release([frag.token])
            if frag.last:
                got.append(part)
                part = b""
                delivered.release()
        sender.join(RX_TIMEOUT)
    assert not errors, errors
    assert got == payloads


def test_vf_lost_wakes_a_reader_parked_in_recv(gpu: Any) -> None:
    """What the guest library calls when it drops the VF: no recv may still write after it."""
    c, d = socket.socketpair()
    probe = in_thread(c.recv, 1)
    with gpu.netgpu.pool(nbytes=64 << 10, chunk=4 << 10) as pool:
        a, b = socket.socketpair()
        rx = pool.receive(a, timeout=RX_TIMEOUT)
        b.sendall(b"x")
        pool.release([next(rx).token])
        ended = threading.Event()
        reader = in_thread(lambda: (list(rx), ended.set()))
        # where a recv on an idle socketpair sleeps, measured on the probe (not a futex: that
        # is the probe on its way in, waiting for the GIL)
        wait_until(lambda: _wchan(probe) != "0" and "futex" not in _wchan(probe), every=0.001)
        wait_until(lambda: _wchan(reader) == _wchan(probe), every=0.001)  # parked in recv
        gpu.netgpu.vf_lost()
        reader.join(RX_TIMEOUT)
        assert ended.is_set() and pool.free_chunks == pool.nchunks
        b.close()
    d.send(b"x")
    probe.join()
