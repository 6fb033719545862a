"""Ways to wait on a real host: always on something it reports, never a fixed sleep.
And the pieces tests set up the same way: a raw guest, a cooperative engine."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from gpuvirt.device.base import Engine, EngineSpec, WSCommand
from gpuvirt.device.cuda import APERTURE_SIZE, CoopEngine
from gpuvirt.device.sandbox import Sandbox
from gpuvirt.device.sandbox.bwrap import interpreter_paths
from gpuvirt.guest.queue import CommandQueue
from gpuvirt.host.process import HostProcess
from gpuvirt.protocol.mailbox import FRAME_SIZE, Attach, Frame, GuestMsg, HostMsg

MakeHost = Callable[..., HostProcess]
T = TypeVar("T")


def time_order(stamps: Sequence[np.ndarray]) -> np.ndarray:
    """Whose each stamp is, over all of them in time order (stamps[i]: kernel i's
    CLOCK_MONOTONIC stamps), for tests that judge which kernel ran when."""
    t = np.concatenate(stamps)
    who = np.concatenate([np.full(len(s), i) for i, s in enumerate(stamps)])
    return who[np.argsort(t, kind="stable")]


def runs_of(order: np.ndarray) -> np.ndarray:
    """time_order's runs of one kernel's stamps, as that kernel's index each: a world
    switch ends at most one run."""
    return order[np.r_[True, order[1:] != order[:-1]]]


def wait_until(
    cond: Callable[[], T], timeout: float = 30.0, what: str = "the condition", every: float = 0.01
) -> T:
    """Until `cond()` is truthy, which it returns. For what a test can only poll (a
    counter, a status word, /proc, a file the host appends to), checked every `every`
    seconds: the poll's period, never a sleep standing in for the thing awaited."""
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(every)
    return got


def wait_event(
    hp: HostProcess,
    match: Callable[[dict[str, Any]], bool],
    timeout: float = 30.0,
    after: int = 0,
) -> dict[str, Any]:
    """The first event (after seq `after`) that `match` accepts; long-polls the host."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no matching event within {timeout} s")
        events = hp.admin.events(after=after, wait=min(left, 5.0))
        for ev in events:
            if match(ev):
                return ev
            after = ev["seq"]


def wait_state(hp: HostProcess, vf: int, state: str, timeout: float = 30.0) -> None:
    """Until VF `vf` is in `state` (checked now, then on each of its transitions)."""
    after = last_seq(hp)
    if hp.admin.vf(vf)["state"] == state:
        return
    wait_event(
        hp,
        lambda e: e["vf"] == vf and e["kind"] == "transition" and e["data"]["new"] == state,
        timeout,
        after,
    )


def last_seq(hp: HostProcess) -> int:
    events = hp.admin.events(after=0)
    return events[-1]["seq"] if events else 0


def fb_fds(pid: int) -> list[str]:
    """The memfd names a process holds open (its view of device memory)."""
    out = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("/memfd:"):
            out.append(target)
    return out


def _recv_frame(s: socket.socket) -> Frame:
    data = b""
    while len(data) < FRAME_SIZE:
        chunk, anc, _f, _a = s.recvmsg(FRAME_SIZE - len(data), socket.CMSG_SPACE(16))
        for _lvl, _kind, raw in anc:
            for i in range(0, len(raw) - len(raw) % 4, 4):
                os.close(int.from_bytes(raw[i : i + 4], "little"))
        assert chunk, "host closed the connection"
        data += chunk
    return Frame.decode(data)


def hold_fullaccess(hp: HostProcess, vf: int) -> socket.socket:
    """A raw guest that asks for init access and then never releases it."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(str(hp.socket))
    s.sendall(Attach(vf=vf, token=bytes.fromhex(hp.token(vf))).encode())
    assert _recv_frame(s).msg == HostMsg.SUCCESS
    s.sendall(Frame(GuestMsg.REQ_GPU_INIT_ACCESS).encode())
    assert _recv_frame(s).msg == HostMsg.READY_TO_ACCESS_GPU
    return s


def bound_under_tmp() -> list[str]:
    """What an empty /tmp of a sandbox or container holds when the checkout or venv
    lives under /tmp (a CI clone): the mount points of its read-only binds."""
    return sorted({Path(p).parts[2] for p in interpreter_paths() if Path(p).parts[1:2] == ("tmp",)})


def guest_queue(engine: Engine) -> CommandQueue:
    """A guest's command queue to `engine`, over a fresh channel (its previous guest's
    dropped), as the host hands one to an attaching guest."""
    guest, engine_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    engine.attach_guest(engine_end.fileno())
    engine_end.close()
    return CommandQueue(guest)


@contextlib.contextmanager
def coop_engine(
    *,
    backend: str = "emu",
    fb_size: int = 4 << 20,
    init_timeout: float = 30,
    vf: int = 0,
    sandbox: Sandbox | None = None,
) -> Iterator[tuple[CoopEngine, CommandQueue]]:
    """A cooperative engine (device/cuda.py's) started, running, with a guest's queue
    attached; after, the queue closed, the engine killed (and checked gone), then its
    memfd and the sandbox given (which it takes over) closed.

    backend "emu": over an emu FB of `fb_size` bytes, which is how the cooperative
    path runs without a GPU. "cuda": on the GPU, where the memfd is the VF's aperture
    (as the cuda backend's create_fb makes it) and the FB is device memory."""
    with contextlib.ExitStack() as stack:
        if sandbox is not None:
            stack.callback(sandbox.close)
        fd = os.memfd_create(f"test-coop-{backend}", os.MFD_CLOEXEC)
        stack.callback(os.close, fd)
        os.ftruncate(fd, APERTURE_SIZE if backend == "cuda" else fb_size)
        engine = CoopEngine(EngineSpec(vf, fb_size), fd, backend, sandbox=sandbox)
        stack.callback(engine.kill)
        engine.command(WSCommand.INIT_GPU, init_timeout)
        engine.command(WSCommand.RUN_GPU, 10)
        queue = guest_queue(engine)
        stack.callback(queue.close)
        yield engine, queue
    assert not os.path.exists(f"/proc/{engine.pid}")
