"""A guest that speaks the mailbox by hand: for the fuzz and chaos benches and the tests.

It does exactly what a hostile tenant with a valid token could do: send any
bytes, at any rate, stop in the middle of a frame, hold full access, never
answer. It parses the host's replies with protocol/mailbox.py and keeps any
descriptors the host sends only as long as asked.
"""

from __future__ import annotations

import array
import contextlib
import os
import socket
from pathlib import Path

from gpuvirt.protocol.mailbox import (
    FRAME_SIZE,
    Attach,
    Frame,
    GuestMsg,
    HostMsg,
    alive_reply,
)


class RawGuest:
    def __init__(self, path: Path | str, timeout: float = 30.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.fds: list[int] = []

    @classmethod
    def attached(cls, path: Path | str, vf: int, token: bytes, timeout: float = 30.0) -> RawGuest:
        g = cls(path, timeout)
        g.sock.sendall(Attach(vf, token).encode())
        reply = g.recv()
        if reply is None or reply.msg != HostMsg.SUCCESS:
            g.close()
            raise ConnectionError(f"ATTACH to VF{vf} refused: {reply}")
        return g

    def send(self, *frames: Frame) -> None:
        self.sock.sendall(b"".join(f.encode() for f in frames))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, answer_alive: bool = True) -> Frame | None:
        """The next frame from the host (QUERY_ALIVE answered on the way), None at EOF."""
        while True:
            data = bytearray()
            while len(data) < FRAME_SIZE:
                msg, anc, _flags, _addr = self.sock.recvmsg(
                    FRAME_SIZE - len(data), socket.CMSG_SPACE(16 * 4)
                )
                for level, kind, payload in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds = array.array("i")
                        fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                        self.fds.extend(fds)
                if not msg:
                    return None
                data += msg
            frame = Frame.decode(bytes(data))
            if answer_alive and frame.msg == HostMsg.QUERY_ALIVE:
                self.send(alive_reply(frame.dw1))
                continue
            return frame

    def drain(self) -> None:
        """Read (answering QUERY_ALIVE) until the connection ends, as a live guest does."""
        with contextlib.suppress(OSError, ValueError):
            while self.recv() is not None:
                pass

    def init(self) -> Frame | None:
        """INIT_DATA then INIT_ACCESS: the reply to the latter (READY_TO_ACCESS_GPU + fds)."""
        self.send(Frame(GuestMsg.REQ_GPU_INIT_DATA))
        self.recv()
        self.send(Frame(GuestMsg.REQ_GPU_INIT_ACCESS))
        return self.recv()

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()
        self.sock.close()

    def __enter__(self) -> RawGuest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
