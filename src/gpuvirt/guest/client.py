"""The guest library (VF driver): attach to a VF, allocate, launch, survive resets.

    with gpuvirt.attach(vf=1, token=...) as gpu:
        x = gpu.alloc((1024,), np.float32)
        gpu.launch(scale, x, factor=2.0).result(timeout=5)

A mailbox thread owns the host connection: it answers QUERY_ALIVE, and on
FLR_NOTIFICATION fails pending launches (VFResetError), answers
READY_TO_RESET, waits for FLR_NOTIFICATION_COMPLETION and initializes the VF
again on its own; old buffers then raise BufferLostError and `on_reset` is
called. Replies to the caller's own requests are passed to it through a queue.
"""

from __future__ import annotations

import array
import contextlib
import mmap
import os
import queue as queue_mod
import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from gpuvirt.errors import (
    AuthRefusedError,
    DetachedError,
    GpuvirtError,
    VFResetError,
)
from gpuvirt.guest.extension import NetExtension, make_netgpu
from gpuvirt.guest.handshake import attach_socket, attach_target, reason_text
from gpuvirt.guest.memory import Allocator, Buffer, MappedFB
from gpuvirt.guest.queue import CommandQueue, Kernel, LaunchFuture, kernel
from gpuvirt.guest.staging import StagedFB, StagingArea
from gpuvirt.poll import POLL_ENV, poll_limit_ns
from gpuvirt.protocol.errors import ProtocolError
from gpuvirt.protocol.info import (
    BLOCK_SIZE,
    FEATURE_FB_MAPPED,
    FEATURE_STAGING,
    PF2VF,
    PF2VF_OFFSET,
    VF2PF,
    VF2PF_OFFSET,
)
from gpuvirt.protocol.mailbox import (
    FRAME_SIZE,
    Frame,
    GuestMsg,
    HostMsg,
    alive_reply,
)

__all__ = ["Gpu", "attach", "kernel"]

DRIVER_VERSION = "gpuvirt-guest 0.1.0"
REPLY_TIMEOUT_S = 15.0  # a reply that may wait for the schedule
FLR_TIMEOUT_S = 10.0  # FLR completion


