"""`gpuvirt bench netgpu`: loopback TCP into a VF's FB, against the two ways without NetGPU.

Paths, all receiving the same bytes from the same sender process, in one run:
- zerocopy: `pool.listen(...)` into the VF's page pool, coalescing reads
  (`coalesce_ms`, netgpu/coalesce.py: a read waits up to a kernel tick for its
  chunk to fill); each fragment's token is released as soon as it arrives.
  Its fragments per GB are reported beside it.
- staged: the same receive through the staging path a cuda VF takes
  (`cuda-staging`: each read lands in a staging chunk, the engine copies it
  into the pool; docs/netgpu.md, "The staged path"). On emu the VF gets that
  path from `gpu.add_staging` (a staging area of a cuda VF's size, carved from
  its FB; the engine's copy is a memcpy there). Judged against raw like
  zerocopy. Before the measured trials, a warm-up trial of every mode and
  stream count hashes what each stream left in device memory and compares it
  with the sha256 of what was sent (`staged_verified`); a mismatch fails the
  bench.
- raw: `recv_into` a preallocated chunk-sized buffer in host memory, as a
  plain loop does: what a receive costs when nothing is done with the bytes.
  The judged baseline (DESIGN.md).
- copy: `recv` → a new bytes object → copied into device memory (a Buffer's
  view of the FB on emu; on cuda the staged write a Buffer does), what an
  application does without NetGPU.
- raw-lowat (reported, not judged): the raw loop on sockets with SO_RCVLOWAT =
  a chunk, the mark NetGPU's receivers set (netgpu/stream.py; with several
  streams, over the wider window they open, netgpu/coalesce.py): the kernel then
  wakes a reader once per chunk instead of once per arriving burst, which is
  most of what zerocopy saves over raw. zerocopy over raw-lowat is what the
  pool's own bookkeeping costs.

Each is measured with 1, 2 and 4 streams, framed (NGPU headers, 1 MiB
messages) and raw, and every one of those is judged (the worst of them is the
headline). The receiver is this process, the
sender another, and the CPU cost is this process's own user+system time
(getrusage) per GB. Trials rotate the path order every repetition so drift
and noise fall on every path alike, and ratios are taken within a repetition
before the median across repetitions.
"""

from __future__ import annotations

import functools
import hashlib
import multiprocessing as mp
import os
import select
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gpuvirt.bench import netgpu_cpu
from gpuvirt.bench import netgpu_figures as figures
from gpuvirt.bench.common import MIN_ROUNDS, Result, scratch_host
from gpuvirt.bench.netgpu_figures import MODES, PATHS, STREAMS
from gpuvirt.bench.netgpu_send import MESSAGE, place, sender_cc, sender_main, stream_sha256
from gpuvirt.device.cuda import STAGING_SIZE
from gpuvirt.guest.memory import Buffer
from gpuvirt.netgpu.coalesce import open_window
from gpuvirt.protocol.frames import HEADER_SIZE

CHUNK = 1 << 20
POOL = 64 << 20
WARMUP = 32 << 20
COALESCE_MS = 1.0  # zerocopy: a read waits this long (a kernel tick, at least) for its chunk


# ---- the receiving paths --------------------------------------------------------------

Payload = Callable[[socket.socket, int, int], int]
"""Receive up to n payload bytes with these MSG_ flags wherever a path puts them; bytes got."""


class _Reader:
    """A baseline's reader for one socket: payload bytes per step, None at the end."""

    def __init__(self, sock: socket.socket, payload: Payload, framed: bool, wait_all: int) -> None:
        self.sock, self.payload, self.framed, self.flags = sock, payload, framed, wait_all
        self.hdr = bytearray(HEADER_SIZE)
        self.hdr_view = memoryview(self.hdr)
        self.got = 0
        self.left = 0
        self.short = False  # the last read got less than it asked for

    def step(self) -> int | None:
        if not self.framed:
            n = self.payload(self.sock, CHUNK, 0)
            self.short = n < CHUNK
            return n or None
        if not self.left:  # the least a framed receiver must do: read the header, take its length
            n = self.sock.recv_into(self.hdr_view[self.got :], 0, self.flags)
            if not n:
                return None
            self.got += n
            self.short = self.got < HEADER_SIZE
            if not self.short:
                self.got = 0
                self.left = int.from_bytes(self.hdr[16:24], "little")
            return 0
        want = min(self.left, CHUNK)
        n = self.payload(self.sock, want, self.flags)
        if not n:
            raise ConnectionError("sender closed mid-message")
        self.left -= n
        self.short = n < want
        return n


