"""The engine process: executes one VF's kernels on its FB.

Started by the device backend as `python -m gpuvirt.device.engine`, with its
descriptors inherited. It maps the FB, marks itself ready in the status area
and stops itself (SIGSTOP): that stop is how the host sees INIT_GPU complete.
From then on the host runs and idles it with the world-switch commands; the
engine never knows whether it is scheduled, it just gets CPU or it does not.

Work arrives from the guest on the command channel (see protocol/command.py)
and from the host on the control socket: a new guest's channel (with the fd
attached), or exit. Kernels are the tenant's own code and run only here.
"""

from __future__ import annotations

import argparse
import array
import os
import pickle
import selectors
import signal
import socket
import sys
import time
import traceback
from typing import Any, Protocol

import cloudpickle

from gpuvirt.device.status import MAGIC, StatusArea, Word
from gpuvirt.protocol.command import MAX_MESSAGE, BufDesc, Copy, Kind, Message, Status
from gpuvirt.protocol.errors import ProtocolError

CTL_GUEST = b"G"
CTL_EXIT = b"X"
CTL_WAKE = b"W"


class Executor(Protocol):
    """What differs between backends inside an engine: memory views and copies."""

    xp: Any

    def view(self, desc: BufDesc) -> Any: ...

    def copy_in(self, copy: Copy) -> None: ...

    def copy_out(self, copy: Copy) -> None: ...

    def synchronize(self) -> None: ...


def recv_fd(sock: socket.socket) -> tuple[bytes, int | None]:
    fds = array.array("i")
    msg, ancdata, _flags, _addr = sock.recvmsg(64, socket.CMSG_SPACE(fds.itemsize))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    return msg, (fds[0] if fds else None)