class Gpu:
    """One attached VF."""

    def __init__(
        self, vf: int, sock: socket.socket, on_reset: Callable[[Gpu], None] | None, poll_ns: int
    ) -> None:
        self.vf = vf
        self._poll_ns = poll_ns
        self._sock = sock
        self.on_reset = on_reset
        self.generation = 0
        self.closed = False
        self.resets = 0
        self.info: PF2VF | None = None
        self._replies: queue_mod.Queue[tuple[Frame, list[int]]] = queue_mod.Queue()
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()  # the mailbox thread and the caller both tear down
        self._ready = threading.Event()  # set while the VF is usable
        self._reset_done = threading.Event()
        self._reset_error: GpuvirtError | None = None
        self._mem: mmap.mmap | None = None
        self._fb: Any = None
        self._queue: CommandQueue | None = None
        self._allocator: Allocator | None = None
        self._key = 0
        self._netgpu: NetExtension | None = None
        self._staged: StagedFB | None = None  # add_staging's, on a VF whose FB is mapped
        self._stop = threading.Event()
        self._mbox = threading.Thread(
            target=self._mailbox, name=f"gpuvirt-vf{vf}-mbox", daemon=True
        )
        self._mbox.start()
        self._vf2pf_thread = threading.Thread(target=self._vf2pf_loop, daemon=True)

    # ---- public API ------------------------------------------------------------------

    def alloc(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> Buffer:
        self._check_attached()
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"shape {shape}: dimensions must be ≥ 0")
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise ValueError(f"dtype {dt}: object arrays cannot live in device memory")
        nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dt.itemsize)
        assert self._allocator is not None
        return Buffer(self, self._allocator.alloc(nbytes), shape, dt)

    def launch(self, k: Kernel | Callable[..., Any], *args: Any, **kwargs: Any) -> LaunchFuture:
        self._check_attached()
        k = kernel(k)
        if args:
            args = tuple(a.desc if isinstance(a, Buffer) else a for a in args)
        if kwargs:
            kwargs = {n: (v.desc if isinstance(v, Buffer) else v) for n, v in kwargs.items()}
        assert self._queue is not None
        return self._queue.launch(k, args, kwargs)

    def synchronize(self, timeout: float | None = None) -> None:
        self._check_attached()
        assert self._queue is not None
        self._queue.synchronize(timeout)

    @property
    def fb_size(self) -> int:
        return self.info.fb_size if self.info else 0

    @property
    def fb_used(self) -> int:
        return self._allocator.used if self._allocator else 0

    @property
    def launches_completed(self) -> int:
        return self._queue.completed if self._queue else 0

    @property
    def netgpu(self) -> Any:
        if self._netgpu is None:
            self._netgpu = make_netgpu(self)
        return self._netgpu

    # ---- for libraries built on this one (NetGPU; docs/netgpu.md, "The guest interface") ---

    def check_attached(self) -> None:
        """Raise DetachedError, or VFResetError while a reset runs, unless the VF is usable."""
        self._check_attached()

    def alloc_range(self, nbytes: int) -> int:
        """nbytes of the FB (256-byte aligned) that the caller manages; its FB offset.
        Hand it back with `free_range` (a reset or detach takes it along)."""
        self._check_attached()
        assert self._allocator is not None
        return self._allocator.alloc(nbytes)

    def free_range(self, offset: int, generation: int) -> None:
        """Give back an `alloc_range` range taken in `generation`; nothing to give back
        once the VF has been reset or detached since (its FB started over)."""
        if generation == self.generation and not self.closed and self._allocator is not None:
            self._allocator.free(offset)

    def host_view(self, offset: int, nbytes: int) -> np.ndarray | None:
        """FB bytes [offset, offset + nbytes) as mapped into this process (emu: the memory
        itself, uint8), or None where the FB is device memory (cuda: see `staging`)."""
        self._check_attached()
        fb = self._fb
        return fb.view(offset, nbytes) if isinstance(fb, MappedFB) else None

    def staging(self) -> StagedFB | None:
        """The staging path into the FB (its `upload` ring, its staging area's free bytes):
        the FB access of a cuda VF; on emu only after `add_staging`, else None."""
        self._check_attached()
        return self._fb if isinstance(self._fb, StagedFB) else self._staged

    def add_staging(self, nbytes: int) -> StagedFB:
        """Give a VF whose FB is mapped (emu) the staging path a cuda VF has, its staging
        area being `nbytes` of the FB itself, so that path is tested and measured without a
        GPU (`bench netgpu`'s staged rows). Buffers keep using the mapping. Until a reset."""
        self._check_attached()
        if self.staging() is not None:
            raise GpuvirtError(f"VF{self.vf} already has a staging path")
        assert self._mem is not None and self._queue is not None
        offset = self.alloc_range(nbytes)
        area = StagingArea(self._mem, offset, nbytes)
        self._staged = StagedFB(area, self._queue, self.fb_size)
        return self._staged

    def wait_ready(self, timeout: float = FLR_TIMEOUT_S) -> None:
        """Block until the VF is usable again after a reset."""
        if not self._ready.wait(timeout):
            raise VFResetError(f"VF{self.vf} did not come back from reset within {timeout} s")
        self._check_attached()

    def request_reset(self) -> None:
        """Ask the host for an FLR of this VF (REQ_GPU_RESET_ACCESS)."""
        self._send(Frame(GuestMsg.REQ_GPU_RESET_ACCESS))

    def close(self) -> None:
        """Fini: hand the VF back; the host scrubs its FB."""
        if self.closed:
            return
        try:
            if self._ready.is_set():
                self._request(Frame(GuestMsg.REQ_GPU_FINI_ACCESS), HostMsg.READY_TO_ACCESS_GPU)
                self._request(Frame(GuestMsg.REL_GPU_FINI_ACCESS), HostMsg.SUCCESS)
        except GpuvirtError:
            pass  # the host treats the closed connection as the fini
        finally:
            self._teardown(DetachedError(f"VF{self.vf} was detached by this process"))

    def __enter__(self) -> Gpu:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------

    def _check_attached(self) -> None:
        if self.closed:
            raise DetachedError(f"VF{self.vf} is detached; call gpuvirt.attach() again")
        if not self._ready.is_set():
            if self._reset_error is not None:
                raise self._reset_error
            raise VFResetError(
                f"VF{self.vf} is being reset; its work and buffers are lost. "
                "gpu.wait_ready() blocks until it is back"
            )

    def _send(self, frame: Frame) -> None:
        with self._send_lock:
            try:
                self._sock.sendall(frame.encode())
            except OSError as e:
                raise DetachedError(f"lost the host connection: {e}") from None

    def _request(
        self, frame: Frame, want: HostMsg, timeout: float = REPLY_TIMEOUT_S
    ) -> tuple[Frame, list[int]]:
        self._send(frame)
        try:
            reply, fds = self._replies.get(timeout=timeout)
        except queue_mod.Empty:
            raise DetachedError(
                f"host sent no reply to {GuestMsg(frame.msg).name} within {timeout} s"
            ) from None
        if reply.msg == HostMsg.FAIL and want != HostMsg.FAIL:
            for fd in fds:
                os.close(fd)
            raise AuthRefusedError(
                f"VF{self.vf}: {GuestMsg(frame.msg).name} refused: {reason_text(reply)}"
            )
        if reply.msg != want:
            for fd in fds:
                os.close(fd)
            raise DetachedError(f"expected {want.name}, host sent message {reply.msg}")
        return reply, fds

    def _init(self) -> None:
        """The init sequence: INIT_DATA, INIT_ACCESS (+ fds), set up, REL_INIT_ACCESS."""
        self._request(Frame(GuestMsg.REQ_GPU_INIT_DATA), HostMsg.GPU_INIT_DATA_READY)
        reply, fds = self._request(Frame(GuestMsg.REQ_GPU_INIT_ACCESS), HostMsg.READY_TO_ACCESS_GPU)
        try:
            if len(fds) < 2:
                raise DetachedError(f"host sent {len(fds)} descriptors, expected 2")
            aperture, channel = fds[0], fds[-1]
            self._key = reply.dw2
            size = os.fstat(aperture).st_size
            self._mem = mmap.mmap(aperture, size, mmap.MAP_SHARED)
            try:
                info = PF2VF.decode(
                    bytes(self._mem[PF2VF_OFFSET : PF2VF_OFFSET + BLOCK_SIZE]), self._key
                )
            except ProtocolError as e:
                raise DetachedError(f"PF2VF block is bad ({e}); refusing to start") from None
            if not info.feature_flags & (FEATURE_FB_MAPPED | FEATURE_STAGING):
                raise GpuvirtError(
                    f"PF2VF feature flags 0x{info.feature_flags:x} offer neither a mapped FB "
                    "nor a staging area; this guest library cannot reach the VF's memory"
                )
            self.info = info
            self._allocator = Allocator.for_fb(info.fb_size)
            self._queue = CommandQueue(
                socket.socket(fileno=channel), self._poll_ns, told_by_mailbox=True
            )
            if info.feature_flags & FEATURE_FB_MAPPED:
                self._fb = MappedFB(self._mem, info.fb_size)
            else:  # the FB is device memory (cuda): data goes through the staging area
                self._fb = StagedFB(StagingArea.of_aperture(self._mem), self._queue, info.fb_size)
            fds = [fd for fd in fds if fd != channel]
        finally:
            for fd in fds:
                os.close(fd)
        self._write_vf2pf()
        self._request(Frame(GuestMsg.REL_GPU_INIT_ACCESS), HostMsg.SUCCESS)
        self._ready.set()
        if not self._vf2pf_thread.is_alive():
            self._vf2pf_thread.start()

    def _write_vf2pf(self) -> None:
        if self._mem is None:
            return
        block = VF2PF(
            driver_version=DRIVER_VERSION,
            pid=os.getpid(),
            fb_used=self.fb_used,
            launches_completed=self.launches_completed,
            netgpu_rx_bytes=self._netgpu.rx_bytes if self._netgpu is not None else 0,
        ).encode(self._key)
        self._mem[VF2PF_OFFSET : VF2PF_OFFSET + BLOCK_SIZE] = block

    def _vf2pf_loop(self) -> None:
        while not self._stop.wait(self.info.vf2pf_interval_ms / 1000 if self.info else 2.0):
            if self._ready.is_set():
                with contextlib.suppress(ValueError, TypeError):
                    self._write_vf2pf()

    def _drop_vf(self, exc: GpuvirtError) -> None:
        """Forget the VF's resources: pending work fails with exc, buffers go stale."""
        if self._netgpu is not None:
            self._netgpu.vf_lost()  # a receiver parked in recv must not land in the old FB
        with self._state_lock:
            self._ready.clear()
            self.generation += 1
            queue, self._queue = self._queue, None
            fb, self._fb = self._fb, None
            staged, self._staged = self._staged, None
            mem, self._mem = self._mem, None
        if queue is not None:
            queue.fail_all(exc)
            queue.close()
        for f in (fb, staged):
            if f is not None:
                f.close()
        if mem is not None:
            with contextlib.suppress(BufferError):
                mem.close()

    def _mailbox(self) -> None:
        while not self._stop.is_set():
            try:
                data, fds = _recv_frame(self._sock)
            except OSError:
                data, fds = b"", []
            if len(data) < FRAME_SIZE:
                if not self.closed:
                    self._reset_error = DetachedError(
                        f"VF{self.vf}: the host closed the connection"
                    )
                    self._drop_vf(self._reset_error)
                    self._replies.put((Frame(HostMsg.FAIL, 0), []))
                return
            frame = Frame.decode(data)
            if frame.msg == HostMsg.QUERY_ALIVE:
                with contextlib.suppress(GpuvirtError):
                    self._send(alive_reply(frame.dw1))
            elif frame.msg == HostMsg.FLR_NOTIFICATION:
                self._on_flr()
            elif frame.msg == HostMsg.FLR_NOTIFICATION_COMPLETION:
                threading.Thread(target=self._reinit, daemon=True).start()
            else:
                self._replies.put((frame, fds))

    def _on_flr(self) -> None:
        self.resets += 1
        self._drop_vf(VFResetError(f"VF{self.vf} was reset (FLR); its pending work was lost"))
        with contextlib.suppress(GpuvirtError):
            self._send(Frame(GuestMsg.READY_TO_RESET))

    def _reinit(self) -> None:
        try:
            self._init()
            self._reset_error = None
        except GpuvirtError as e:
            self._reset_error = e
            return
        if self.on_reset is not None:
            self.on_reset(self)

    def _teardown(self, exc: GpuvirtError) -> None:
        self.closed = True
        self._stop.set()
        self._drop_vf(exc)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def _recv_frame(sock: socket.socket) -> tuple[bytes, list[int]]:
    fds = array.array("i")
    data = b""
    got: list[int] = []
    while len(data) < FRAME_SIZE:
        chunk, anc, _flags, _addr = sock.recvmsg(
            FRAME_SIZE - len(data), socket.CMSG_SPACE(8 * fds.itemsize)
        )
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(raw[: len(raw) - len(raw) % a.itemsize])
                got.extend(a)
        if not chunk:
            break
        data += chunk
    return data, got


def attach(
    vf: int | None = None,
    socket: str | os.PathLike[str] | None = None,
    token: str | bytes | None = None,
    *,
    on_reset: Callable[[Gpu], None] | None = None,
    timeout: float = REPLY_TIMEOUT_S,
) -> Gpu:
    """Attach to a VF. Defaults come from GPUVIRT_VF, GPUVIRT_SOCKET, and GPUVIRT_TOKEN or
    else GPUVIRT_TOKEN_FILE (a file holding the token, as a Kubernetes device plugin mounts it).
    GPUVIRT_POLL_US bounds how long a wait for a result polls before it sleeps (0: never)."""

    path, vf, raw = attach_target(vf, socket, token)
    poll_ns = poll_limit_ns(os.environ.get(POLL_ENV))
    sock = attach_socket(path, vf, raw, timeout)  # the host's SUCCESS to ATTACH read
    gpu = Gpu(vf, sock, on_reset, poll_ns)
    try:
        gpu._init()
    except BaseException:
        gpu._teardown(DetachedError(f"attach to VF{vf} failed"))
        raise
    return gpu
