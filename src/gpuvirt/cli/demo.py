"""`gpuvirt demo`: every part of gpuvirt in one run on the emulated GPU.

A scratch host with N VFs (weights 1..N, policy `weighted`) and one guest
process per VF, each doing matrix products in its VF and checking every
result on its own side (Freivalds' check: C·r = A·(B·(A·r)) for a random r,
O(n²) against the kernel's O(n³)). One guest ingests a NetGPU stream and
checks its sha256 against the sender's; one guest launches a kernel that
never returns, which the host catches (job_timeout), resets (FLR) and hands
back while the others keep working; that guest re-initializes and goes on.
`gpuvirt top`'s view is on screen meanwhile; at the end a summary says what
was verified, and the exit status says whether everything was.

The guests are real processes (`python -c` running `guest_main` below) that
report to this one as JSON lines on stdout and take orders ("hang", "stop")
on stdin; their stdin closing (this process gone) stops them too, so none
outlives the demo.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json as json_mod
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gpuvirt.cli import events as events_cli
from gpuvirt.cli import top as top_cli
from gpuvirt.cli.common import fail
from gpuvirt.cli.main import app
from gpuvirt.errors import GpuvirtError

# ---- knobs (the demo's own, not the host's: the host's defaults live in config.py) ----------

JOB_TIMEOUT_S = 1.0  # short, so the hang is caught within seconds at any weight
MATRIX_N = 384  # one launch is two n×n float64 products: a few ms, under one 6 ms slice
DEPTH = 3  # launches in flight per guest: the VF always has work queued
REFRESH_S = 0.5  # live view refresh
PLAIN_FRAME_S = 5.0  # without a terminal, a frame this often (a log, not an animation)
HANG_AT = 0.25  # fraction of the duration after which the hang is started
ATTACH_TIMEOUT_S = 90.0
HANG_TIMEOUT_S = 60.0  # the hang must be caught and recovered from within this
NETGPU_RATE = 32 << 20  # bytes/s the sender paces the stream at, so it spans the run
NETGPU_POOL = 32 << 20
NETGPU_CHUNK = 1 << 20
NETGPU_TAIL = 12_345  # odd-sized end of the stream: the last fragment is a partial chunk
STOP_TIMEOUT_S = 30.0
KILL_AFTER_S = 5.0  # after an interruption, guests get this long to go before SIGKILL
QUIET_BLAS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# =============================================================================================
# The guest side: runs in its own process, one per VF.
# =============================================================================================


def _kernels() -> tuple[Callable[..., Any], Callable[..., Any]]:
    # Nested, so cloudpickle ships them by value: the engine never imports this CLI module.
    def abA(xp: Any, a: Any, b: Any, c: Any) -> None:
        xp.matmul(xp.matmul(a, b), a, out=c)

    def spin(xp: Any) -> None:
        while True:
            pass

    return abA, spin


class _Out:
    """JSON lines to the coordinator; several guest threads report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, ev: str, **data: Any) -> None:
        line = json_mod.dumps({"ev": ev, "t": time.time(), **data}) + "\n"
        with self._lock:
            sys.stdout.write(line)
            sys.stdout.flush()


@dataclass
class _Work:
    verified: int = 0
    failed: int = 0
    after_reset: int = 0
    resets_seen: int = 0
    lost_to_reset: int = 0
    unexpected_resets: int = 0
    flop: float = 0.0
    hang: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def guest_main(arg: str) -> None:
    import numpy as np

    import gpuvirt

    p = json_mod.loads(arg)
    out = _Out()
    # Ctrl-C in the terminal reaches the whole process group; the coordinator
    # stops guests itself, in order, so a guest must not die mid-report.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop, hang = threading.Event(), threading.Event()

    def orders() -> None:
        for line in sys.stdin:
            if line.strip() == "hang":
                hang.set()
            elif line.strip() == "stop":
                break
        stop.set()  # "stop", or EOF: the coordinator is gone

    threading.Thread(target=orders, daemon=True).start()
    resets: list[float] = []
    gpu = gpuvirt.attach(
        vf=p["vf"], socket=p["socket"], token=p["token"],
        on_reset=lambda g: (resets.append(time.time()), out("reset", resets=g.resets)),
    )  # fmt: skip
    out("attached", pid=os.getpid())
    net_thread = None
    net: dict[str, Any] = {}
    if p.get("netgpu"):
        net_thread = threading.Thread(
            target=_netgpu_rx, args=(gpu, p["netgpu"], out, net), daemon=True
        )
        net_thread.start()
    work = _Work()
    try:
        _compute(gpu, np.random.default_rng(p["seed"]), p, stop, hang, work, out, resets)
    except Exception as e:  # reported, not raised: the coordinator decides what failed
        work.errors.append(f"{type(e).__name__}: {e}")
    if net_thread is not None:
        net_thread.join(HANG_TIMEOUT_S)
    out("done", work=work.__dict__, resets=gpu.resets, netgpu=net)
    # The host may be gone already (the coordinator gave up on it); this process
    # exits right after, so a fini that cannot be sent changes nothing.
    with contextlib.suppress(GpuvirtError):
        gpu.close()


