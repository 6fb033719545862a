"""The cuda backend's parts that run without a GPU.

- backend selection and the errors without CuPy or without a GPU;
- the cooperative world switch (device/cuda.py CoopEngine + engine.py
  CoopEngineLoop), run for real over an emu FB: the same host-side class and
  engine loop the cuda backend uses, with emu's executor in the engine;
- the staged FB path (guest/staging.py) against a real emu host, whose engine
  copies between the unused head of the FB (its staging area) and buffers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest

from gpuvirt.device import make_device
from gpuvirt.device.base import CommandTimeout, EngineDied, EngineSpec, SwitchLimits, WSCommand
from gpuvirt.device.cuda import (
    APERTURE_SIZE,
    INSTALL_HINT,
    PACKAGE_HINT,
    STAGING_SIZE,
    CoopEngine,
    cupy_installed,
)
from gpuvirt.device.status import Word
from gpuvirt.errors import DeviceError, GpuvirtError, StateError
from gpuvirt.guest.queue import CommandQueue, kernel
from gpuvirt.protocol.command import BufDesc
from gpuvirt.protocol.info import PF2VF_OFFSET, RESERVED_SIZE
from helpers import guest_queue, wait_until

# Kernels defined here run in engine processes that cannot import this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

needs_no_cupy = pytest.mark.skipif(cupy_installed(), reason="CuPy is installed here")
FB_SIZE = 4 << 20
T = 5.0  # generous command timeout where the test is not about timeouts


# ---- selection and errors ------------------------------------------------------------


def test_emu_is_selected_by_name() -> None:
    dev = make_device("emu")
    try:
        assert dev.backend == "emu"
    finally:
        dev.close()


@needs_no_cupy
def test_cuda_without_cupy_says_what_to_install() -> None:
    with pytest.raises(DeviceError) as err:
        make_device("cuda", kernel_scratch=256 << 20)
    msg = str(err.value)
    assert "CuPy" in msg and INSTALL_HINT in msg and "emu" in msg


def test_cuda_with_cupy_hidden_says_what_to_install() -> None:
    # Hide CuPy whether or not it is installed: the check must not import it either.
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "from gpuvirt.device import make_device\n"
        "from gpuvirt.errors import DeviceError\n"
        "try:\n"
        "    make_device('cuda', kernel_scratch=256 << 20)\n"
        "except DeviceError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert INSTALL_HINT in out.stdout, out.stderr


def test_cuda_with_broken_cupy_says_it_does_not_import(tmp_path: Path) -> None:
    # A CuPy that is present but fails to import (a wheel for another CUDA, say): the
    # probe runs in a child interpreter and reports the import error, not a GPU problem.
    pkg = tmp_path / "cupy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('libcudart.so.12: cannot open')\n")
    code = (
        "from gpuvirt.device import make_device\n"
        "from gpuvirt.errors import DeviceError\n"
        "try:\n"
        "    make_device('cuda', kernel_scratch=256 << 20)\n"
        "except DeviceError as e:\n"
        "    print(e)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert "does not import" in out.stdout and "libcudart" in out.stdout, out.stderr


@needs_no_cupy
def test_host_with_cuda_backend_refuses_to_start_without_cupy() -> None:
    from gpuvirt.bench.common import scratch_host

    with pytest.raises(GpuvirtError) as err, scratch_host(device={"backend": "cuda"}):
        pass
    text = " ".join(str(err.value).split())  # the CLI wraps long lines
    assert "exited with 2" in text
    assert 'device.backend = "cuda" needs CuPy' in text and PACKAGE_HINT in text


# ---- the cooperative world switch, over an emu FB ----------------------------------


class Rig:
    """One cooperative engine over a fresh FB memfd, and a guest command queue to it."""

    def __init__(self, backend: str = "emu", fault: bool = False) -> None:
        self.fb = os.memfd_create("test-coop-fb", os.MFD_CLOEXEC)
        os.ftruncate(self.fb, FB_SIZE)
        self.engine = CoopEngine(EngineSpec(0, FB_SIZE), self.fb, backend, fault)
        self.queue: CommandQueue | None = None

    def attach(self) -> CommandQueue:
        self.queue = guest_queue(self.engine)
        return self.queue

    def close(self) -> None:
        self.engine.kill()
        if self.queue is not None:
            self.queue.close()
        os.close(self.fb)


@pytest.fixture
def rig() -> Any:
    r = Rig()
    try:
        yield r
    finally:
        r.close()


def _fill(xp: Any, a: Any, value: float) -> None:
    a[...] = value


def _spin(xp: Any) -> None:
    while True:
        pass


def test_init_is_acknowledged_and_commands_follow_the_order(rig: Rig) -> None:
    e = rig.engine
    e.command(WSCommand.INIT_GPU, 30)
    assert e.status[Word.READY] == 1
    assert e.status[Word.ACK_SERIAL] == e.status[Word.CMD_SERIAL] == 1
    assert e.status[Word.PID] == e.pid
    with pytest.raises(StateError):
        e.command(WSCommand.IDLE_GPU, T)
    for cmd in (WSCommand.RUN_GPU, WSCommand.IDLE_GPU, WSCommand.SAVE_GPU_STATE,
                WSCommand.LOAD_GPU_STATE, WSCommand.RUN_GPU):  # fmt: skip
        e.command(cmd, T)
    assert e.running
    # IDLE and RUN each wrote a serial and were acknowledged; SAVE/LOAD are host-only.
    assert e.status[Word.ACK_SERIAL] == e.status[Word.CMD_SERIAL] == 4


def test_idle_engine_takes_no_guest_work(rig: Rig) -> None:
    e = rig.engine
    e.command(WSCommand.INIT_GPU, 30)
    q = rig.attach()
    desc = BufDesc(RESERVED_SIZE, (16,), "<f4")
    # INIT leaves the engine idle, as emu's stop does: nothing runs before RUN.
    fut = q.launch(kernel(_fill), (desc,), {"value": 3.0})
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.3)
    assert e.status[Word.RECEIVED] == 0
    e.command(WSCommand.RUN_GPU, T)
    assert fut.result(timeout=T) is None
    e.command(WSCommand.IDLE_GPU, T)
    fut = q.launch(kernel(_fill), (desc,), {"value": 4.0})
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.3)
    received = e.status[Word.RECEIVED]
    e.command(WSCommand.SAVE_GPU_STATE, T)
    e.command(WSCommand.LOAD_GPU_STATE, T)
    assert e.status[Word.RECEIVED] == received  # still nothing taken while idle
    e.command(WSCommand.RUN_GPU, T)
    fut.result(timeout=T)
    assert e.status[Word.RECEIVED] == received + 1


def _sleep_then_stamp(xp: Any, a: Any, seconds: float) -> str:
    time.sleep(seconds)
    a[0] = time.monotonic_ns()  # when the kernel ended, on the host's clock
    return "done"


def test_idle_waits_for_the_running_kernel_and_charges_the_vf_until_it_ended(rig: Rig) -> None:
    """A kernel boundary is the only place a cooperative engine can stop: IDLE is
    acknowledged only once the running kernel has ended, and switch_out's until_ns
    (the end of the VF's charged slice) is after that end. It cannot post."""
    e = rig.engine
    e.command(WSCommand.INIT_GPU, 30)
    e.command(WSCommand.RUN_GPU, T)
    q = rig.attach()
    stamp = BufDesc(RESERVED_SIZE, (1,), "<i8")
    fut = q.launch(kernel(_sleep_then_stamp), (stamp,), {"seconds": 0.2})
    wait_until(lambda: e.status[Word.CURRENT_SEQ], T, "the kernel running")
    out = e.switch_out(SwitchLimits(cmd_s=T, coop_idle_s=T), post=True)
    assert e.status[Word.CURRENT_SEQ] == 0
    assert fut.result(timeout=T) == "done"
    ended = int(np.frombuffer(os.pread(rig.fb, 8, RESERVED_SIZE), "<i8")[0])
    assert out.until_ns >= ended
    assert not out.posted and e.last == WSCommand.SAVE_GPU_STATE
    assert set(out.took_ns) == {"IDLE_GPU", "SAVE_GPU_STATE"}
    assert set(e.switch_in(SwitchLimits(T, T))) == {"LOAD_GPU_STATE", "RUN_GPU"}
    assert e.running


def test_a_kernel_that_never_ends_is_a_command_timeout(rig: Rig) -> None:
    e = rig.engine
    e.command(WSCommand.INIT_GPU, 30)
    e.command(WSCommand.RUN_GPU, T)
    q = rig.attach()
    fut = q.launch(kernel(_spin), (), {})
    wait_until(lambda: e.status[Word.CURRENT_SEQ], T, "the kernel running")
    t0 = time.monotonic()
    with pytest.raises(CommandTimeout, match="did not acknowledge IDLE_GPU within 300 ms"):
        e.command(WSCommand.IDLE_GPU, 0.3)
    assert time.monotonic() - t0 >= 0.3  # it waited its whole limit, as asked
    # The next attempt is refused at once, without waiting (an hour here, which the
    # test's timeout would end): the engine is still in the same kernel.
    with pytest.raises(CommandTimeout, match="still not acknowledged IDLE_GPU"):
        e.command(WSCommand.IDLE_GPU, 3600)
    assert e.alive()
    e.kill()
    assert not e.alive()
    q.fail_all(GpuvirtError("test over"))
    with pytest.raises(GpuvirtError):
        fut.result(timeout=1)


def test_engine_killed_while_idling_is_engine_died(rig: Rig) -> None:
    e = rig.engine
    e.command(WSCommand.INIT_GPU, 30)
    e.command(WSCommand.RUN_GPU, T)
    os.kill(e.pid, signal.SIGKILL)
    # Seen on the pidfd: with an hour's limit, only the exit can end the wait.
    with pytest.raises(EngineDied, match=r"is gone|exited"):
        e.command(WSCommand.IDLE_GPU, 3600)


def test_engine_that_dies_during_start_fails_init() -> None:
    r = Rig(fault=True)
    try:
        with pytest.raises(EngineDied, match="exited during INIT_GPU"):
            r.engine.command(WSCommand.INIT_GPU, 3600)  # the exit ends it, not the limit
    finally:
        r.close()


@needs_no_cupy
def test_cuda_engine_without_cupy_reports_why_it_did_not_start() -> None:
    # The engine process itself imports CuPy; its failure reaches the host as text.
    r = Rig(backend="cuda")
    try:
        with pytest.raises(EngineDied, match="cupy"):
            r.engine.command(WSCommand.INIT_GPU, 30)
        assert r.engine.failure is not None and "cupy" in r.engine.failure
    finally:
        r.close()


# ---- the staged FB path against a real emu host ------------------------------------


@pytest.fixture(scope="module")
def emu_gpu() -> Any:
    import gpuvirt
    from gpuvirt.bench.common import scratch_host

    with (
        scratch_host(sriov={"vf_num": 1}) as hp,
        gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as gpu,
    ):
        yield gpu


def _staged(gpu: Any, chunk: int | None = None) -> Any:
    from gpuvirt.guest.staging import StagedFB, StagingArea

    # emu's staging area: the unused first 64 KiB of the FB's reserved head.
    return StagedFB(StagingArea(gpu._mem, 0, PF2VF_OFFSET), gpu._queue, gpu.fb_size, chunk)


@pytest.mark.parametrize("chunk", [None, 4096])
@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, 5 * 4096 + 7, 3 << 20])
def test_staged_write_and_read_match_the_fb(emu_gpu: Any, nbytes: int, chunk: int | None) -> None:
    fb = _staged(emu_gpu, chunk)
    try:
        buf = emu_gpu.alloc(nbytes, np.uint8)
        data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
        fb.write(buf.offset, data)
        assert np.array_equal(buf.view(), data)  # the FB itself, mapped
        out = np.zeros(nbytes, np.uint8)
        buf.view()[:] = data[::-1]
        fb.read(buf.offset, out)
        assert np.array_equal(out, data[::-1])
        buf.free()
    finally:
        fb.close()


