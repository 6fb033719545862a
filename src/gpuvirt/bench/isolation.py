"""bench isolation: one tenant's fault, and what it does to its neighbours, under gpuvirt,
under MPS and under plain time-slicing, side by side in one run (cuda only).

Three tenants per run (bench/isolation_tenant.py): T0 commits the fault, T1 and
T2 keep doing verified work. The faults (FAULTS): a kernel on every SM that
never ends, a kernel that writes through a bad pointer (illegal address), and a
tenant that takes all the device memory it can reach. The setups: `gpuvirt`
(each tenant a guest of its own VF: its own engine, its own context), `mps`
(the three are clients of one MPS daemon the bench starts in a private pipe and
log directory, each capped by MPS at the share: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT),
`timeslice` (plain CUDA processes: the driver's time-slicing).

Reported per fault and setup, per tenant: died, lost work (errors, wrong
results), stuck, slowed, or unaffected; the longest stall of its work after
the fault (a neighbour's time to recover); for T0 the time until its work is
verified again (None: never, in the window); for the memory fault the bytes T0
got beyond its share. What gpuvirt cannot stop (a tenant's own cudaMalloc
beyond its FB) shows here, and docs/cuda.md says so. Without a GPU there is
nothing to measure: the bench refuses (DeviceError) rather than report figures
of another backend.
"""

from __future__ import annotations

import itertools
import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuvirt.bench import mps
from gpuvirt.bench.common import Result, Target, scratch_host
from gpuvirt.errors import DeviceError

SETUPS = ("gpuvirt", "mps", "timeslice")
SHARE = 2 << 30  # each tenant's device memory: its FB on gpuvirt, MPS's cap, the yardstick
TENANTS = 3
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 5.0
BEFORE_S = 1.0  # the neighbours' rate before the fault, the yardstick of "slowed"
SLOWED = 0.5  # below this fraction of its rate before, a tenant's work counts as slowed


@dataclass(frozen=True)
class FaultPlan:
    name: str
    after_s: float  # how long the run goes on after the fault
    what: str
    restart_neighbour: bool = False  # T2 (re)starts while T0 holds the memory


# After-windows cover gpuvirt's detection and FLR: a hang is caught at job_timeout_s
# (1 s) or the cooperative IDLE limit, and its VF is back in a few hundred ms.
FAULTS = (
    FaultPlan("spin", 4.0, "a kernel on every SM that never ends"),
    FaultPlan("illegal_address", 3.0, "a kernel writing through a bad pointer"),
    FaultPlan("grab_memory", 3.0, "all device memory the tenant can reach, held",
              restart_neighbour=True),
)  # fmt: skip
HOST = {
    "device": {"backend": "cuda", "fb_total": f"{TENANTS * SHARE + (64 << 20)}",
               "pf_fb": "64MiB"},
    "sriov": {"vf_num": TENANTS},
    "scheduler": {"policy": "liquid", "job_timeout_s": 1.0},
}  # fmt: skip


@dataclass
class Tenant:
    """What one tenant process reported: its events, its exit."""

    name: str
    events: list[dict[str, Any]] = field(default_factory=list)
    rc: int | None = None  # None: still running when the bench stopped it
    killed: bool = False  # it did not stop when told and was killed


def judge(t: Tenant, fault_t: float, end_t: float) -> dict[str, Any]:
    """One tenant's fate after the fault at fault_t, from its events (monotonic times)."""
    oks = [e["t"] for e in t.events if e["ev"] == "ok"]
    before = [x for x in oks if fault_t - BEFORE_S <= x < fault_t]
    after = [x for x in oks if fault_t <= x <= end_t]
    errors = [e for e in t.events if e["ev"] == "error" and e["t"] >= fault_t]
    bad = sum(1 for e in t.events if e["ev"] == "bad" and e["t"] >= fault_t)
    rate_before = len(before) / BEFORE_S
    rate_after = len(after) / max(1e-9, end_t - fault_t)
    points = [fault_t, *after, end_t]
    stall = max(b - a for a, b in itertools.pairwise(points))
    died = any(e["ev"] == "dead" for e in t.events) or (t.rc not in (None, 0) and not t.killed)
    if died:
        fate = "died"
    elif not after:
        fate = "stuck"
    elif errors or bad:
        fate = "lost work"
    elif rate_before and rate_after < SLOWED * rate_before:
        fate = "slowed"
    else:
        fate = "unaffected"
    last_error = max((e["t"] for e in errors), default=None)
    back = next((x for x in after if last_error is None or x > last_error), None)
    return {
        "fate": fate,
        "steps_before_per_s": round(rate_before, 1),
        "steps_after_per_s": round(rate_after, 1),
        "errors": len(errors),
        "wrong_results": bad,
        "longest_stall_s": round(stall, 3),
        "back_after_s": None if back is None or not (errors or died) else round(back - fault_t, 3),
        "first_error": errors[0].get("error") if errors else None,
    }


