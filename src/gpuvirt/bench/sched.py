"""bench sched: world-switch latency, device time lost to switching, share accuracy.

Three runs, each with real guest processes keeping their VFs busy:
1. 8 busy VFs, 6 ms slices: switch latency p50/p99; device time lost to
   switching: the share of the window the 8 VFs' kernels had the device, by
   their own logs, against one VF's alone (the baseline, alternating on the
   same host), with the scheduler's count of time inside switches beside it;
   and the work the 8 VFs got done per second against one VF alone.
2. `weighted` with weights 1,2,3,4: each VF's achieved share of device time
   against its configured share over 10 s, sampled over time for the plot.
3. equal weights: Jain's fairness index over the achieved shares.
Then the same three with kernels that wait on the device instead of spinning
(bench/sched_wait.py; keys ending in _wait), and on cuda the native baseline.
`--weights SETS` runs only those weight sets, device-bound (gpu-check's share step).
"""

from __future__ import annotations

import itertools
from typing import Any

from gpuvirt.bench.common import MIN_ROUNDS, Result, Target, percentile, scratch_host, spread
from gpuvirt.bench.sched_wait import device_bound, jain, parse_weights, weight_sets
from gpuvirt.bench.windows import busy_window, busy_windows, shares

# Each busy kernel's wall length. emu preempts mid-kernel, so kernels may span many
# slices; cuda switches only at kernel boundaries, so its kernels must be shorter than one.
KERNEL_S = {"emu": 0.05, "cuda": 0.001}
SLICE_MS = 6
DISAGREE_PP = 1.0  # engine vs scheduler shares: a gap over this is reported
FOREIGN_MS = 50.0  # ms of other work on the device CPU in a switching window: said (10 ms ticks)


def busy_fraction(window: dict[str, Any], vfs: list[int]) -> float:
    """The fraction of the window the VFs' kernels had the device, by their own logs."""
    return sum(window["engine_ns"][vf] for vf in vfs) / window["span_ns"]


def switching_overhead(alone: dict[str, Any], many: dict[str, Any], vfs: list[int]) -> float:
    """Device time lost to switching among `vfs`, in %: how much less of the device their
    kernels had than one VF's alone on the same host (the windows' own device time, so the
    machine running faster in one window than in the other does not count)."""
    return 100 * (1 - busy_fraction(many, vfs) / busy_fraction(alone, [vfs[0]]))


def disagreement_pp(window: dict[str, Any], vfs: list[int]) -> float:
    """The largest gap, in percentage points, between a VF's share by its kernels' own log
    and by the scheduler's accounting."""
    eng, sch = shares(window, vfs), shares(window, vfs, "device_ns")
    return max(100 * abs(eng[vf] - sch[vf]) for vf in vfs)


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