def test_staged_copy_outside_the_fb_fails_and_the_path_still_works(emu_gpu: Any) -> None:
    fb = _staged(emu_gpu, 4096)
    try:
        with pytest.raises(GpuvirtError, match="outside"):
            fb.write(emu_gpu.fb_size - 100, np.zeros(5000, np.uint8))
        buf = emu_gpu.alloc(10_000, np.uint8)
        data = np.arange(10_000, dtype=np.uint16).astype(np.uint8)
        fb.write(buf.offset, data)
        out = np.empty_like(data)
        fb.read(buf.offset, out)
        assert np.array_equal(out, data)
        with pytest.raises(GpuvirtError, match="mapped"):
            fb.view(buf.offset, 16)
        buf.free()
    finally:
        fb.close()


def test_staged_upload_lands_a_socket_stream_in_the_fb(emu_gpu: Any) -> None:
    import threading

    from gpuvirt.guest.staging import StagedUpload, StagingArea

    staging = StagingArea(emu_gpu._mem, 0, PF2VF_OFFSET)
    up = StagedUpload(staging, emu_gpu._queue, chunk=8192, nchunks=4)
    data = np.random.default_rng(7).integers(0, 256, 300_001, dtype=np.uint8)
    buf = emu_gpu.alloc(data.size, np.uint8)
    rx, tx = socket.socketpair()
    sender = threading.Thread(target=lambda: (tx.sendall(data.tobytes()), tx.close()))
    sender.start()
    pos = 0
    most_in_flight = 0
    try:
        while True:
            chunk = up.acquire()
            n = rx.recv_into(chunk.array)
            if not n:
                up.give_back(chunk)
                break
            up.commit(chunk, buf.offset + pos, n)
            most_in_flight = max(most_in_flight, up.in_flight)
            pos += n
        up.drain()
    finally:
        sender.join(10)
        rx.close()
        up.close()
    assert pos == data.size
    assert np.array_equal(buf.view(), data)
    assert 1 < most_in_flight <= 4  # copies overlapped the receive, never beyond the ring
    assert staging.free_bytes == PF2VF_OFFSET  # every chunk went back