def outcome(plan: FaultPlan, tenants: dict[str, Tenant], fault_t: float, end_t: float,
            share: int) -> dict[str, Any]:  # fmt: skip
    """One (fault, setup) run: every tenant judged, the neighbours' verdict, the memory."""
    rows = {name: judge(t, fault_t, end_t) for name, t in tenants.items()}
    neighbours = [r for name, r in rows.items() if name != "T0"]
    out: dict[str, Any] = {
        "tenants": rows,
        "neighbours_harmed": sum(r["fate"] in ("died", "lost work", "stuck") for r in neighbours),
        "neighbours_died": sum(r["fate"] == "died" for r in neighbours),
        "neighbour_worst_stall_s": max(r["longest_stall_s"] for r in neighbours),
        "faulty_back_after_s": rows["T0"]["back_after_s"],
    }
    if plan.name == "grab_memory":
        got = next((e["result"] for e in tenants["T0"].events if e["ev"] == "fault_result"), {})
        taken = sum(got.values()) if isinstance(got, dict) else 0
        out.update(taken_bytes=taken, share_bytes=share, beyond_share_bytes=max(0, taken - share),
                   taken_by=got)  # fmt: skip
    return out


def figures(runs: dict[str, dict[str, Any]], skipped: dict[str, str]) -> dict[str, Any]:
    """The report: per fault, per setup, and the setups that did not run (and why)."""
    return {"faults": runs, "setups_skipped": skipped,
            "plans": {p.name: {"what": p.what, "after_s": p.after_s} for p in FAULTS}}  # fmt: skip


def targets(runs: dict[str, dict[str, Any]]) -> list[Target]:
    """gpuvirt's promise: no neighbour harmed by any fault, and the faulty VF back."""
    ours = {f: r["gpuvirt"] for f, r in runs.items() if "gpuvirt" in r}
    harmed = sum(r["neighbours_harmed"] for r in ours.values())
    # the memory fault is not reset: the tenant holds what it took, and works on
    unrecovered = sum(
        r["faulty_back_after_s"] is None for f, r in ours.items() if f != "grab_memory"
    )
    return [Target("gpuvirt_neighbours_harmed", harmed, 0, "<="),
            Target("gpuvirt_faulty_not_back", unrecovered, 0, "<=")]  # fmt: skip


def run(quick: bool = False, backend: str = "emu") -> Result:
    if backend != "cuda":
        raise DeviceError(
            f"bench isolation compares device faults (a hung kernel, an illegal address, "
            f"all device memory taken) under gpuvirt, MPS and time-slicing on a real GPU; "
            f'backend "{backend}" has no device to fault: run it with --backend cuda'
        )
    from gpuvirt.device.cuda import probe_gpu

    probe_gpu()  # DeviceError: no CuPy, no usable GPU
    skipped = {"mps": why} if (why := mps.available()) else {}
    runs: dict[str, dict[str, Any]] = {p.name: {} for p in FAULTS}
    base = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with scratch_host(**HOST) as hp:
        for plan in FAULTS:
            params = [{"mode": "gpuvirt", "vf": i, "socket": str(hp.socket),
                       "token": hp.token(i)} for i in range(TENANTS)]  # fmt: skip
            settle(hp, START_TIMEOUT_S)  # the last run's guests' finis: fresh engines
            runs[plan.name]["gpuvirt"] = one_run(plan, params, base)
    native = [{"mode": "native"} for _ in range(TENANTS)]
    for plan in FAULTS:
        runs[plan.name]["timeslice"] = one_run(plan, native, base)
        if "mps" not in skipped:
            with mps.mps_daemon(base) as env:
                runs[plan.name]["mps"] = one_run(plan, native, {**env, **mps.mem_limit(SHARE)})
    r = Result("isolation", backend, figures(runs, skipped), targets(runs))
    for f, per in runs.items():
        for setup, o in per.items():
            fates = ", ".join(f"{n} {v['fate']}" for n, v in o["tenants"].items())
            r.rows.append((f"{f} · {setup}", fates, ""))
    r.notes.append("MPS runs with CUDA_MPS_PINNED_DEVICE_MEM_LIMIT = the share per client; "
                   "gpuvirt's engines have no such cap on a tenant's own cudaMalloc")  # fmt: skip
    return r


