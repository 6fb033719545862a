"""The control socket between the host and an engine: message codes and fd passing.

A module of its own because both sides speak it: the engine loop
(device/engine.py) and the host's engine handles (device/process.py, emu.py,
cuda.py). With the codes here, neither side imports the other.
"""

from __future__ import annotations

import array
import socket
import struct

# host -> engine
CTL_GUEST = b"G"  # a new guest's command channel, the fd attached
CTL_ADOPT = b"A"  # + struct ADOPT (vf, FB size), the FB fd attached: a spare takes a VF
ADOPT = struct.Struct("<IQ")
CTL_EXIT = b"X"
CTL_WAKE = b"W"
# engine -> host, cooperative engines only
CTL_ACK = b"A"  # ACK_SERIAL has moved
CTL_FAIL = b"F"  # followed by utf-8 text: the engine could not start and is exiting


def recv_fd(sock: socket.socket) -> tuple[bytes, int | None]:
    fds = array.array("i")
    msg, ancdata, _flags, _addr = sock.recvmsg(64, socket.CMSG_SPACE(fds.itemsize))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    return msg, (fds[0] if fds else None)