def test_cuda_staging_provider_lands_a_stream_and_tracks_completion(emu_gpu: Any) -> None:
    import threading

    from gpuvirt.netgpu.providers.cuda_staging import CudaStagingProvider, DeviceRange

    # On emu the guest maps its FB, so the provider declines, and says why.
    assert "mapped" in (CudaStagingProvider.probe(emu_gpu) or "")
    fb = _staged(emu_gpu, 4096)
    staging = fb.staging
    p = CudaStagingProvider()
    p.attach(fb, max_chunk=8192)
    data = np.random.default_rng(3).integers(0, 256, 250_000, dtype=np.uint8)
    buf = emu_gpu.alloc(data.size + 4, np.uint8)
    rx, tx = socket.socketpair()
    sender = threading.Thread(target=lambda: (tx.sendall(data.tobytes()), tx.close()))
    sender.start()
    recv = p.reader(rx)
    pos = 0
    try:
        while True:
            n = recv(DeviceRange(buf.offset + 4 + pos, data.size - pos))
            if not n:
                break
            # what the read brought in, still in staging (the crc32's input)
            assert bytes(p.received()) == data[pos : pos + n].tobytes()
            assert p.copies.completed() <= p.copies.committed
            pos += n
        p.write_at(buf.offset, b"NGPU")
        p.flush()
        assert p.copies.completed() == p.copies.committed
    finally:
        sender.join(10)
        rx.close()
        p.detach()
    assert pos == data.size
    assert bytes(buf.view()[:4]) == b"NGPU"
    assert np.array_equal(buf.view()[4:], data)
    assert staging.free_bytes == PF2VF_OFFSET - 2 * 4096  # all but StagedFB's own window
    fb.close()