def _drain(socks: list[socket.socket], payloads: list[Payload], framed: bool) -> int:
    """Read every socket to its end as the pool's receiver does (one blocking, several
    with epoll, reading a socket again only once a read came up short); total payload."""
    total = 0
    if len(socks) == 1:
        r = _Reader(socks[0], payloads[0], framed, socket.MSG_WAITALL)
        while (n := r.step()) is not None:
            total += n
        socks[0].close()
        return total
    ep = select.epoll()
    live = {s.fileno(): _Reader(s, p, framed, 0) for s, p in zip(socks, payloads, strict=True)}
    for s in socks:
        s.setblocking(False)
        ep.register(s.fileno(), select.EPOLLIN)
    while live:
        for fd, _ in ep.poll():
            r = live[fd]
            while True:
                try:
                    n = r.step()
                except BlockingIOError:
                    break
                if n is None:
                    ep.unregister(fd)
                    del live[fd]
                    r.sock.close()
                    break
                total += n
                if r.short:
                    break
    ep.close()
    return total


class _Paths:
    def __init__(self, gpu: Any) -> None:
        self.gpu = gpu
        self.pool = gpu.netgpu.pool(nbytes=POOL, chunk=CHUNK)  # the VF's own provider
        if gpu.staging() is None:  # emu: the staging path a cuda VF has, to measure it here
            gpu.add_staging(STAGING_SIZE)
        self.staged_pool = gpu.netgpu.pool(nbytes=POOL, chunk=CHUNK, provider="cuda-staging")
        self.verified: list[str] = []  # "mode·streams" whose staged bytes were checked
        # per stream, as any receiver keeps its streams apart (and as the pool does)
        self.bufs = [memoryview(bytearray(CHUNK)) for _ in range(max(STREAMS))]  # raw: host
        # copy: into the FB, through its view where the guest maps it (emu), else with
        # Buffer.write through staging (cuda)
        self.dsts = [gpu.alloc(CHUNK, np.uint8) for _ in range(max(STREAMS))]
        self.mapped = gpu.host_view(self.dsts[0].offset, CHUNK) is not None
        self.fragments = 0  # the last zerocopy trial's
        self.watch: dict[str, int] = {}  # name → pid whose CPU each trial reports too
        for d in self.dsts:
            d.write(np.zeros(CHUNK, np.uint8))

    def zerocopy(self, send: Callable[[int], None], streams: int, framed: bool) -> int:
        return self._receive(self.pool, send, streams, framed)

    def staged(
        self, send: Callable[[int], None], streams: int, framed: bool, verify: int = 0
    ) -> int:
        """verify = bytes per stream: hash every stream from device memory and compare."""
        if not verify:
            return self._receive(self.staged_pool, send, streams, framed)
        hashes = [hashlib.sha256() for _ in range(streams)]
        got = self._receive(self.staged_pool, send, streams, framed, hashes)
        want = stream_sha256(verify, framed)
        bad = [i for i, h in enumerate(hashes) if h.hexdigest() != want]
        if bad:
            raise RuntimeError(
                f"bench netgpu staged {'framed' if framed else 'raw'} × {streams}: streams {bad} "
                f"hold other bytes in device memory than were sent (sha256 {want})"
            )
        self.verified.append(f"{'framed' if framed else 'raw'}·{streams}")
        return got

    def _receive(
        self, pool: Any, send: Callable[[int], None], streams: int, framed: bool,
        hashes: list[Any] | None = None,
    ) -> int:  # fmt: skip
        rx = pool.listen(
            ("127.0.0.1", 0), streams=streams, framed=framed, timeout=60, coalesce_ms=COALESCE_MS
        )
        send(rx.address[1])
        release = pool.release
        n = 0
        for frag in rx:
            if hashes is not None:  # what the FB holds: the mapping, or a copy out of it
                view = self.gpu.host_view(frag.offset, frag.size)
                hashes[frag.stream].update(view if view is not None else frag.buffer().read())
            release([frag.token])
            n += 1
        self.fragments = n
        return rx.bytes

    def raw(self, send: Callable[[int], None], streams: int, framed: bool, lowat: int = 1) -> int:
        def payload(buf: memoryview) -> Payload:
            return lambda s, n, flags: s.recv_into(buf, n, flags)

        return self._baseline(send, framed, [payload(b) for b in self.bufs[:streams]], lowat)

    def raw_lowat(self, send: Callable[[int], None], streams: int, framed: bool) -> int:
        return self.raw(send, streams, framed, lowat=CHUNK)

    def copy(self, send: Callable[[int], None], streams: int, framed: bool) -> int:
        staged = self.gpu.staging()

        def payload(buf: Buffer) -> Payload:
            dst = buf.view() if self.mapped else None

            def recv_copy(s: socket.socket, n: int, flags: int) -> int:
                data = s.recv(n, flags)
                if dst is not None:
                    dst[: len(data)] = np.frombuffer(data, np.uint8)
                else:  # a partial write, which Buffer.write (whole buffers) does not offer
                    staged.write(buf.offset, np.frombuffer(data, np.uint8))
                return len(data)

            return recv_copy

        return self._baseline(send, framed, [payload(d) for d in self.dsts[:streams]])

    def _baseline(
        self, send: Callable[[int], None], framed: bool, payloads: list[Payload], lowat: int = 1
    ) -> int:
        with socket.create_server(("127.0.0.1", 0)) as ls:
            send(ls.getsockname()[1])
            socks = [ls.accept()[0] for _ in payloads]
        for s in socks:
            if lowat > 1 and len(socks) > 1:  # as NetGPU's receivers of several streams do
                open_window(s, lowat)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
        return _drain(socks, payloads, framed)


