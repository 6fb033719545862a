"""The sender of `gpuvirt bench netgpu`: its own process, serving one send job at a time.

A job is (port, streams, bytes per stream, framed); the answer is a list of errors
(empty when every stream was sent whole). One thread sends every stream, through
epoll, so that on two cores the receiver never shares a core with a second sender.
"""

from __future__ import annotations

import hashlib
import os
import select
import socket
from typing import Any

import numpy as np

from gpuvirt.protocol.frames import Header

MESSAGE = 1 << 20  # framed: each message's payload
SEND_BLOCK = 4 << 20  # raw: the most one sendmsg offers


def _data() -> bytes:
    return np.random.default_rng(1).bytes(SEND_BLOCK)


def stream_sha256(per_stream: int, framed: bool) -> str:
    """The sha256 of the payload every stream of a job carries (what a receiver must hold)."""
    data = _data()
    block = MESSAGE if framed else SEND_BLOCK
    h = hashlib.sha256()
    for pos in range(0, per_stream, block):
        h.update(data[: min(block, per_stream - pos)])
    return h.hexdigest()


def place_sender(pid: int, engine_pid: int) -> list[int]:
    """Keep the sender (process `pid`) off the CPUs the VF's engine runs on, and return
    the CPUs it may use.

    The sender stands in for another machine: on a real link its work is not this
    host's. On emu the engine's CPU is the emulated device (its copy is the staged
    path's DMA), so a sender the scheduler puts there competes with the device and not
    with the receiver: on 2 CPUs, left to the scheduler, the sender and the receiver
    trade CPUs within a trial and the staged rows' throughput scatters by 4x
    (docs/netgpu.md, "The staged path"). Every path runs with the same placement.
    Where the engine may use every CPU there is nothing to keep the sender off.
    """
    mine = os.sched_getaffinity(0)
    others = mine - os.sched_getaffinity(engine_pid)
    os.sched_setaffinity(pid, others or mine)
    return sorted(others or mine)


def sender_main(conn: Any) -> None:
    """Serve send jobs from `conn` (a Pipe end) until it sends None."""
    data = memoryview(_data())
    while True:
        job = conn.recv()
        if job is None:
            return
        port, streams, per_stream, framed = job
        try:
            _send_all(data, port, streams, per_stream, framed)
            conn.send([])
        except OSError as e:
            conn.send([f"{type(e).__name__}: {e}"])


def _send_all(data: memoryview, port: int, streams: int, per_stream: int, framed: bool) -> None:
    """Send every stream whole, then wait until the receiver has closed each."""
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
    ep = select.epoll()
    state: dict[int, list[Any]] = {}  # fd → [socket, stream, bytes sent, seq, pending views]
    for i, s in enumerate(socks):
        s.setblocking(False)
        ep.register(s.fileno(), select.EPOLLOUT)
        state[s.fileno()] = [s, i, 0, 0, []]
    while state:
        for fd, _ in ep.poll():
            st = state[fd]
            s, i = st[0], st[1]
            while True:
                if not st[4]:  # next message (or block) to send
                    n = min(MESSAGE if framed else SEND_BLOCK, per_stream - st[2])
                    if not n:
                        s.shutdown(socket.SHUT_WR)
                        ep.unregister(fd)
                        s.setblocking(True)
                        while s.recv(4096):  # until the receiver has it all and closes
                            pass
                        s.close()
                        del state[fd]
                        break
                    st[4] = (
                        [memoryview(Header(i, st[3], n).encode()), data[:n]]
                        if framed
                        else [data[:n]]
                    )
                    st[2] += n
                    st[3] += 1
                try:
                    sent = s.sendmsg(st[4])
                except BlockingIOError:
                    break
                views = st[4]
                while views and sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                if views:
                    views[0] = views[0][sent:]
                    break
    ep.close()