def _compute(
    gpu: Any, rng: Any, p: dict[str, Any], stop: threading.Event, hang: threading.Event,
    work: _Work, out: _Out, resets: list[float],
) -> None:  # fmt: skip
    import numpy as np

    from gpuvirt.errors import BufferLostError, VFResetError

    abA, spin = _kernels()
    n = p["n"]
    a = rng.standard_normal((n, n))  # fixed per run; B is fresh every launch
    is_hang = p["role"] == "hang"
    hang_fut: Any = None
    bufs: list[tuple[Any, Any, Any]] = []
    inflight: deque[tuple[Any, int, Any]] = deque()
    free: deque[int] = deque()

    def setup() -> None:
        bufs.clear()
        for _ in range(DEPTH):
            A, B, C = (gpu.alloc((n, n), np.float64) for _ in range(3))
            A.write(a)
            bufs.append((A, B, C))
        free.clear()
        free.extend(range(DEPTH))

    setup()
    last_report = 0.0
    while True:
        try:
            while free and not stop.is_set() and hang_fut is None:
                if is_hang and hang.is_set() and not work.hang:
                    work.hang["submitted"] = time.time()
                    hang_fut = gpu.launch(spin)
                    out("hang_submitted")
                    break
                s = free.popleft()
                b = rng.random((n, n))
                bufs[s][1].write(b)
                inflight.append((gpu.launch(abA, *bufs[s]), s, b))
            if not inflight and hang_fut is not None:
                # What was queued before the hang has been checked; now wait for the reset.
                hang_fut.result(HANG_TIMEOUT_S)
                raise AssertionError("a kernel that never returns returned")
            if not inflight:
                return
            fut, s, b = inflight.popleft()
            fut.result(HANG_TIMEOUT_S)
            c = bufs[s][2].read()
            r = rng.standard_normal(n)
            want = a @ (b @ (a @ r))
            if np.allclose(
                c @ r, want, rtol=0, atol=1e-9 * n * max(1.0, float(np.abs(want).max()))
            ):
                work.verified += 1
                work.flop += 4 * n**3
                if work.resets_seen:
                    work.after_reset += 1
            else:
                work.failed += 1
            free.append(s)
        except (VFResetError, BufferLostError) as e:
            t_err = time.time()
            work.resets_seen += 1
            work.lost_to_reset += len(inflight) + (1 if hang_fut is not None else 0)
            inflight.clear()
            expected = hang_fut is not None
            hang_fut = None
            if not expected:
                work.unexpected_resets += 1
                work.errors.append(f"reset without a hang: {e}")
            gpu.wait_ready(HANG_TIMEOUT_S)
            if expected:
                work.hang.update(
                    error=t_err, ready=time.time(), on_reset=resets[-1] if resets else None
                )
                out("recovering", hang=work.hang)
            setup()
        now = time.monotonic()
        if now - last_report >= REFRESH_S:
            last_report = now
            out(
                "progress", verified=work.verified, failed=work.failed, after_reset=work.after_reset
            )
        if work.hang.get("ready") and work.after_reset == 1 and not work.hang.get("recovered"):
            work.hang["recovered"] = time.time()
            out("recovered", hang=work.hang)