def run(quick: bool = False, backend: str = "emu", weights: str | None = None) -> Result:
    """weights (`--weights 1:3,3:1,...`): only those weight sets, device-bound."""
    rounds = MIN_ROUNDS
    switch_s, weighted_s, equal_s = (1.0, 1.0, 1.0) if quick else (5.0, 10.0, 5.0)
    kernel_s = KERNEL_S.get(backend, 0.05)
    dev = {"backend": backend, "fb_total": "2GiB", "pf_fb": "64MiB"}
    sched = {"policy": "liquid", "time_slice_ms": SLICE_MS}
    if weights is not None:
        return _weight_sets(parse_weights(weights), quick, backend, dev, sched)

    # 1. switching: 8 busy VFs against one VF alone, alternating, on one host
    lat_us: list[float] = []
    per_round = ("work_ratio", "lost_engine", "lost_sched", "lost_alone",
                 "p50", "p99", "p50_sched", "p99_sched", "foreign_ms")  # fmt: skip
    sw: dict[str, list[float]] = {k: [] for k in per_round}
    with scratch_host(device=dev, sriov={"vf_num": 8}, scheduler=sched) as hp:
        for r in range(rounds):
            got = {}
            for which in ("alone", "eight") if r % 2 == 0 else ("eight", "alone"):
                vfs = [0] if which == "alone" else list(range(8))
                got[which] = busy_window(hp, vfs, switch_s, kernel_s=kernel_s)
            alone, eight = got["alone"], got["eight"]
            rate_alone = sum(alone["work"].values()) / alone["span_ns"]
            rate_eight = sum(eight["work"].values()) / eight["span_ns"]
            ratio = rate_eight / rate_alone if rate_alone else 0.0
            lat = [x / 1e3 for x in eight["gaps_ns"]]
            lat_sched = [x / 1e3 for x in eight["latencies_ns"]]
            lat_us += lat
            sw["work_ratio"].append(ratio)
            sw["lost_engine"].append(switching_overhead(alone, eight, list(range(8))))
            sw["lost_alone"].append(100 * (1 - busy_fraction(alone, [0])))
            sw["lost_sched"].append(100 * eight["lost_ns"] / eight["span_ns"])
            sw["p50"].append(percentile(lat, 50))
            sw["p99"].append(percentile(lat, 99))
            sw["p50_sched"].append(percentile(lat_sched, 50))
            sw["p99_sched"].append(percentile(lat_sched, 99))
            if eight["foreign_ns"] is not None:  # emu: the device is one of our CPUs
                sw["foreign_ms"].append(eight["foreign_ns"] / 1e6)

    # 2. weighted 1,2,3,4
    weights = [1, 2, 3, 4]
    vf4 = [0, 1, 2, 3]
    vfcfg = [{"index": i, "weight": w} for i, w in enumerate(weights)]
    wsched = {**sched, "policy": "weighted"}
    configured = {i: w / sum(weights) for i, w in enumerate(weights)}
    with scratch_host(device=dev, sriov={"vf_num": 4}, scheduler=wsched, vf=vfcfg) as hp:
        wwins = busy_windows(hp, vf4, weighted_s, rounds, sample_every=0.5, kernel_s=kernel_s)
    err_eng = [max(100 * abs(shares(w, vf4)[i] - configured[i]) for i in vf4) for w in wwins]
    err_sch = [
        max(100 * abs(shares(w, vf4, "device_ns")[i] - configured[i]) for i in vf4) for w in wwins
    ]
    mid = _median_index(err_eng)
    achieved, achieved_sched = shares(wwins[mid], vf4), shares(wwins[mid], vf4, "device_ns")

    # 3. equal weights
    with scratch_host(device=dev, sriov={"vf_num": 4}, scheduler=wsched) as hp:
        ewins = busy_windows(hp, vf4, equal_s, rounds, kernel_s=kernel_s)
    jains = [jain(list(shares(w, vf4).values())) for w in ewins]
    jains_sched = [jain(list(shares(w, vf4, "device_ns").values())) for w in ewins]
    eq = shares(ewins[_median_index(jains)], vf4)

    disagree = {
        "weighted": spread([disagreement_pp(w, vf4) for w in wwins], 3),
        "equal": spread([disagreement_pp(w, vf4) for w in ewins], 3),
    }
    spreads = {
        "switch_p50_us": spread(sw["p50"], 1),
        "switch_p99_us": spread(sw["p99"], 1),
        "switch_p50_us_sched": spread(sw["p50_sched"], 1),
        "switch_p99_us_sched": spread(sw["p99_sched"], 1),
        "overhead_pct": spread(sw["lost_engine"], 3),
        "overhead_pct_sched": spread(sw["lost_sched"], 3),
        "alone_lost_pct": spread(sw["lost_alone"], 3),
        "work_ratio_8vf_vs_alone": spread(sw["work_ratio"], 4),
        "share_error_pp_max": spread(err_eng, 3),
        "share_error_pp_max_sched": spread(err_sch, 3),
        "jain_equal": spread(jains, 5),
        "jain_equal_sched": spread(jains_sched, 5),
    }
    if sw["foreign_ms"]:  # emu: the device is one of this machine's CPUs
        spreads["device_cpu_foreign_ms"] = spread(sw["foreign_ms"], 1)
    med = {k: v[1] for k, v in spreads.items()}
    worst_disagree = max(v[2] for v in disagree.values())
    figures = {
        **med,
        "switches": len(lat_us),
        "rounds": rounds,
        "spread": spreads,
        "share_configured": {f"vf{i}": round(v, 4) for i, v in configured.items()},
        "share_achieved": {f"vf{i}": round(v, 4) for i, v in achieved.items()},
        "share_achieved_sched": {f"vf{i}": round(v, 4) for i, v in achieved_sched.items()},
        "equal_shares": {f"vf{i}": round(v, 4) for i, v in eq.items()},
        "engine_vs_sched_disagreement_pp": disagree,
        "engine_vs_sched_disagrees": worst_disagree > DISAGREE_PP,
        "seconds": {"switching": switch_s, "weighted": weighted_s, "equal": equal_s},
    }
    rows: list[tuple[str, Any, str]] = [
        ("world switch p50, by the engines' own logs", med["switch_p50_us"], "µs"),
        ("world switch p99, by the engines' own logs", med["switch_p99_us"], "µs"),
        ("  p50 / p99 by the scheduler (IDLE issued to RUN issued)",
         f"{med['switch_p50_us_sched']} / {med['switch_p99_us_sched']}", "µs"),
        ("device time lost to switching (8 VFs, 6 ms), by the engines' own logs",
         med["overhead_pct"], "%"),
        ("  the same by the scheduler's accounting", med["overhead_pct_sched"], "%"),
        ("  one VF alone: device time its kernels did not have", med["alone_lost_pct"], "%"),
        ("work of 8 VFs / 1 VF alone", med["work_ratio_8vf_vs_alone"], "×"),
    ]  # fmt: skip
    for i in configured:
        rows.append((f"VF{i} weight {weights[i]}: achieved (engine / scheduler) / configured",
                     f"{100 * achieved[i]:.2f}% / {100 * achieved_sched[i]:.2f}% / "
                     f"{100 * configured[i]:.2f}%", "share"))  # fmt: skip
    rows.append(("largest share error (engine)", med["share_error_pp_max"], "pp"))
    rows.append(("  by the scheduler's accounting", med["share_error_pp_max_sched"], "pp"))
    rows.append(("Jain's index, equal weights (engine)", med["jain_equal"], ""))
    rows.append(("  by the scheduler's accounting", med["jain_equal_sched"], ""))
    # the same measures with kernels that wait on the device (bench/sched_wait.py)
    wait = device_bound(quick, backend, dev, sched)
    figures.update(wait["figures"])
    spreads.update(wait["spread"])
    rows += wait["rows"]
    notes = [
        f"{rounds} rounds; switching alternates one VF alone and 8 VFs on one host; shares "
        "and lost time come from the kernels' own progress logs (their work, at the rate "
        "each ran uninterrupted in the same window), the scheduler's accounting of the "
        "same windows beside them; headline = median",
        "kernels end by their own device time (thread CPU time), two in flight per guest",
        "_wait figures: device-bound kernels (emu: sleeps; cuda: a %globaltimer kernel), "
        "shares of the work their own logs show, the scheduler's accounting beside them",
        "switch latency: from the last instruction of the VF stopped to the first of the "
        "next, by their kernels' logs; the scheduler's own figure (IDLE issued to RUN "
        "issued; a posted stop lands after it) beside it",
    ]
    if max(sw["foreign_ms"], default=0.0) > FOREIGN_MS:
        notes.append(
            f"the device's CPU ran up to {max(sw['foreign_ms']):.0f} ms of other work than "
            f"the engines' in a switching window (> {FOREIGN_MS} ms): a continued VF waits "
            "behind it, so the kernels' switch latency includes it (not the scheduler's); "
            "rerun on a quiet machine"
        )
    if worst_disagree > DISAGREE_PP:
        notes.append(
            f"engine and scheduler shares disagree by up to {worst_disagree:.2f} pp "
            f"(> {DISAGREE_PP} pp): the scheduler's device time is not what the VFs got done"
        )
    return Result(
        bench="sched",
        backend=backend,
        figures=figures,
        targets=[
            Target("switch_p50_us", med["switch_p50_us"], 150, "<="),
            Target("switch_p99_us", med["switch_p99_us"], 1000, "<="),
            Target("overhead_pct", med["overhead_pct"], 2.0, "<="),
            Target("share_error_pp_max", med["share_error_pp_max"], 1.0, "<="),
            Target("jain_equal", med["jain_equal"], 0.99, ">="),
            *wait["targets"],
        ],
        rows=rows,
        notes=notes,
        series={
            "switch_latency_us": lat_us,
            "shares_over_time": shares_over_time(wwins[mid]["samples"], vf4),
            "weights": weights,
        },
    )


def _median_index(xs: list[float]) -> int:
    return sorted(range(len(xs)), key=lambda i: xs[i])[len(xs) // 2]


def _weight_sets(sets: list[list[float]], quick: bool, backend: str, dev: dict[str, Any],
                 sched: dict[str, Any]) -> Result:  # fmt: skip
    got = weight_sets(sets, quick, backend, dev, sched)
    return Result(
        bench="sched",
        backend=backend,
        figures={**got["figures"], "rounds": MIN_ROUNDS,
                 "spread": {f"{k}@{g['weights']}": v for g in got["figures"]["weight_sets"]
                            for k, v in g["spread"].items()}},
        targets=got["targets"],
        rows=got["rows"],
        notes=[
            "--weights: each set under `weighted`, device-bound kernels (emu: sleeps; cuda: "
            "a %globaltimer kernel), configured against achieved share per VF by the "
            "kernels' own logs, the scheduler's accounting beside them; median of the rounds",
        ],
    )  # fmt: skip