def test_cuda_staging_reads_cycle_one_batch_and_one_chunk_of_staging(emu_gpu: Any) -> None:
    """A staged pool's reads land in RING_CHUNKS staging chunks however much staging is
    free: one batch of copies and the chunk filled beside it. A receive's CPU grows with
    the chunks its socket copy is spread over (docs/netgpu-staged-log.md, "A seventh
    look"), and a ring of two batches spread it over 8."""
    import threading

    from gpuvirt.netgpu.providers.cuda_staging import (
        BATCH_CHUNKS,
        RING_CHUNKS,
        CudaStagingProvider,
        DeviceRange,
    )

    fb = _staged(emu_gpu, 4096)
    assert fb.staging.free_bytes >= 2 * RING_CHUNKS * 4096  # room for a larger ring
    p = CudaStagingProvider()
    p.attach(fb, max_chunk=4096)
    data = np.random.default_rng(5).integers(0, 256, 64 * 4096, dtype=np.uint8)
    buf = emu_gpu.alloc(data.size, np.uint8)
    rx, tx = socket.socketpair()
    sender = threading.Thread(target=lambda: (tx.sendall(data.tobytes()), tx.close()))
    sender.start()
    recv = p.reader(rx)
    landed_in: set[int] = set()  # staging addresses the reads went to
    pos = 0
    try:
        while n := recv(DeviceRange(buf.offset + pos, data.size - pos)):
            landed_in.add(p.received().ctypes.data)
            pos += n
        p.flush()
        assert p.copies.batch == BATCH_CHUNKS
    finally:
        sender.join(10)
        rx.close()
        p.detach()
        fb.close()
    assert len(landed_in) == RING_CHUNKS == BATCH_CHUNKS + 1
    assert np.array_equal(buf.view(), data)


