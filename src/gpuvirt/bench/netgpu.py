"""`gpuvirt bench netgpu`: loopback TCP into a VF's FB, against the two ways without NetGPU.

Paths, all receiving the same bytes from the same sender process, in one run:
- zerocopy: `pool.listen(...)` (raw mode) into the VF's page pool; each
  fragment's token is released as soon as it arrives.
- raw: `recv_into` a preallocated chunk-sized buffer in host memory, the
  ceiling: what a receive costs when nothing is done with the bytes.
- copy: `recv` → a new bytes object → copied into device memory (a Buffer's
  view of the FB), what an application does without NetGPU.
- zerocopy-framed (reported, not judged): the same pool with NGPU-framed
  1 MiB messages, header parsing included.

Each is measured with 1 and 2 streams. The receiver is this process, the
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
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gpuvirt.bench.common import Result, Target, scratch_host

PATHS = ("zerocopy", "raw", "copy", "zerocopy-framed")
JUDGED = ("zerocopy", "raw", "copy")
STREAMS = (1, 2)
CHUNK = 1 << 20
POOL = 64 << 20
MESSAGE = 1 << 20  # framed path's message size
SEND_BLOCK = 4 << 20
TARGET_THROUGHPUT = 0.95
TARGET_CPU = 1.1


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ---- the sender (its own process) -----------------------------------------------------


def _sender_main(conn: Any) -> None:
    from gpuvirt.protocol.frames import Header

    data = memoryview(np.random.default_rng(1).bytes(SEND_BLOCK))
    while True:
        job = conn.recv()
        if job is None:
            return
        port, streams, per_stream, framed = job
        errors: list[str] = []  # appended to by the stream threads, read after they end
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]

        def send(
            i: int, s: socket.socket, per_stream: int = per_stream, framed: bool = framed
        ) -> None:
            try:
                sent, seq = 0, 0
                while sent < per_stream:
                    n = min(MESSAGE if framed else SEND_BLOCK, per_stream - sent)
                    part = data[:n]
                    if framed:
                        s.sendmsg([Header(i, seq, n).encode(), part])  # small: sent whole
                        seq += 1
                    else:
                        s.sendall(part)
                    sent += n
                s.shutdown(socket.SHUT_WR)
                while s.recv(4096):
                    pass
            except OSError as e:
                errors.append(f"stream {i}: {e}")  # noqa: B023 - joined before the next job
            finally:
                s.close()

        threads = [threading.Thread(target=send, args=(i, s)) for i, s in enumerate(socks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        conn.send(errors)


# ---- the receiving paths --------------------------------------------------------------


def _accept(listener: socket.socket, streams: int) -> list[socket.socket]:
    return [listener.accept()[0] for _ in range(streams)]


def _drain(socks: list[socket.socket], step: Callable[[socket.socket], int]) -> int:
    """Read every socket to its end with `step` (one read; bytes, 0 at EOF); total bytes."""
    total = 0
    if len(socks) == 1:  # the plain blocking loop
        s = socks[0]
        while n := step(s):
            total += n
        s.close()
        return total
    ep = select.epoll()
    live = {s.fileno(): s for s in socks}
    for s in socks:
        s.setblocking(False)
        ep.register(s.fileno(), select.EPOLLIN)
    while live:
        for fd, _ in ep.poll():
            s = live[fd]
            while True:  # read until it came up short (drained), as the pool's receiver does
                try:
                    n = step(s)
                except BlockingIOError:
                    break
                if not n:
                    ep.unregister(fd)
                    del live[fd]
                    s.close()
                    break
                total += n
                if n < CHUNK:
                    break
    ep.close()
    return total


class _Paths:
    def __init__(self, gpu: Any) -> None:
        self.gpu = gpu
        self.pool = gpu.netgpu.pool(nbytes=POOL, chunk=CHUNK)
        self.buf = memoryview(bytearray(CHUNK))  # raw: host memory, preallocated
        self.dst = gpu.alloc(CHUNK, np.uint8)  # copy: the device memory copied into
        self.dst.view().fill(0)

    def zerocopy(self, send: Callable[[int, bool], None], streams: int, framed: bool) -> int:
        pool = self.pool
        rx = pool.listen(("127.0.0.1", 0), streams=streams, framed=framed, timeout=60)
        send(rx.address[1], framed)
        release = pool.release
        for frag in rx:
            release([frag.token])
        return rx.bytes

    def raw(self, send: Callable[[int, bool], None], streams: int) -> int:
        buf = self.buf
        with socket.create_server(("127.0.0.1", 0)) as ls:
            send(ls.getsockname()[1], False)
            return _drain(_accept(ls, streams), lambda s: s.recv_into(buf))

    def copy(self, send: Callable[[int, bool], None], streams: int) -> int:
        dst = self.dst.view()

        def step(s: socket.socket) -> int:
            data = s.recv(CHUNK)
            dst[: len(data)] = np.frombuffer(data, np.uint8)
            return len(data)

        with socket.create_server(("127.0.0.1", 0)) as ls:
            send(ls.getsockname()[1], False)
            return _drain(_accept(ls, streams), step)


# ---- the run --------------------------------------------------------------------------


def run(quick: bool = False, backend: str = "emu") -> Result:
    per_trial = (192 if quick else 1024) << 20
    reps = 3 if quick else 5
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    sender = ctx.Process(target=_sender_main, args=(child,), daemon=True)
    sender.start()
    trials: list[dict[str, Any]] = []
    try:
        with scratch_host(sriov={"vf_num": 1}, device={"backend": backend}) as hp:
            import gpuvirt

            gpu = gpuvirt.attach(0, socket=hp.socket, token=hp.token(0))
            try:
                paths = _Paths(gpu)
                provider = paths.pool.provider.name
                for rep in range(reps):
                    for streams in STREAMS if rep % 2 == 0 else STREAMS[::-1]:
                        k = rep % len(PATHS)
                        for path in PATHS[k:] + PATHS[:k]:
                            trials.append(
                                _trial(paths, parent, path, streams, per_trial // streams, rep)
                            )
            finally:
                gpu.close()
    finally:
        parent.send(None)
        sender.join(10)
    return _result(trials, backend, per_trial, reps, provider)


def _trial(
    paths: _Paths, pipe: Any, path: str, streams: int, per_stream: int, rep: int
) -> dict[str, Any]:
    def send(port: int, framed: bool) -> None:
        pipe.send((port, streams, per_stream, framed))

    t0, c0 = time.perf_counter(), _cpu_s()
    if path == "zerocopy":
        got = paths.zerocopy(send, streams, framed=False)
    elif path == "zerocopy-framed":
        got = paths.zerocopy(send, streams, framed=True)
    elif path == "raw":
        got = paths.raw(send, streams)
    else:
        got = paths.copy(send, streams)
    seconds, cpu = time.perf_counter() - t0, _cpu_s() - c0
    errors = pipe.recv()
    if errors or got != per_stream * streams:
        raise RuntimeError(f"bench netgpu {path}: got {got} of {per_stream * streams} B {errors}")
    gb = got / 1e9
    return {
        "path": path, "streams": streams, "rep": rep,
        "gbytes_per_s": gb / seconds, "cpu_s_per_gb": cpu / gb,
    }  # fmt: skip


def _result(
    trials: list[dict[str, Any]], backend: str, per_trial: int, reps: int, provider: str
) -> Result:
    def pick(path: str, streams: int, key: str) -> list[float]:
        return [t[key] for t in trials if t["path"] == path and t["streams"] == streams]

    def ratio(streams: int, key: str) -> float:
        # within each repetition first: neighbouring trials share the machine's mood
        by_rep = {
            t["rep"]: t[key] for t in trials if t["path"] == "raw" and t["streams"] == streams
        }
        return statistics.median(
            t[key] / by_rep[t["rep"]]
            for t in trials
            if t["path"] == "zerocopy" and t["streams"] == streams
        )

    rows = [
        {
            "path": path,
            "streams": s,
            "gbytes_per_s": round(statistics.median(pick(path, s, "gbytes_per_s")), 3),
            "cpu_s_per_gb": round(statistics.median(pick(path, s, "cpu_s_per_gb")), 4),
        }
        for s in STREAMS
        for path in PATHS
    ]
    per_streams = {
        s: {
            "throughput_ratio": round(ratio(s, "gbytes_per_s"), 3),
            "cpu_ratio": round(ratio(s, "cpu_s_per_gb"), 3),
        }
        for s in STREAMS
    }
    # the worse stream count is the one judged
    throughput_ratio = min(v["throughput_ratio"] for v in per_streams.values())
    cpu_ratio = max(v["cpu_ratio"] for v in per_streams.values())
    table = [
        (f"{r['path']} · {r['streams']} stream{'s' if r['streams'] > 1 else ''}", v, unit)
        for r in rows
        for v, unit in ((r["gbytes_per_s"], "GB/s"), (r["cpu_s_per_gb"], "CPU s/GB"))
    ]
    for s, v in per_streams.items():
        table.append((f"zerocopy/raw throughput · {s} stream(s)", v["throughput_ratio"], "×"))
        table.append((f"zerocopy/raw CPU per GB · {s} stream(s)", v["cpu_ratio"], "×"))
    return Result(
        bench="netgpu",
        backend=backend,
        figures={
            "rows": rows,
            "throughput_ratio": throughput_ratio,
            "cpu_ratio": cpu_ratio,
            "by_streams": per_streams,
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
            f"loopback TCP, {per_trial >> 20} MiB per trial, {reps} repetitions, path order "
            f"rotated each repetition; pool {POOL >> 20} MiB of {CHUNK >> 20} MiB chunks; "
            f"provider {provider}; {os.cpu_count()} CPUs",
            "CPU = the receiving process's user+system time (getrusage) per GB; the sender "
            "is another process",
            "ratios: zerocopy over raw within each repetition, median across repetitions, "
            "worse of 1 and 2 streams",
        ],
        series={
            path: {
                str(s): {
                    "gbytes_per_s": pick(path, s, "gbytes_per_s"),
                    "cpu_s_per_gb": pick(path, s, "cpu_s_per_gb"),
                }
                for s in STREAMS
            }
            for path in PATHS
        },
    )