# ---- the run --------------------------------------------------------------------------


def run(quick: bool = False, backend: str = "emu") -> Result:
    # big enough that setting up a receive (listen, accept, epoll) is noise beside it
    per_trial = (256 if quick else 512) << 20
    reps = MIN_ROUNDS if quick else 9
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    sender = ctx.Process(target=sender_main, args=(child,), daemon=True)
    sender.start()
    trials: list[dict[str, Any]] = []
    mine = os.sched_getaffinity(0)  # the receiver's, given back after the run
    try:
        with scratch_host(sriov={"vf_num": 1}, device={"backend": backend}) as hp:
            import gpuvirt

            gpu = gpuvirt.attach(0, socket=hp.socket, token=hp.token(0))
            try:
                engine = hp.status()["vfs"][0]["engine_pid"]
                placed = place(sender.pid, engine)
                paths = _Paths(gpu)
                paths.watch = {"sender": sender.pid, "engine": engine}
                provider = paths.pool.provider.name
                for streams in STREAMS:  # warm-up, not counted: first-use costs of every path
                    for mode in MODES:  # and the staged bytes checked in device memory
                        for path in PATHS:
                            _trial(paths, parent, mode, path, streams, WARMUP, -1, verify=True)
                verified = list(paths.verified)
                for rep in range(reps):
                    # every order alternates or rotates, so drift and noise hit all alike
                    for streams in STREAMS if rep % 2 == 0 else STREAMS[::-1]:
                        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                            k = rep % len(PATHS)
                            for path in PATHS[k:] + PATHS[:k]:
                                trials.append(
                                    _trial(paths, parent, mode, path, streams, per_trial, rep)
                                )
            finally:
                gpu.close()
    finally:
        os.sched_setaffinity(0, mine)
        parent.send(None)
        sender.join(10)
    setup = (
        f"loopback TCP, {per_trial >> 20} MiB per trial, {reps} repetitions, orders "
        f"alternated and rotated; pools {POOL >> 20} MiB of {CHUNK >> 20} MiB chunks; "
        f"framed messages {MESSAGE >> 20} MiB; zerocopy's provider {provider}, staged's "
        f"cuda-staging ({STAGING_SIZE >> 20} MiB of staging); {os.cpu_count()} CPUs; "
        f"zerocopy and staged coalesce reads (coalesce_ms={COALESCE_MS:g}) and set "
        "SO_RCVLOWAT; raw and copy read as a plain loop does; raw-lowat is raw with "
        "SO_RCVLOWAT = a chunk (reported, not judged: a path over it is the pool's own cost)"
    )
    result = figures.result(trials, backend, per_trial, reps, provider, verified, setup)
    result.figures["sender_cpus"] = placed.sender
    result.figures["receiver_cpus"] = placed.receiver
    result.figures["sender_cc"] = sender_cc() or "the kernel's default"
    result.notes.append(
        f"the sender runs on CPUs {placed.sender}, off the engine's, and the receiver on "
        f"CPUs {placed.receiver}, off the sender's (netgpu_send.place); its TCP congestion "
        f"control is {result.figures['sender_cc']} (netgpu_send.SENDER_CC)"
    )
    return result


def _trial(
    paths: _Paths, pipe: Any, mode: str, path: str, streams: int, nbytes: int, rep: int,
    verify: bool = False,
) -> dict[str, Any]:  # fmt: skip
    framed = mode == "framed"
    per_stream = nbytes // streams

    def send(port: int) -> None:
        pipe.send((port, streams, per_stream, framed))

    receive = getattr(paths, path.replace("-", "_"))
    if verify and path == "staged":
        receive = functools.partial(receive, verify=per_stream)
    t0, u0 = time.perf_counter(), netgpu_cpu.sample(paths.watch)
    got = receive(send, streams, framed)
    seconds, u1 = time.perf_counter() - t0, netgpu_cpu.sample(paths.watch)
    errors = pipe.recv()
    if errors or got != per_stream * streams:
        raise RuntimeError(
            f"bench netgpu {mode} {path}: got {got} of {per_stream * streams} B {errors}"
        )
    gb = got / 1e9
    trial = {
        "mode": mode, "path": path, "streams": streams, "rep": rep,
        "gbytes_per_s": gb / seconds, **netgpu_cpu.per_gb(u0, u1, gb, seconds),
    }  # fmt: skip
    if path == "zerocopy":
        trial["fragments_per_gb"] = paths.fragments / gb
    return trial