def test_staged_upload_batches_its_copies_and_says_what_landed(emu_gpu: Any) -> None:
    """One COPY_IN per `batch` chunks (one reply, one future), sent when full or when
    waited for; `landed` never sends or waits."""
    from gpuvirt.guest.staging import StagedUpload, StagingArea

    staging = StagingArea(emu_gpu._mem, 0, PF2VF_OFFSET)
    up = StagedUpload(staging, emu_gpu._queue, chunk=4096, nchunks=8, batch=4)
    buf = emu_gpu.alloc(7 * 4096, np.uint8)
    pending_before = len(emu_gpu._queue.pending)
    try:
        for i in range(7):
            chunk = up.acquire()
            chunk.array[:] = i + 1
            assert up.commit(chunk, buf.offset + i * 4096, 4096) == i + 1
        assert len(emu_gpu._queue.pending) - pending_before <= 1  # 4 chunks, one message
        assert not up.landed(7)  # the last 3 are not even sent yet
        up.wait(7)
        assert up.landed(7) and up.completed() == 7 and up.in_flight == 0
    finally:
        up.close()
    assert np.array_equal(buf.view(), np.repeat(np.arange(1, 8, dtype=np.uint8), 4096))
    buf.free()


def test_staged_receive_gives_its_chunk_back_when_nothing_came(emu_gpu: Any) -> None:
    """A read that finds no data (BlockingIOError) or the stream's end (0) commits
    nothing and keeps no staging chunk: more such reads than the ring has chunks still
    leave every chunk to take, and a read that does get bytes lands them."""
    from gpuvirt.guest.staging import StagedUpload, StagingArea

    staging = StagingArea(emu_gpu._mem, 0, PF2VF_OFFSET)
    up = StagedUpload(staging, emu_gpu._queue, chunk=4096, nchunks=2, batch=1)
    buf = emu_gpu.alloc(4096, np.uint8)
    rx, tx = socket.socketpair()
    rx.setblocking(False)
    try:
        for _ in range(5):
            with pytest.raises(BlockingIOError):
                up.receive(rx.recv_into, buf.offset, 4096, 0)
        tx.sendall(b"x" * 100)
        assert up.receive(rx.recv_into, buf.offset, 4096, 0) == 100
        assert bytes(up.last_read()) == b"x" * 100
        tx.close()
        for _ in range(5):
            assert up.receive(rx.recv_into, buf.offset + 100, 4096, 0) == 0
        assert up.committed == 1
        up.wait(1)
        held = [up.acquire(), up.acquire()]  # both chunks free again
        for chunk in held:
            up.give_back(chunk)
    finally:
        rx.close()
        up.close()
    assert bytes(buf.view()[:100]) == b"x" * 100
    buf.free()


