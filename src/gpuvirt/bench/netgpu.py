"""`gpuvirt bench netgpu`: loopback TCP into a VF's FB, against the two ways without NetGPU.

Paths, all receiving the same bytes from the same sender process, in one run:
- zerocopy: `pool.listen(...)` into the VF's page pool, coalescing reads
  (`coalesce_ms`, netgpu/coalesce.py: a read waits up to a kernel tick for its
  chunk to fill); each fragment's token is released as soon as it arrives.
  Its fragments per GB are reported beside it.
- raw: `recv_into` a preallocated chunk-sized buffer in host memory, as a
  plain loop does: what a receive costs when nothing is done with the bytes.
  The judged baseline (DESIGN.md).
- copy: `recv` → a new bytes object → copied into device memory (a Buffer's
  view of the FB on emu; on cuda the staged write a Buffer does), what an
  application does without NetGPU.
- raw-lowat (reported, not judged): the raw loop on sockets with SO_RCVLOWAT =
  a chunk, the mark NetGPU's receivers set (netgpu/stream.py): the kernel then
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

import multiprocessing as mp
import os
import resource
import select
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gpuvirt.bench.common import MIN_ROUNDS, Result, Target, scratch_host, spread
from gpuvirt.bench.netgpu_send import MESSAGE, sender_main
from gpuvirt.guest.memory import Buffer, MappedFB
from gpuvirt.protocol.frames import HEADER_SIZE

PATHS = ("zerocopy", "raw", "copy", "raw-lowat")
MODES = ("framed", "raw")  # DESIGN.md: rows' mode = framed|raw (raw: any byte stream)
STREAMS = (1, 2, 4)
CHUNK = 1 << 20
POOL = 64 << 20
WARMUP = 32 << 20
COALESCE_MS = 1.0  # zerocopy: a read waits this long (a kernel tick, at least) for its chunk
TARGET_THROUGHPUT = 0.97
TARGET_CPU = 1.05


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


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
        self.pool = gpu.netgpu.pool(nbytes=POOL, chunk=CHUNK)
        # per stream, as any receiver keeps its streams apart (and as the pool does)
        self.bufs = [memoryview(bytearray(CHUNK)) for _ in range(max(STREAMS))]  # raw: host
        # copy: into the FB, through its view where the guest maps it (emu), else with
        # Buffer.write through staging (cuda)
        self.dsts = [gpu.alloc(CHUNK, np.uint8) for _ in range(max(STREAMS))]
        self.mapped = isinstance(gpu._fb, MappedFB)
        self.fragments = 0  # the last zerocopy trial's
        for d in self.dsts:
            d.write(np.zeros(CHUNK, np.uint8))

    def zerocopy(self, send: Callable[[int], None], streams: int, framed: bool) -> int:
        pool = self.pool
        rx = pool.listen(
            ("127.0.0.1", 0), streams=streams, framed=framed, timeout=60, coalesce_ms=COALESCE_MS
        )
        send(rx.address[1])
        release = pool.release
        n = 0
        for frag in rx:
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
        def payload(buf: Buffer) -> Payload:
            dst = buf.view() if self.mapped else None

            def recv_copy(s: socket.socket, n: int, flags: int) -> int:
                data = s.recv(n, flags)
                if dst is not None:
                    dst[: len(data)] = np.frombuffer(data, np.uint8)
                else:  # a partial write, which Buffer.write (whole buffers) does not offer
                    buf._gpu._fb.write(buf.offset, np.frombuffer(data, np.uint8))
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
    try:
        with scratch_host(sriov={"vf_num": 1}, device={"backend": backend}) as hp:
            import gpuvirt

            gpu = gpuvirt.attach(0, socket=hp.socket, token=hp.token(0))
            try:
                paths = _Paths(gpu)
                provider = paths.pool.provider.name
                for streams in STREAMS:  # warm-up, not counted: first-use costs of every path
                    for mode in MODES:
                        for path in PATHS:
                            _trial(paths, parent, mode, path, streams, WARMUP, -1)
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
        parent.send(None)
        sender.join(10)
    return _result(trials, backend, per_trial, reps, provider)


def _trial(
    paths: _Paths, pipe: Any, mode: str, path: str, streams: int, nbytes: int, rep: int
) -> dict[str, Any]:
    framed = mode == "framed"
    per_stream = nbytes // streams

    def send(port: int) -> None:
        pipe.send((port, streams, per_stream, framed))

    t0, c0 = time.perf_counter(), _cpu_s()
    got = getattr(paths, path.replace("-", "_"))(send, streams, framed)
    seconds, cpu = time.perf_counter() - t0, _cpu_s() - c0
    errors = pipe.recv()
    if errors or got != per_stream * streams:
        raise RuntimeError(
            f"bench netgpu {mode} {path}: got {got} of {per_stream * streams} B {errors}"
        )
    gb = got / 1e9
    trial = {
        "mode": mode, "path": path, "streams": streams, "rep": rep,
        "gbytes_per_s": gb / seconds, "cpu_s_per_gb": cpu / gb,
    }  # fmt: skip
    if path == "zerocopy":
        trial["fragments_per_gb"] = paths.fragments / gb
    return trial


def _result(
    trials: list[dict[str, Any]], backend: str, per_trial: int, reps: int, provider: str
) -> Result:
    def pick(mode: str, path: str, streams: int, key: str) -> list[float]:
        return [
            t[key]
            for t in trials
            if t["mode"] == mode and t["path"] == path and t["streams"] == streams
        ]

    def ratio(mode: str, streams: int, key: str, base: str = "raw") -> float:
        # within each repetition first: neighbouring trials share the machine's mood
        zc, raw = pick(mode, "zerocopy", streams, key), pick(mode, base, streams, key)
        return statistics.median(z / r for z, r in zip(zc, raw, strict=True))

    rows = [
        {
            "mode": mode,
            "path": path,
            "streams": n,
            "gbytes_per_s": round(statistics.median(pick(mode, path, n, "gbytes_per_s")), 3),
            "cpu_s_per_gb": round(statistics.median(pick(mode, path, n, "cpu_s_per_gb")), 4),
            **(
                {
                    "fragments_per_gb": round(
                        statistics.median(pick(mode, path, n, "fragments_per_gb"))
                    )
                }
                if path == "zerocopy"
                else {}
            ),
        }
        for mode in MODES
        for n in STREAMS
        for path in PATHS
    ]
    by_mode = {
        mode: {
            str(n): {
                "throughput_ratio": round(ratio(mode, n, "gbytes_per_s"), 3),
                "cpu_ratio": round(ratio(mode, n, "cpu_s_per_gb"), 3),
                "cpu_ratio_lowat": round(ratio(mode, n, "cpu_s_per_gb", "raw-lowat"), 3),
            }
            for n in STREAMS
        }
        for mode in MODES
    }
    # judged: every mode and stream count; the headline is the worst of them
    judged = [v for by_n in by_mode.values() for v in by_n.values()]
    throughput_ratio = min(v["throughput_ratio"] for v in judged)
    cpu_ratio = max(v["cpu_ratio"] for v in judged)
    cpu_ratio_lowat = max(v["cpu_ratio_lowat"] for v in judged)

    def per_rep(key: str, worst: Any) -> list[float]:
        """The headline figure within each repetition (zerocopy over raw, worst case)."""
        out = []
        for rep in sorted({t["rep"] for t in trials}):
            at = {(t["mode"], t["path"], t["streams"]): t[key] for t in trials if t["rep"] == rep}
            out.append(
                worst([at[m, "zerocopy", n] / at[m, "raw", n] for m in MODES for n in STREAMS])
            )
        return out

    table: list[tuple[str, Any, str]] = []
    for r in rows:
        what = f"{r['mode']} {r['path']} · {r['streams']} stream{'s' if r['streams'] > 1 else ''}"
        table.append((what, r["gbytes_per_s"], "GB/s"))
        table.append((what, r["cpu_s_per_gb"], "CPU s/GB"))
        if "fragments_per_gb" in r:
            table.append((what, r["fragments_per_gb"], "fragments/GB"))
    for mode, by_n in by_mode.items():
        for n, v in by_n.items():
            table.append(
                (f"{mode} zerocopy/raw throughput · {n} stream(s)", v["throughput_ratio"], "×")
            )
            table.append((f"{mode} zerocopy/raw CPU per GB · {n} stream(s)", v["cpu_ratio"], "×"))
            table.append(
                (f"{mode} zerocopy/raw-lowat CPU per GB · {n} stream(s)", v["cpu_ratio_lowat"], "×")
            )
    return Result(
        bench="netgpu",
        backend=backend,
        figures={
            "rows": rows,
            "throughput_ratio": throughput_ratio,
            "cpu_ratio": cpu_ratio,
            "cpu_ratio_lowat": cpu_ratio_lowat,
            "rounds": reps,
            "spread": {
                "throughput_ratio": spread(per_rep("gbytes_per_s", min), 3),
                "cpu_ratio": spread(per_rep("cpu_s_per_gb", max), 3),
            },
            "by_mode": by_mode,
            "provider": provider,
            "bytes_per_trial": per_trial,
            "repetitions": reps,
        },
        targets=[
            Target("throughput_ratio", throughput_ratio, TARGET_THROUGHPUT, ">="),
            Target("cpu_ratio", cpu_ratio, TARGET_CPU, "<="),
        ],
        rows=table,
        notes=[
            f"loopback TCP, {per_trial >> 20} MiB per trial, {reps} repetitions, orders "
            f"alternated and rotated; pool {POOL >> 20} MiB of {CHUNK >> 20} MiB chunks; "
            f"framed messages {MESSAGE >> 20} MiB; provider {provider}; {os.cpu_count()} CPUs; "
            f"zerocopy coalesces reads (coalesce_ms={COALESCE_MS:g}) and sets SO_RCVLOWAT; raw "
            "and copy read as a plain loop does; raw-lowat is raw with SO_RCVLOWAT = a chunk "
            "(reported, not judged: zerocopy over it is the pool's own cost)",
            "CPU = the receiving process's user+system time (getrusage) per GB; the sender "
            "is another process",
            "ratios: zerocopy over raw within each repetition, median across repetitions; "
            "targets judge the worst mode and stream count; spread: that worst case per "
            "repetition",
        ],
        series={
            mode: {
                path: {
                    str(n): {
                        "gbytes_per_s": pick(mode, path, n, "gbytes_per_s"),
                        "cpu_s_per_gb": pick(mode, path, n, "cpu_s_per_gb"),
                    }
                    for n in STREAMS
                }
                for path in PATHS
            }
            for mode in MODES
        },
    )