def _netgpu_rx(gpu: Any, spec: dict[str, Any], out: _Out, net: dict[str, Any]) -> None:
    import numpy as np

    h, got, last_seq, t0 = hashlib.sha256(), 0, -1, time.time()
    try:
        pool = gpu.netgpu.pool(nbytes=spec["pool"], chunk=spec["chunk"])
        sock = socket.create_connection(tuple(spec["addr"]), timeout=HANG_TIMEOUT_S)
        sock.settimeout(None)
        last_report = 0.0
        for frag in pool.receive(sock):
            if frag.seq < last_seq:
                net.setdefault("errors", []).append(f"fragment {frag.seq} after {last_seq}")
            last_seq = frag.seq
            h.update(frag.array(np.uint8))  # read where it landed, in the VF's FB
            got += frag.size
            pool.release([frag.token])
            if time.monotonic() - last_report >= REFRESH_S:
                last_report = time.monotonic()
                out("netgpu", bytes=got)
        sock.close()
    except Exception as e:  # reported; the coordinator marks the stream failed
        net.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
    net.update(bytes=got, sha256=h.hexdigest(), seconds=time.time() - t0)
    out("netgpu", bytes=got, final=True)


# =============================================================================================
# The coordinator: this process.
# =============================================================================================


def netgpu_available() -> str | None:
    """None when NetGPU can be shown, else why not."""
    # pool imports rx only when a receive starts; a build with one and not the
    # other would fail mid-demo instead of saying so here.
    for module in ("gpuvirt.netgpu.pool", "gpuvirt.netgpu.rx"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not in this build"
    return None


class StreamSender(threading.Thread):
    """The network side of the NetGPU demo: one TCP stream of seeded bytes, paced."""

    def __init__(self, total: int, rate: float, seed: int) -> None:
        super().__init__(name="demo-netgpu-sender", daemon=True)
        self.total, self.rate, self.seed = total, rate, seed
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(ATTACH_TIMEOUT_S)
        self.addr = self.srv.getsockname()[:2]
        self.sent = 0
        self.sha256 = ""
        self.error: str | None = None
        self._abort = threading.Event()

    def abort(self) -> None:
        """Stop sending (the receiver gave up); unblocks a pending accept too."""
        self._abort.set()
        with contextlib.suppress(OSError):
            self.srv.shutdown(socket.SHUT_RDWR)  # wakes the accept(); close() alone need not

    def run(self) -> None:
        import numpy as np

        rng = np.random.default_rng(self.seed)
        h = hashlib.sha256()
        try:
            conn, _ = self.srv.accept()
            with conn:
                t0 = time.monotonic()
                while self.sent < self.total and not self._abort.is_set():
                    chunk = rng.bytes(min(NETGPU_CHUNK, self.total - self.sent))
                    conn.sendall(chunk)
                    h.update(chunk)
                    self.sent += len(chunk)
                    ahead = self.sent / self.rate - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)  # pacing: the stream's rate, not a wait for anything
                conn.shutdown(socket.SHUT_WR)
        except OSError as e:
            if not self._abort.is_set():
                self.error = f"sender: {e}"
        finally:
            self.srv.close()
            self.sha256 = h.hexdigest()