def test_staged_upload_landed_asks_no_channel(emu_gpu: Any) -> None:
    """`landed` answers from the replies already taken (a receiver asks it once per read:
    a look at the channel would be a system call per read); the batch's reply, waiting
    in the channel, is taken by `completed` (or acquire, or wait)."""
    import select

    from gpuvirt.guest.staging import StagedUpload, StagingArea

    staging = StagingArea(emu_gpu._mem, 0, PF2VF_OFFSET)
    up = StagedUpload(staging, emu_gpu._queue, chunk=4096, nchunks=8, batch=4)
    buf = emu_gpu.alloc(4 * 4096, np.uint8)
    try:
        for i in range(4):  # a full batch: sent
            chunk = up.acquire()
            chunk.array[:] = i + 1
            up.commit(chunk, buf.offset + i * 4096, 4096)
        # the engine's reply is in the channel, unread
        assert select.select([emu_gpu._queue.channel], [], [], 10)[0]
        assert not up.landed(4)
        assert up.completed() == 4 and up.landed(4)
    finally:
        up.close()
    assert np.array_equal(buf.view(), np.repeat(np.arange(1, 5, dtype=np.uint8), 4096))
    buf.free()


def test_add_staging_gives_an_emu_vf_the_staged_receive_and_every_byte_lands() -> None:
    """The cuda path on emu through the public guest interface (bench netgpu's staged rows):
    a raw and a framed stream several times the staging ring, every fragment read back
    from the FB and the whole compared with what was sent; the last fragments, still
    settling when the stream ends, are delivered too."""
    import hashlib
    import threading

    import gpuvirt
    from gpuvirt.bench.common import scratch_host
    from gpuvirt.protocol.frames import Header

    data = np.random.default_rng(5).bytes(12 << 20)
    with (
        scratch_host(sriov={"vf_num": 1}) as hp,
        gpuvirt.attach(vf=0, socket=hp.socket, token=hp.token(0)) as gpu,
    ):
        assert gpu.staging() is None
        gpu.add_staging(4 << 20)
        assert gpu.netgpu.selection("cuda-staging").provider.name == "cuda-staging"
        with gpu.netgpu.pool(nbytes=8 << 20, chunk=256 << 10, provider="cuda-staging") as pool:
            for framed in (False, True):
                msgs = [data[i : i + (1 << 18)] for i in range(0, len(data), 1 << 18)]
                wire = (
                    b"".join(Header(0, i, len(m)).encode() + m for i, m in enumerate(msgs))
                    if framed
                    else data
                )
                rx_sock, tx = socket.socketpair()
                sender = threading.Thread(
                    target=lambda tx=tx, wire=wire: (tx.sendall(wire), tx.close())
                )
                sender.start()
                h, total = hashlib.sha256(), 0
                try:
                    for frag in pool.receive(rx_sock, framed=framed, timeout=30):
                        h.update(gpu.host_view(frag.offset, frag.size))
                        total += frag.size
                        pool.release([frag.token])
                finally:
                    sender.join(10)
                assert total == len(data)
                assert h.hexdigest() == hashlib.sha256(data).hexdigest()


