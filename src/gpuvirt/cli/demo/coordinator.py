"""The demo's coordinator: a scratch host, one guest per VF, the run driven to its end.

A scratch host with N VFs (weights 1..N, policy `weighted`) on emu or on a
real GPU (cuda), and one guest process per VF (see worker.py). VF0 ingests a
NetGPU stream; the heaviest VF launches a kernel that never returns, which
the host catches (job_timeout), resets (FLR) and hands back, then a kernel
that faults (a write through a bad pointer), whose engine dies and is reset
too; the others keep working and verifying throughout.
"""

from __future__ import annotations

import contextlib
import selectors
import signal
import time
from collections.abc import Callable
from typing import Any

from gpuvirt.cli import events as events_cli
from gpuvirt.cli.demo.guest import Guest
from gpuvirt.cli.demo.knobs import (
    ATTACH_TIMEOUT_S,
    HANG_AT,
    HANG_TIMEOUT_S,
    INCIDENTS,
    JOB_TIMEOUT_S,
    KILL_AFTER_S,
    MATRIX_N,
    NETGPU_CHUNK,
    NETGPU_POOL,
    NETGPU_RATE,
    NETGPU_TAIL,
    QUIET_BLAS,
    REFRESH_S,
    STOP_TIMEOUT_S,
)  # fmt: skip
from gpuvirt.cli.demo.run import Run, roles
from gpuvirt.cli.demo.sender import StreamSender, netgpu_available
from gpuvirt.cli.demo.summary import summarize
from gpuvirt.errors import GpuvirtError


def demo_config(n: int, backend: str = "emu") -> dict[str, Any]:
    return {
        "device": {"backend": backend},
        "sriov": {"vf_num": n},
        "scheduler": {"policy": "weighted", "job_timeout_s": JOB_TIMEOUT_S},
        "vf": [{"index": i, "weight": float(i + 1)} for i in range(n)],
    }


def run_demo(
    n: int, duration: float, show: Callable[[Run], None], backend: str = "emu"
) -> dict[str, Any]:
    """The run and its summary; DeviceError (before anything starts) where the backend
    cannot run here, e.g. cuda without CuPy or without a usable GPU."""
    from gpuvirt.bench.common import scratch_host

    if backend == "cuda":
        from gpuvirt.device.cuda import probe_gpu

        # The host would refuse too, but only in its log; this says why in one line.
        probe_gpu()
    run = Run(n, duration, backend=backend)
    run.netgpu_skip = netgpu_available()
    started = time.time()
    # Once the run is over (or interrupted), a further Ctrl-C must not cut the
    # cleanup short and leave processes behind; every step of it has a timeout.
    previous: Any = None
    try:
        with scratch_host(env=QUIET_BLAS, **demo_config(n, backend)) as hp:
            try:
                _drive(run, hp, show)
            except BaseException:
                previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
                finish_all(run.guests, KILL_AFTER_S)  # they may be mid-incident: no long wait
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
    hostile = next(g for g in run.guests if g.role == "hostile")
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
    first_at = run.t0 + max(1.0, HANG_AT * run.duration)
    give_up = run.t0 + run.duration + len(INCIDENTS) * HANG_TIMEOUT_S
    while True:
        now = time.monotonic()
        due = next_incident(run.sent, hostile.incidents, now >= first_at)
        if due is not None:
            hostile.tell(due)
            run.sent.append(due)
        # The run ends at its duration, once every incident is recovered from and the
        # stream is in.
        incidents_over = hostile.eof or (
            len(run.sent) == len(INCIDENTS)
            and "recovered" in hostile.incidents.get(run.sent[-1], {})
        )
        stream_over = run.sender is None or _netgpu_over(run)
        if now >= run.t0 + run.duration and incidents_over and stream_over:
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


def next_incident(sent: list[str], seen: dict[str, dict[str, Any]], started: bool) -> str | None:
    """The incident to order now: the first once the run is under way, each next one
    once the guest is back from the last one's reset (one VF reset at a time)."""
    if not started or len(sent) == len(INCIDENTS):
        return None
    if sent and "recovered" not in seen.get(sent[-1], {}):
        return None
    return INCIDENTS[len(sent)]


def _netgpu_over(run: Run) -> bool:
    g = next((g for g in run.guests if g.role == "netgpu"), None)
    return g is None or g.eof or g.netgpu_over