class Guest:
    """One guest process and what it has reported."""

    def __init__(
        self, vf: int, role: str, weight: float, params: dict[str, Any], log: Path
    ) -> None:
        self.vf, self.role, self.weight = vf, role, weight
        self.log = log
        self._log = open(log, "w")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from gpuvirt.cli.demo import guest_main; "
             "guest_main(sys.argv[1])", json_mod.dumps(params)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env={**os.environ, **QUIET_BLAS},
        )  # fmt: skip
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        self._buf = b""
        self.attached = False
        self.last: dict[str, Any] = {}
        self.done: dict[str, Any] | None = None
        self.hang: dict[str, Any] = {}
        self.netgpu_bytes = 0
        self.netgpu_over = False  # the guest's receiver ended: all in, or failed
        self.eof = False

    @property
    def fd(self) -> int:
        assert self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def read(self) -> None:
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.eof = True
            return
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            with contextlib.suppress(ValueError):
                self._on(json_mod.loads(line))

    def _on(self, m: dict[str, Any]) -> None:
        ev = m["ev"]
        if ev == "attached":
            self.attached = True
        elif ev == "progress":
            self.last = m
        elif ev in ("recovering", "recovered"):
            self.hang = m["hang"]
        elif ev == "hang_submitted":
            self.hang = {"submitted": m["t"]}
        elif ev == "netgpu":
            self.netgpu_bytes = m["bytes"]
            self.netgpu_over = bool(m.get("final"))
        elif ev == "done":
            self.done = m

    def tell(self, order: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(f"{order}\n".encode())
            self.proc.stdin.flush()

    def close_stdin(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()

    def finish(self, timeout: float) -> None:
        """Wait for the process; kill it past the timeout. Never leaves it behind."""
        self.close_stdin()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            self.read()
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self._log.close()

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log.read_text()[-n:]
        except OSError:
            return ""


class ShareMeter:
    """Device time per VF over the run, from successive status samples.

    A VF's device time starts over when its engine restarts (an FLR), so a
    drop means 'new engine' and the new value is all new time. 'steady' only
    counts intervals in which every VF was ACTIVE with no FLR, the part of the
    run where the policy's shares are what it promises.
    """

    def __init__(self) -> None:
        self.prev: dict[int, tuple[float, str, int]] = {}
        self.total: dict[int, float] = {}
        self.steady: dict[int, float] = {}

    def add(self, status: dict[str, Any]) -> None:
        cur = {v["index"]: (v["device_ms"], v["state"], v["flr_count"]) for v in status["vfs"]}
        if self.prev:
            calm = all(self._calm(self.prev.get(i), now) for i, now in cur.items())
            for i, (ms, _, _) in cur.items():
                before = self.prev.get(i, (0.0, "", 0))[0]
                d = ms - before if ms >= before else ms
                self.total[i] = self.total.get(i, 0.0) + d
                if calm:
                    self.steady[i] = self.steady.get(i, 0.0) + d
        self.prev = cur

    @staticmethod
    def _calm(before: tuple[float, str, int] | None, now: tuple[float, str, int]) -> bool:
        """ACTIVE at both ends of the interval, and no FLR in between."""
        return before is not None and before[1] == now[1] == "ACTIVE" and before[2] == now[2]

    @staticmethod
    def shares(times: dict[int, float]) -> dict[int, float]:
        s = sum(times.values())
        return {i: (t / s if s else 0.0) for i, t in times.items()}


@dataclass
class Run:
    n: int
    duration: float
    guests: list[Guest] = field(default_factory=list)
    sender: StreamSender | None = None
    netgpu_skip: str | None = None
    status: dict[str, Any] = field(default_factory=dict)
    engines: set[int] = field(default_factory=set)
    meter: ShareMeter = field(default_factory=ShareMeter)
    events: list[dict[str, Any]] = field(default_factory=list)
    t0: float = 0.0
    hang_sent: bool = False
    phase: str = "starting"


def roles(n: int) -> dict[int, str]:
    """VF0 ingests the stream; the heaviest VF hangs (it reaches job_timeout soonest)."""
    r = dict.fromkeys(range(n), "compute")
    r[0] = "netgpu"
    r[n - 1] = "hang"
    return r


def _demo_config(n: int) -> dict[str, Any]:
    return {
        "sriov": {"vf_num": n},
        "scheduler": {"policy": "weighted", "job_timeout_s": JOB_TIMEOUT_S},
        "vf": [{"index": i, "weight": float(i + 1)} for i in range(n)],
    }


def run_demo(n: int, duration: float, show: Callable[[Run], None]) -> dict[str, Any]:
    from gpuvirt.bench.common import scratch_host

    run = Run(n, duration)
    run.netgpu_skip = netgpu_available()
    started = time.time()
    # Once the run is over (or interrupted), a further Ctrl-C must not cut the
    # cleanup short and leave processes behind; every step of it has a timeout.
    previous: Any = None
    try:
        with scratch_host(env=QUIET_BLAS, **_demo_config(n)) as hp:
            try:
                _drive(run, hp, show)
            except BaseException:
                previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
                finish_all(run.guests, KILL_AFTER_S)  # they may be mid-hang: no long wait
                raise
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            finish_all(run.guests, STOP_TIMEOUT_S)
            settle(hp, STOP_TIMEOUT_S)
            host_pid = hp.pid
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return summarize(run, host_pid, time.time() - started)


SETTLED = frozenset({"AVAIL", "UNAVAIL", "QUARANTINED", "FAILED"})


def settle(hp: Any, timeout: float) -> None:
    """Wait until the host has finished the guests' finis (scrub, fresh engine) before it stops.

    Stopping a host in the middle of restarting an engine is the one moment
    an engine could outlive it; the host says in its events when each VF is
    back, so this waits on those (long poll), not on a clock.
    """
    deadline = time.monotonic() + timeout
    after = 0
    with contextlib.suppress(GpuvirtError):
        while time.monotonic() < deadline:
            evs = events_cli.fetch(hp.admin, after, None)
            after = max((e["seq"] for e in evs), default=after)
            if all(v["state"] in SETTLED for v in hp.admin.status()["vfs"]):
                return
            events_cli.fetch(hp.admin, after, None, wait=min(2.0, deadline - time.monotonic()))


def finish_all(guests: list[Guest], timeout: float) -> None:
    """Stop every guest: EOF on stdin first, all at once; kill what is left at the deadline."""
    for g in guests:
        g.close_stdin()
    deadline = time.monotonic() + timeout
    for g in guests:
        g.finish(max(0.0, deadline - time.monotonic()))


def _drive(run: Run, hp: Any, show: Callable[[Run], None]) -> None:
    r = roles(run.n)
    if r[0] == "netgpu" and run.netgpu_skip is None:
        total = max(
            NETGPU_CHUNK, int(NETGPU_RATE * run.duration * 0.6) // NETGPU_CHUNK * NETGPU_CHUNK
        )
        run.sender = StreamSender(total + NETGPU_TAIL, NETGPU_RATE, seed=7)
        run.sender.start()
    for i in range(run.n):
        params: dict[str, Any] = {
            "vf": i, "socket": str(hp.socket), "token": hp.token(i), "role": r[i],
            "n": MATRIX_N, "seed": 1000 + i,
        }  # fmt: skip
        if r[i] == "netgpu" and run.sender is not None:
            params["netgpu"] = {
                "addr": list(run.sender.addr), "pool": NETGPU_POOL, "chunk": NETGPU_CHUNK,
            }  # fmt: skip
        run.guests.append(Guest(i, r[i], float(i + 1), params, hp.workdir / f"guest{i}.log"))
    sel = selectors.DefaultSelector()
    for g in run.guests:
        sel.register(g.fd, selectors.EVENT_READ, g)
    hang_guest = next(g for g in run.guests if g.role == "hang")
    last_event = 0

    def tick(deadline: float) -> None:
        nonlocal last_event
        while True:
            left = deadline - time.monotonic()
            for key, _ in sel.select(max(0.0, left)):
                g = key.data
                g.read()
                if g.eof:
                    sel.unregister(g.fd)
            if left <= 0:
                break
        try:
            run.status = hp.admin.status()
            new = events_cli.fetch(hp.admin, last_event, None)
        except GpuvirtError:
            return  # the host is going away; the summary will say what it saw
        run.events.extend(new)
        last_event = max((e["seq"] for e in new), default=last_event)
        run.engines.update(v["engine_pid"] for v in run.status["vfs"] if v["engine_pid"])
        if run.phase == "running":  # once stopping, guests drain and go idle
            run.meter.add(run.status)
        show(run)

    attach_by = time.monotonic() + ATTACH_TIMEOUT_S
    while not all(g.attached for g in run.guests):
        if time.monotonic() > attach_by or any(g.eof for g in run.guests):
            run.phase = "failed to attach"
            return
        tick(time.monotonic() + REFRESH_S)
    run.phase = "running"
    run.t0 = time.monotonic()
    hang_at = run.t0 + max(1.0, HANG_AT * run.duration)
    give_up = run.t0 + run.duration + HANG_TIMEOUT_S
    while True:
        now = time.monotonic()
        if not run.hang_sent and now >= hang_at:
            hang_guest.tell("hang")
            run.hang_sent = True
        # The run ends at its duration, once the hang is recovered from and the stream is in.
        hang_over = "recovered" in hang_guest.hang or hang_guest.eof
        stream_over = run.sender is None or _netgpu_over(run)
        if now >= run.t0 + run.duration and run.hang_sent and hang_over and stream_over:
            break
        if now >= give_up or all(g.eof for g in run.guests):
            break
        tick(now + REFRESH_S)
    run.phase = "stopping"
    for g in run.guests:
        g.tell("stop")
    stop_by = time.monotonic() + STOP_TIMEOUT_S
    while not all(g.done is not None or g.eof for g in run.guests) and time.monotonic() < stop_by:
        tick(time.monotonic() + REFRESH_S)
    run.phase = "done"
    with contextlib.suppress(GpuvirtError):
        run.status = hp.admin.status()
        run.events.extend(events_cli.fetch(hp.admin, last_event, None))


def _netgpu_over(run: Run) -> bool:
    g = next((g for g in run.guests if g.role == "netgpu"), None)
    return g is None or g.eof or g.netgpu_over


# ---- the summary ------------------------------------------------------------------------


def flrs_from_events(evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    starts: dict[int, dict[str, Any]] = {}
    out = []
    for e in evs:
        if e["kind"] == "flr.start":
            starts[e["vf"]] = e
        elif e["kind"] == "flr.done":
            s = starts.pop(e["vf"], None)
            d = e["data"]
            out.append({
                "vf": e["vf"],
                "reason": d.get("reason"),
                "detail": (s or {}).get("data", {}).get("detail", ""),
                "total_ms": d.get("total_ms"),
                "steps_ms": d.get("steps", {}),
                "at": e["ts"],
            })  # fmt: skip
    for vf, s in starts.items():
        d = s["data"]
        out.append({
            "vf": vf, "reason": d.get("reason"), "detail": d.get("detail", ""),
            "total_ms": None, "steps_ms": {}, "at": s["ts"], "unfinished": True,
        })  # fmt: skip
    return out


def summarize(run: Run, host_pid: int, wall_s: float) -> dict[str, Any]:
    failures: list[str] = []
    st = run.status or {"vfs": [], "sched": {}}
    if run.phase != "done":
        failures.append(f"the run ended early: {run.phase}")
    weights = {g.vf: g.weight for g in run.guests}
    wsum = sum(weights.values()) or 1.0
    total = ShareMeter.shares(run.meter.total)
    steady = ShareMeter.shares(run.meter.steady)
    shares = [
        {
            "vf": i, "weight": w, "configured": round(w / wsum, 4),
            "achieved": round(total.get(i, 0.0), 4),
            "achieved_steady": round(steady[i], 4) if i in steady else None,
            "error_pp": round(100 * (steady.get(i, total.get(i, 0.0)) - w / wsum), 2),
        }
        for i, w in weights.items()
    ]  # fmt: skip
    flrs = flrs_from_events(run.events)
    work = []
    for g in run.guests:
        row, problems = _work_row(g, flrs)
        failures.extend(f"VF{g.vf}: {p}" for p in problems)
        work.append(row)
    for f in flrs:
        if all(g.vf != f["vf"] or g.role != "hang" for g in run.guests):
            failures.append(f"VF{f['vf']}: an FLR hit a VF that did not hang ({f['reason']})")
    netgpu = _netgpu_summary(run, failures)
    sched = st.get("sched", {})
    return {
        "ok": not failures,
        "backend": st.get("backend"),
        "policy": st.get("policy"),
        "vfs": run.n,
        "duration_s": run.duration,
        "wall_s": round(wall_s, 2),
        "shares": shares,
        "work": work,
        "netgpu": netgpu,
        "flrs": flrs,
        "sched": {
            k: sched.get(k) for k in ("switches", "lost_pct", "switch_p50_us", "switch_p99_us")
        },
        "pids": {
            "host": host_pid,
            "engines": sorted(run.engines),
            "guests": [g.proc.pid for g in run.guests],
        },
        "failures": failures,
    }


def _work_row(g: Guest, flrs: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    done = g.done or {}
    d = done.get("work", {})
    row: dict[str, Any] = {
        "vf": g.vf, "role": g.role, "pid": g.proc.pid,
        "verified": d.get("verified", 0), "failed": d.get("failed", 0),
        "gflop": round(d.get("flop", 0.0) / 1e9, 2),
        "resets": done.get("resets", 0),
        "verified_after_reset": d.get("after_reset", 0),
        "lost_to_reset": d.get("lost_to_reset", 0),
        "errors": d.get("errors", []),
    }  # fmt: skip
    problems: list[str] = []
    if g.done is None:
        problems.append(f"the guest did not report; its log ends: {g.log_tail(400)!r}")
    if row["failed"]:
        problems.append(f"{row['failed']} results were wrong")
    if not row["verified"]:
        problems.append("no result was verified")
    problems.extend(row["errors"])
    if g.role == "hang":
        h = d.get("hang") or g.hang
        row["hang"] = {
            "caught_after_ms": _ms(h.get("submitted"), h.get("error")),
            "back_after_ms": _ms(h.get("error"), h.get("ready")),
        }
        if not any(f["vf"] == g.vf and not f.get("unfinished") for f in flrs):
            problems.append("the hanging kernel was not reset by the host")
        if row["resets"] < 1 or row["verified_after_reset"] < 1:
            problems.append("the guest did not go on working after its reset")
    row["ok"] = not problems
    return row, problems


def _netgpu_summary(run: Run, failures: list[str]) -> dict[str, Any]:
    g = next((g for g in run.guests if g.role == "netgpu"), None)
    if run.sender is None or g is None:
        return {
            "status": "skipped",
            "reason": run.netgpu_skip or "no NetGPU VF",
            "vf": g.vf if g else None,
        }
    if run.sender.is_alive():
        run.sender.abort()  # the receiver is done (or gone); whatever is unsent stays unsent
    run.sender.join(STOP_TIMEOUT_S)
    got = (g.done or {}).get("netgpu", {})
    out = {
        "vf": g.vf,
        "bytes_sent": run.sender.sent,
        "bytes_received": got.get("bytes", 0),
        "sha256_sent": run.sender.sha256,
        "sha256_received": got.get("sha256"),
        "seconds": round(got.get("seconds", 0.0), 3),
        "errors": [*got.get("errors", []), *([run.sender.error] if run.sender.error else [])],
    }
    verified = (
        not out["errors"]
        and out["bytes_received"] == out["bytes_sent"] > 0
        and out["sha256_received"] == out["sha256_sent"]
    )
    out["status"] = "verified" if verified else "failed"
    out["bytes_verified"] = out["bytes_received"] if verified else 0
    if not verified:
        failures.append(
            f"NetGPU on VF{g.vf}: sent {out['bytes_sent']} B sha256 {out['sha256_sent'][:16]}…, "
            f"received {out['bytes_received']} B sha256 {(out['sha256_received'] or '')[:16]}…"
            + (f"; {out['errors']}" if out["errors"] else "")
        )
    return out


def _ms(a: float | None, b: float | None) -> float | None:
    return round((b - a) * 1000, 1) if a is not None and b is not None else None


# ---- on screen ----------------------------------------------------------------------------


class View:
    """The live view: `gpuvirt top`'s frame plus each guest's progress and recent events."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.rates = top_cli.RateTracker()
        self.dev = top_cli.DeviceRates()
        self.vfs: dict[int, top_cli.VFRates] = {}

    def observe(self, run: Run) -> None:
        """Every tick, shown or not: rates need successive samples of the same guests."""
        if run.status:
            self.dev, self.vfs = self.rates.update(run.status)

    def render(self, run: Run) -> RenderableType:
        parts: list[RenderableType] = [self._header(run)]
        if run.status:
            dev, vfs = self.dev, self.vfs
            extra: dict[str, dict[int, RenderableType]] = {"role": {}, "verified": {}, "wrong": {}}
            for g in run.guests:
                extra["role"][g.vf] = g.role
                extra["verified"][g.vf] = str(g.last.get("verified", 0))
                wrong = g.last.get("failed", 0)
                extra["wrong"][g.vf] = Text(str(wrong), style="bold red" if wrong else "")
            parts.append(top_cli.frame(run.status, dev, vfs, extra))
        recent = [e for e in run.events if e["category"] in ("reset", "guard")][-6:]
        if recent:
            parts.append(Text("recent events", style="bold"))
            parts.extend(events_cli.event_text(e) for e in recent)
        return Group(*parts)

    def _header(self, run: Run) -> Text:
        t = Text("gpuvirt demo", style="bold")
        if run.t0:
            t.append(f" · {time.monotonic() - run.t0:.0f}/{run.duration:g} s")
        t.append(f" · {run.phase}")
        hang = next((g.hang for g in run.guests if g.role == "hang"), {})
        if "recovered" in hang:
            state = "recovered"
        elif "error" in hang:
            state = "reset, coming back"
        elif hang:
            state = "hung, waiting for the host"
        else:
            state = "sent" if run.hang_sent else "not yet"
        t.append(f" · hang: {state}")
        if run.sender is not None:
            t.append(f" · NetGPU stream: {top_cli.human_bytes(run.sender.sent)} sent")
        elif run.netgpu_skip:
            t.append(f" · NetGPU: skipped ({run.netgpu_skip})")
        return t


def summary_view(s: dict[str, Any]) -> Group:
    parts: list[RenderableType] = []
    t = Table(
        title="shares of device time (policy weighted)", title_justify="left", header_style="bold"
    )
    for c in ("VF", "weight", "configured", "achieved (run)", "achieved (steady)", "error"):
        t.add_column(c, justify="right")
    for r in s["shares"]:
        steady = r["achieved_steady"]
        t.add_row(
            f"VF{r['vf']}", f"{r['weight']:g}", f"{100 * r['configured']:.1f}%",
            f"{100 * r['achieved']:.1f}%", "-" if steady is None else f"{100 * steady:.1f}%",
            f"{r['error_pp']:+.1f} pp",
        )  # fmt: skip
    parts.append(t)
    t = Table(title="work verified in each VF", title_justify="left", header_style="bold")
    for c in ("VF", "role", "verified", "wrong", "GFLOP", "resets", "after reset", "lost", "ok"):
        t.add_column(c, justify="left" if c in ("role", "ok") else "right")
    for r in s["work"]:
        t.add_row(
            f"VF{r['vf']}", r["role"], str(r["verified"]), str(r["failed"]), f"{r['gflop']:.1f}",
            str(r["resets"]), str(r["verified_after_reset"]), str(r["lost_to_reset"]),
            Text("yes", style="green") if r["ok"] else Text("NO", style="bold red"),
        )  # fmt: skip
    parts.append(t)
    n = s["netgpu"]
    if n["status"] == "skipped":
        parts.append(Text(f"NetGPU: skipped ({n['reason']})", style="yellow"))
    else:
        style = "green" if n["status"] == "verified" else "bold red"
        parts.append(Text(
            f"NetGPU on VF{n['vf']}: {n['bytes_received']:,} of {n['bytes_sent']:,} bytes received "
            f"into device memory; sha256 {n['sha256_received'][:16]}… "
            f"{'matches' if n['status'] == 'verified' else 'DOES NOT match'} the sender's",
            style=style,
        ))  # fmt: skip
    t = Table(title="FLRs", title_justify="left", header_style="bold")
    for c in ("VF", "reason", "total", "steps (ms)", "guest: caught after", "guest: back after"):
        t.add_column(c, justify="left" if c in ("reason", "steps (ms)") else "right")
    hang = {w["vf"]: w.get("hang", {}) for w in s["work"]}
    for f in s["flrs"]:
        h = hang.get(f["vf"], {})
        t.add_row(
            f"VF{f['vf']}", f["reason"] or "?",
            "-" if f["total_ms"] is None else f"{f['total_ms']:.1f} ms",
            ", ".join(f"{k} {v:.1f}" for k, v in f["steps_ms"].items()),
            _ms_text(h.get("caught_after_ms")), _ms_text(h.get("back_after_ms")),
        )  # fmt: skip
    parts.append(t if s["flrs"] else Text("FLRs: none", style="bold red"))
    sc = s["sched"]
    parts.append(Text(
        f"world switches: {sc['switches']}, p50 {sc['switch_p50_us']} µs, "
        f"p99 {sc['switch_p99_us']} µs, "
        f"{sc['lost_pct']}% of device time lost to switching; {s['wall_s']} s in all",
        style="dim",
    ))  # fmt: skip
    if s["ok"]:
        parts.append(Text("everything verified", style="bold green"))
    else:
        parts.append(Text("verification FAILED:", style="bold red"))
        parts.extend(Text(f"  {f}", style="red") for f in s["failures"])
    return Group(*parts)


def _ms_text(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


@contextlib.contextmanager
def _screen(json: bool) -> Iterator[Callable[[Run], None]]:
    """Where the live view goes: a terminal gets it in place; a log gets a frame now and then."""
    console = top_cli.make_console(stderr=json)
    if json and not console.is_terminal:
        yield lambda run: None
        return
    view = View(console)
    if console.is_terminal:
        with Live(console=console, auto_refresh=False, transient=False) as live:

            def live_show(run: Run) -> None:
                view.observe(run)
                live.update(view.render(run), refresh=True)

            yield live_show
        return
    last = [0.0]

    def plain(run: Run) -> None:
        view.observe(run)
        if time.monotonic() - last[0] >= PLAIN_FRAME_S or run.phase == "done":
            last[0] = time.monotonic()
            console.print(view.render(run))
            console.print()

    yield plain


@app.command()
def demo(
    duration: Annotated[
        float, typer.Option(min=1.0, help="Seconds of work (the hang's recovery may add a few).")
    ] = 20.0,
    vfs: Annotated[int, typer.Option("--vfs", min=2, max=8, help="VFs (weights 1..N).")] = 4,
    json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Every part in one run on emu: weighted VFs with verified work, NetGPU, a hang and its FLR."""
    try:
        with _screen(json) as show:
            summary = run_demo(vfs, duration, show)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except GpuvirtError as e:
        raise fail(str(e)) from None
    if json:
        sys.stdout.write(json_mod.dumps(summary, indent=2, default=str) + "\n")
    else:
        top_cli.make_console().print(summary_view(summary))
    if not summary["ok"]:
        raise typer.Exit(1)