def test_aperture_layout() -> None:
    assert APERTURE_SIZE == RESERVED_SIZE + STAGING_SIZE
    assert RESERVED_SIZE % 4096 == 0 and STAGING_SIZE % (2 << 20) == 0


# ---- NetGPU's cuda-staging provider: registered, and wired into pools -----------------


def test_cuda_staging_is_registered_and_says_why_not_on_emu(emu_gpu: Any) -> None:
    from gpuvirt.netgpu.errors import NetGPUError
    from gpuvirt.netgpu.providers import ORDER, PROVIDERS, CudaStagingProvider

    assert PROVIDERS["cuda-staging"] is CudaStagingProvider
    assert ORDER.index("cuda-staging") < ORDER.index("userspace")
    sel = emu_gpu.netgpu.selection()
    assert sel.provider.name == "userspace"
    assert "CuPy" in sel.skipped["cuda-staging"]
    with pytest.raises(NetGPUError, match=r"'cuda-staging' cannot serve VF0: .*CuPy"):
        emu_gpu.netgpu.selection("cuda-staging")


@pytest.fixture
def staged_pool(emu_gpu: Any) -> Any:
    """A pool on the cuda path for real: the guest's FB is staged (copies by the engine),
    and the pool is served by cuda-staging; the emu FB's mapping shows what landed."""
    from gpuvirt.netgpu.pool import Pool
    from gpuvirt.netgpu.providers import CudaStagingProvider

    mapped, emu_gpu._fb = emu_gpu._fb, _staged(emu_gpu, 4096)
    pool = Pool(emu_gpu.netgpu, 16 * 16384, 16384, CudaStagingProvider())
    try:
        yield pool, mapped
    finally:
        pool.close()
        emu_gpu._fb.close()
        emu_gpu._fb = mapped


def _send(data: bytes) -> tuple[socket.socket, Any]:
    import threading

    rx, tx = socket.socketpair()
    sender = threading.Thread(target=lambda: (tx.sendall(data), tx.close()))
    sender.start()
    return rx, sender


@pytest.mark.parametrize("framed", [False, True, None])
def test_staged_pool_lands_streams_in_device_memory(staged_pool: Any, framed: Any) -> None:
    import zlib

    from gpuvirt.netgpu.errors import NetGPUError
    from gpuvirt.protocol.frames import FLAG_CRC, Header

    pool, mapped = staged_pool
    assert pool.memory is None  # nothing of the pool is mapped: reads go through staging
    payloads = [np.random.default_rng(i).bytes(n) for i, n in enumerate((70_000, 1, 20_000))]
    if framed is False:
        wire = b"".join(payloads)
    else:
        wire = b"".join(
            Header(1, i, len(p), FLAG_CRC, zlib.crc32(p)).encode() + p
            for i, p in enumerate(payloads)
        )
    sock, sender = _send(wire)
    got: list[bytes] = []
    try:
        for frag in pool.receive(sock, framed=framed, crc=None if framed is False else True):
            # handed out only once in device memory: the FB itself already holds it
            landed = bytes(mapped.view(frag.offset, frag.size))
            assert frag.buffer().read().tobytes() == landed
            with pytest.raises(NetGPUError, match="cannot map"):
                frag.array()
            got.append(landed)
            pool.release([frag.token])
    finally:
        sender.join(10)
    assert b"".join(got) == b"".join(payloads)


def test_staged_pool_catches_a_corrupted_message(staged_pool: Any) -> None:
    import zlib

    from gpuvirt.netgpu.errors import RxError
    from gpuvirt.protocol.frames import FLAG_CRC, Header

    pool, _ = staged_pool
    payload = bytes(range(256)) * 100
    sock, sender = _send(
        Header(1, 0, len(payload), FLAG_CRC, zlib.crc32(payload) ^ 1).encode() + payload
    )
    try:
        with pytest.raises(RxError, match="corrupted in transit"):
            for frag in pool.receive(sock, framed=True):
                pool.release([frag.token])
    finally:
        sender.join(10)