class EngineLoop:
    def __init__(
        self, executor: Executor, status: StatusArea, ctl: socket.socket, idle_fd: int
    ) -> None:
        self.executor = executor
        self.status = status
        self.ctl = ctl
        self.idle_fd = idle_fd
        self.guest: socket.socket | None = None
        self.kernels: dict[int, Any] = {}
        # recv(n) allocates n bytes per call; one preallocated buffer avoids a big
        # malloc/free (an mmap/munmap pair at this size) on every launch.
        self._rxbuf = bytearray(MAX_MESSAGE)
        self._rxview = memoryview(self._rxbuf)
        self.sel = selectors.DefaultSelector()
        self.sel.register(ctl, selectors.EVENT_READ, "ctl")

    def serve(self) -> None:
        while True:
            for key, _ in self.sel.select():
                if key.data == "ctl":
                    if not self._control():
                        return
                else:
                    self._guest_message()

    def _control(self) -> bool:
        msg, fd = recv_fd(self.ctl)
        if not msg or msg == CTL_EXIT:
            return False
        if msg == CTL_GUEST and fd is not None:
            self._drop_guest()
            self.guest = socket.socket(fileno=fd)
            self.sel.register(self.guest, selectors.EVENT_READ, "guest")
            self.status.bump(Word.GUEST_EPOCH)
        return True

    def _drop_guest(self) -> None:
        if self.guest is not None:
            self.sel.unregister(self.guest)
            self.guest.close()
            self.guest = None
        self.kernels.clear()

    def _guest_message(self) -> None:
        assert self.guest is not None
        try:
            n = self.guest.recv_into(self._rxbuf)
        except OSError:
            n = 0
        if not n:
            self._drop_guest()
            return
        try:
            msg = Message.decode(self._rxview[:n])
        except ProtocolError as e:
            self._reply(0, Status.BAD_REQUEST, str(e).encode())
            return
        if msg.kind == Kind.DEFINE:
            try:
                self.kernels[msg.kid] = cloudpickle.loads(msg.payload)
            except Exception:
                self.kernels[msg.kid] = _LoadFailure(traceback.format_exc())
        elif msg.kind == Kind.LAUNCH:
            self._launch(msg)
        elif msg.kind in (Kind.COPY_IN, Kind.COPY_OUT):
            self._copy(msg)
        else:
            self._reply(msg.seq, Status.BAD_REQUEST, f"unexpected {msg.kind.name}".encode())

    def _launch(self, msg: Message) -> None:
        st = self.status
        st.bump(Word.RECEIVED)
        fn = self.kernels.get(msg.kid)
        status, payload = Status.OK, b""
        if fn is None:
            status, payload = Status.BAD_REQUEST, f"kernel {msg.kid} was never defined".encode()
        elif isinstance(fn, _LoadFailure):
            status, payload = Status.KERNEL_ERROR, fn.text.encode()
        else:
            st[Word.CURRENT_START_NS] = time.monotonic_ns()
            st[Word.CURRENT_SEQ] = msg.seq
            try:
                args, kwargs = pickle.loads(msg.payload)
                result = fn(self.executor.xp, *self._views(args), **dict(zip(kwargs, self._views(kwargs.values()), strict=True)))
                self.executor.synchronize()
                payload = pickle.dumps(result) if result is not None else b""
            except Exception:
                status, payload = Status.KERNEL_ERROR, traceback.format_exc().encode()
                st.bump(Word.FAILED)
            st[Word.CURRENT_SEQ] = 0
        st.bump(Word.COMPLETED)
        self._reply(msg.seq, status, payload)

    def _views(self, values: Any) -> list[Any]:
        return [self.executor.view(v) if isinstance(v, BufDesc) else v for v in values]

    def _copy(self, msg: Message) -> None:
        self.status.bump(Word.RECEIVED)
        try:
            copy = Copy.decode(msg.payload)
            if msg.kind == Kind.COPY_IN:
                self.executor.copy_in(copy)
            else:
                self.executor.copy_out(copy)
            self.executor.synchronize()
            status, payload = Status.OK, b""
        except Exception as e:
            status, payload = Status.BAD_REQUEST, str(e).encode()
        self.status.bump(Word.COMPLETED)
        self._reply(msg.seq, status, payload)

    def _reply(self, seq: int, status: Status, payload: bytes) -> None:
        if self.guest is None:
            return
        try:
            self.guest.send(Message(Kind.DONE, seq=seq, flags=status, payload=payload[:150_000]).encode())
        except OSError:
            self._drop_guest()
            return
        if self.status[Word.NOTIFY_IDLE] and not self._more_queued():
            os.eventfd_write(self.idle_fd, 1)

    def _more_queued(self) -> bool:
        return self.guest is not None and bool(select_readable(self.guest))


def select_readable(sock: socket.socket) -> bool:
    import select

    return bool(select.select([sock], [], [], 0)[0])


class _LoadFailure:
    def __init__(self, text: str) -> None:
        self.text = text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="gpuvirt-engine")
    p.add_argument("--backend", choices=["emu", "cuda"], required=True)
    p.add_argument("--vf", type=int, required=True)
    p.add_argument("--fb-size", type=int, required=True)
    p.add_argument("--fb-fd", type=int, required=True)
    p.add_argument("--status-fd", type=int, required=True)
    p.add_argument("--ctl-fd", type=int, required=True)
    p.add_argument("--idle-fd", type=int, required=True)
    p.add_argument("--fault-exit", action="store_true", help="test fault: die during start")
    a = p.parse_args(argv)
    # The host's terminal signals are the host's business; it tells us when to exit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if a.fault_exit:
        sys.exit(3)
    status = StatusArea(a.status_fd)
    executor: Executor
    if a.backend == "emu":
        from gpuvirt.device.emu import EmuExecutor

        executor = EmuExecutor(a.fb_fd, a.fb_size)
    else:
        from gpuvirt.device.cuda import CudaExecutor

        executor = CudaExecutor(a.fb_fd, a.fb_size, a.vf)
    status[Word.PID] = os.getpid()
    status[Word.MAGIC] = MAGIC
    status[Word.READY] = 1
    ctl = socket.socket(fileno=a.ctl_fd)
    loop = EngineLoop(executor, status, ctl, a.idle_fd)
    os.kill(os.getpid(), signal.SIGSTOP)  # INIT_GPU done: the host sees this stop
    loop.serve()


if __name__ == "__main__":
    main()
