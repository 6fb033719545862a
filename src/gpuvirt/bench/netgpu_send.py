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
from typing import Any, NamedTuple

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


# The sender's congestion control: one without the kernel's internal pacing. Under BBR
# (a common default) each socket is paced by an hrtimer that fires on the CPU that armed
# it. On loopback a receiver that falls behind sends the ACKs that release the sender's
# segments, so the timer is armed on the receiver's CPU and stays there: the other
# machine's transmit work then runs on this host's receiving CPU for the rest of the
# stream (perf: tcp_pace_kick → tcp_write_xmit in the receiver's samples); on a 2-CPU
# VM raw's own trials ran at 2.5-3.3 GB/s under BBR against 4.4-5.8 under cubic
# (docs/netgpu-staged-log.md, "A fifth look"). A real link's sender paces on its own machine.
SENDER_CC = "cubic"


def sender_cc() -> str | None:
    """SENDER_CC where this kernel offers it, else None (the sender keeps the default)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            return SENDER_CC if SENDER_CC in f.read().split() else None
    except OSError:
        return None


class Placement(NamedTuple):
    """Where a run's sender and receiver may run (CPU numbers)."""

    sender: list[int]
    receiver: list[int]


def place(sender_pid: int, engine_pid: int) -> Placement:
    """Keep the sender (process `sender_pid`) off the CPUs the VF's engine runs on and
    the receiver (the calling thread) off the sender's, as two machines and a device
    would be: the sender stands in for another machine, whose work is not this host's,
    and on emu the engine's CPU is the emulated device (its copy is the staged path's
    DMA). Left to the scheduler on 2 CPUs, the sender and the receiver traded CPUs
    within a trial, and the staged trials that ended with the receiver on the sender's
    CPU ran at 2.3-2.4 GB/s against 4-6 for the others (docs/netgpu.md, "The staged
    path"; docs/netgpu-staged-log.md, "A fifth look"). Every path runs with the same placement.

    With one CPU besides the device's, the receiver has the device's (where a host with
    a GPU would run it too); with more, the sender takes the first half of them and the
    receiver the rest. Where the engine may use every CPU there is nothing to keep apart.
    """
    mine = os.sched_getaffinity(0)
    others = sorted(mine - os.sched_getaffinity(engine_pid))
    if not others:
        return Placement(sorted(mine), sorted(mine))
    if len(others) == 1:
        sender, receiver = others, sorted(mine - set(others))
    else:
        half = len(others) // 2
        sender, receiver = others[:half], others[half:]
    os.sched_setaffinity(sender_pid, sender)
    os.sched_setaffinity(0, receiver)
    return Placement(sender, receiver)


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
    cc = sender_cc()
    if cc is not None:
        for s in socks:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
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