def settle(hp: Any, timeout: float) -> None:
    """Until every VF is AVAIL (its engine restarted after the last tenant's fini or
    FLR), waiting on the host's events; DeviceError naming the states past the timeout."""
    deadline = time.monotonic() + timeout
    after = 0
    while (states := [v["state"] for v in hp.admin.status()["vfs"]]) != ["AVAIL"] * TENANTS:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeviceError(f"the host's VFs did not come back to AVAIL: {states}")
        evs = hp.admin.events(after=after, wait=min(left, 2.0))
        after = max((e["seq"] for e in evs), default=after)


def one_run(plan: FaultPlan, params: list[dict[str, Any]], env: dict[str, str]) -> dict[str, Any]:
    """Start the tenants, wait for them all, fault T0, watch, stop; judged."""
    procs: dict[str, subprocess.Popen[str]] = {}
    tenants = {f"T{i}": Tenant(f"T{i}") for i in range(TENANTS)}
    sel = selectors.DefaultSelector()

    logs = Path(tempfile.mkdtemp(prefix="gpuvirt-isolation-"))

    def start(name: str, p: dict[str, Any]) -> None:
        arg = json.dumps({**p, "seed": int(name[1:]) + 1,
                          "fault": plan.name if name == "T0" else None})  # fmt: skip
        with open(logs / f"{name}.log", "a") as err:  # the child keeps its own copy
            proc = subprocess.Popen(
                [sys.executable, "-m", "gpuvirt.bench.isolation_tenant", arg], env=env,
                text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
            )  # fmt: skip
        procs[name] = proc
        sel.register(proc.stdout, selectors.EVENT_READ, name)  # type: ignore[arg-type]

    def pump(until: float, stop_when: Any = None) -> None:
        while (left := until - time.monotonic()) > 0 and not (stop_when and stop_when()):
            for key, _ in sel.select(left):
                line = key.fileobj.readline()  # type: ignore[union-attr]
                if not line:
                    sel.unregister(key.fileobj)
                    continue
                ev = json.loads(line)
                tenants[key.data].events.append(ev)
                p = params[int(key.data[1:])]
                if ev["ev"] == "restart" and p["mode"] == "native":
                    procs.pop(key.data)  # a fresh process in its place, under its name
                    start(key.data, p)

    def said(name: str, ev: str) -> bool:
        return any(e["ev"] == ev for e in tenants[name].events)

    try:
        for i, p in enumerate(params):
            start(f"T{i}", p)
        pump(time.monotonic() + START_TIMEOUT_S, lambda: all(said(n, "ready") for n in tenants))
        if not all(said(n, "ready") for n in tenants):
            tails = {n: (logs / f"{n}.log").read_text()[-800:] for n in tenants}
            raise DeviceError(f"{plan.name}: tenants did not start; their stderr: {tails}")
        pump(time.monotonic() + BEFORE_S)
        fault_t = time.monotonic()
        _tell(procs["T0"], "fault")
        if plan.restart_neighbour:
            pump(fault_t + plan.after_s / 2, lambda: said("T0", "fault_result"))
            _tell(procs["T2"], "restart")
        end_t = fault_t + plan.after_s
        pump(end_t)
    finally:
        for proc in procs.values():
            _tell(proc, "stop")
        for name, proc in procs.items():
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                tenants[name].killed = True
            tenants[name].rc = proc.returncode
        shutil.rmtree(logs, ignore_errors=True)
    return outcome(plan, tenants, fault_t, end_t, SHARE)


def _tell(proc: subprocess.Popen[str], order: str) -> None:
    try:
        assert proc.stdin is not None
        proc.stdin.write(order + "\n")
        proc.stdin.flush()
    except (OSError, ValueError):
        pass  # it is gone; its events say how
