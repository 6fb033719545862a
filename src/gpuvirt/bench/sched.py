"""bench sched: world-switch latency, device time lost to switching, share accuracy.

Three runs, each with real guest processes keeping their VFs busy:
1. 8 busy VFs, 6 ms slices: switch latency p50/p99 and device time lost to
   switching (the scheduler's own accounting), and the work the 8 VFs get
   done per second against one VF alone on the device (the baseline, same run).
2. `weighted` with weights 1,2,3,4: each VF's achieved share of device time
   against its configured share over 10 s, sampled over time for the plot.
3. equal weights: Jain's fairness index over the achieved shares.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from gpuvirt.bench.common import Result, Target, percentile, scratch_host
from gpuvirt.bench.workers import Workers, busy_guest
from gpuvirt.host.process import HostProcess

# Each busy kernel's wall length. emu preempts mid-kernel, so kernels may span many
# slices; cuda switches only at kernel boundaries, so its kernels must be shorter than one.
KERNEL_S = {"emu": 0.05, "cuda": 0.001}
SLICE_MS = 6
SETTLE_S = 1.0


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0


def busy_window(
    hp: HostProcess,
    vfs: list[int],
    seconds: float,
    sample_every: float = 0.0,
    kernel_s: float = 0.05,
) -> dict[str, Any]:
    """Keep `vfs` busy for `seconds`; scheduler snapshots at both ends (and between)."""
    with Workers() as w:
        for vf in vfs:
            w.start(busy_guest, str(hp.socket), vf, hp.token(vf), kernel_s)
        w.wait_ready()
        # Guests attach one at a time (FULLACCESS is exclusive) and the first start
        # working before the last are in: measure the steady state, not the arrival.
        time.sleep(SETTLE_S)
        first = hp.admin.request("GET", "/sched")
        samples = [first]
        end = time.monotonic() + seconds
        while sample_every and time.monotonic() + sample_every < end:
            time.sleep(sample_every)  # the sampling period of the share plot
            samples.append(hp.admin.request("GET", "/sched"))
        time.sleep(max(0.0, end - time.monotonic()))  # the measurement window itself
        last = hp.admin.request("GET", "/sched?latencies=1")
        samples.append(last)
        reports = w.stop()
    span = last["elapsed_ns"] - first["elapsed_ns"]
    dev = {
        int(vf): last["vfs"][vf]["device_ns"] - first["vfs"][vf]["device_ns"] for vf in last["vfs"]
    }
    return {
        "span_ns": span,
        "device_ns": dev,
        "lost_ns": last["lost_ns"] - first["lost_ns"],
        "switches": last["switches"] - first["switches"],
        "latencies_ns": last.get("latencies_ns", [])[-(last["switches"] - first["switches"]) :],
        "samples": samples,
        "reports": reports,
    }


def shares(window: dict[str, Any], vfs: list[int]) -> dict[int, float]:
    total = sum(window["device_ns"][vf] for vf in vfs) or 1
    return {vf: window["device_ns"][vf] / total for vf in vfs}


def shares_over_time(samples: list[dict[str, Any]], vfs: list[int]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"t": []}
    for vf in vfs:
        out[f"vf{vf}"] = []
    t0 = samples[0]["elapsed_ns"]
    for a, b in itertools.pairwise(samples):
        d = {vf: b["vfs"][str(vf)]["device_ns"] - a["vfs"][str(vf)]["device_ns"] for vf in vfs}
        tot = sum(d.values()) or 1
        out["t"].append((b["elapsed_ns"] - t0) / 1e9)
        for vf in vfs:
            out[f"vf{vf}"].append(d[vf] / tot)
    return out


def run(quick: bool = False, backend: str = "emu") -> Result:
    switch_s, weighted_s, equal_s = (2.0, 3.0, 2.0) if quick else (5.0, 10.0, 5.0)
    kernel_s = KERNEL_S.get(backend, 0.05)
    dev = {"backend": backend, "fb_total": "2GiB", "pf_fb": "64MiB"}
    sched = {"policy": "liquid", "time_slice_ms": SLICE_MS}

    # 1. switching: 8 busy VFs against one VF alone
    with scratch_host(device=dev, sriov={"vf_num": 8}, scheduler=sched) as hp:
        alone = busy_window(hp, [0], switch_s, kernel_s=kernel_s)
        eight = busy_window(hp, list(range(8)), switch_s, kernel_s=kernel_s)
    lat_us = [x / 1e3 for x in eight["latencies_ns"]]
    lost_pct = 100 * eight["lost_ns"] / eight["span_ns"]
    rate_alone = sum(r.work for r in alone["reports"]) / alone["span_ns"]
    rate_eight = sum(r.work for r in eight["reports"]) / eight["span_ns"]
    work_ratio = rate_eight / rate_alone if rate_alone else 0.0

    # 2. weighted 1,2,3,4
    weights = [1, 2, 3, 4]
    vfcfg = [{"index": i, "weight": w} for i, w in enumerate(weights)]
    wsched = {**sched, "policy": "weighted"}
    with scratch_host(device=dev, sriov={"vf_num": 4}, scheduler=wsched, vf=vfcfg) as hp:
        wwin = busy_window(hp, [0, 1, 2, 3], weighted_s, sample_every=0.5, kernel_s=kernel_s)
    achieved = shares(wwin, [0, 1, 2, 3])
    configured = {i: w / sum(weights) for i, w in enumerate(weights)}
    err_pp = {i: 100 * abs(achieved[i] - configured[i]) for i in configured}

    # 3. equal weights
    with scratch_host(device=dev, sriov={"vf_num": 4}, scheduler=wsched) as hp:
        ewin = busy_window(hp, [0, 1, 2, 3], equal_s, kernel_s=kernel_s)
    eq = shares(ewin, [0, 1, 2, 3])
    jain_equal = jain(list(eq.values()))

    p50, p99 = percentile(lat_us, 50), percentile(lat_us, 99)
    figures = {
        "switch_p50_us": round(p50, 1),
        "switch_p99_us": round(p99, 1),
        "switches": eight["switches"],
        "overhead_pct": round(lost_pct, 3),
        "work_ratio_8vf_vs_alone": round(work_ratio, 4),
        "share_configured": {f"vf{i}": round(v, 4) for i, v in configured.items()},
        "share_achieved": {f"vf{i}": round(v, 4) for i, v in achieved.items()},
        "share_error_pp": {f"vf{i}": round(v, 3) for i, v in err_pp.items()},
        "share_error_pp_max": round(max(err_pp.values()), 3),
        "jain_equal": round(jain_equal, 5),
        "equal_shares": {f"vf{i}": round(v, 4) for i, v in eq.items()},
        "seconds": {"switching": switch_s, "weighted": weighted_s, "equal": equal_s},
    }
    rows: list[tuple[str, Any, str]] = [
        ("world switch p50", p50, "µs"),
        ("world switch p99", p99, "µs"),
        ("device time lost to switching (8 VFs, 6 ms)", lost_pct, "%"),
        ("work of 8 VFs / 1 VF alone", work_ratio, "×"),
    ]
    for i in configured:
        rows.append((f"VF{i} weight {weights[i]}: achieved / configured",
                     f"{100 * achieved[i]:.2f}% / {100 * configured[i]:.2f}%", "share"))  # fmt: skip
    rows.append(("Jain's index, equal weights", jain_equal, ""))
    return Result(
        bench="sched",
        backend=backend,
        figures=figures,
        targets=[
            Target("switch_p50_us", round(p50, 1), 150, "<="),
            Target("switch_p99_us", round(p99, 1), 1000, "<="),
            Target("overhead_pct", round(lost_pct, 3), 2.0, "<="),
            Target("share_error_pp_max", round(max(err_pp.values()), 3), 1.0, "<="),
            Target("jain_equal", round(jain_equal, 5), 0.99, ">="),
        ],
        rows=rows,
        series={
            "switch_latency_us": lat_us,
            "shares_over_time": shares_over_time(wwin["samples"], [0, 1, 2, 3]),
            "weights": weights,
        },
    )
