"""The device-bound half of the share benches: kernels that wait (bench/wait.py).

Shares, Jain's index and the work of N VFs against one alone, read from the
kernels' own progress logs, whose work is their own device ns: every VF's ns
is the same device time, so a VF's share of the work done in a window is its
share of the device, and the work done per ns of the window is the fraction of
it the device was busy with the VFs' kernels. The scheduler's accounting of the
same windows stands beside each figure (`_sched`).

On cuda, `native_rounds` runs the native baseline: the same CUDA kernels from
plain processes under the driver's time-slicing, one alone against N together,
alternating. Used by bench sched, flr and scale.
"""

from __future__ import annotations

import time
from typing import Any

from gpuvirt.bench.common import MIN_ROUNDS, Target, scratch_host, spread
from gpuvirt.bench.windows import busy_window, busy_windows, shares
from gpuvirt.bench.workers import IN_FLIGHT, Workers, work_between

WAIT_KERNEL_S = 0.001  # as the tenants: ~1 ms kernels, two in flight
EQUAL = 5  # digits Jain's index is rounded to


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0


def busy(window: dict[str, Any], keys: list[Any]) -> float:
    """The fraction of the window the device did these VFs' (or processes') kernels."""
    return sum(window["work"][k] for k in keys) / window["span_ns"]


def share_error_pp(got: dict[int, float], configured: dict[int, float]) -> float:
    return max(100 * abs(got[vf] - configured[vf]) for vf in configured)


def parse_weights(text: str) -> list[list[float]]:
    """`1:3,3:1,1:1,1:2:3:4` → [[1, 3], [3, 1], [1, 1], [1, 2, 3, 4]]; ValueError says why."""
    sets = []
    for part in text.split(","):
        try:
            ws = [float(w) for w in part.split(":")]
        except ValueError:
            raise ValueError(f"weights {part!r}: expected numbers joined by ':'") from None
        if len(ws) < 2 or any(w <= 0 for w in ws):
            raise ValueError(f"weights {part!r}: two or more VFs, every weight > 0")
        sets.append(ws)
    return sets


def weight_set(windows: list[dict[str, Any]], weights: list[float]) -> dict[str, Any]:
    """Configured against achieved share per VF over the rounds' windows of one set (the
    median round by the engines' error), the device's busy fraction, and Jain's index
    where the weights are equal; by the kernels' work and by the scheduler's accounting."""
    vfs = list(range(len(weights)))
    configured = {vf: w / sum(weights) for vf, w in enumerate(weights)}
    by = {"": "work", "_sched": "device_ns"}
    errs = {s: [share_error_pp(shares(w, vfs, k), configured) for w in windows]
            for s, k in by.items()}  # fmt: skip
    mid = sorted(range(len(windows)), key=lambda i: errs[""][i])[len(windows) // 2]
    busys = [busy(w, vfs) for w in windows]
    out: dict[str, Any] = {
        "weights": ":".join(f"{w:g}" for w in weights),
        "configured": _named(configured),
        "achieved": _named(shares(windows[mid], vfs, "work")),
        "achieved_sched": _named(shares(windows[mid], vfs, "device_ns")),
        "busy": spread(busys, 4)[1],
        "spread": {"busy": spread(busys, 4)},
    }
    for suffix in by:
        out[f"share_error_pp_max{suffix}"] = spread(errs[suffix], 3)[1]
        out["spread"][f"share_error_pp_max{suffix}"] = spread(errs[suffix], 3)
        if len(set(weights)) == 1:
            jains = [jain(list(shares(w, vfs, by[suffix]).values())) for w in windows]
            out[f"jain{suffix}"] = spread(jains, EQUAL)[1]
            out["spread"][f"jain{suffix}"] = spread(jains, EQUAL)
    return out


def _named(shares_: dict[int, float]) -> dict[str, float]:
    return {f"vf{vf}": round(v, 4) for vf, v in shares_.items()}


def native_window(n: int, seconds: float, kernel_s: float) -> dict[str, Any]:
    """n plain CUDA processes (bench/wait.py native_guest) through one window: the work
    each did inside it by its kernels' device-timed logs."""
    from gpuvirt.bench.wait import native_guest

    with Workers() as w:
        for i in range(n):
            w.start(native_guest, i, kernel_s, IN_FLIGHT)
        w.wait_ready(120)  # a CUDA context and a kernel compile per process
        t0 = time.monotonic_ns()
        time.sleep(seconds)
        t1 = time.monotonic_ns()
        reports = [r for r in w.stop() if r is not None]
    work = {r["index"]: work_between(r["progress"], t0, t1) for r in reports}
    return {"span_ns": t1 - t0, "work": {i: work.get(i, 0) for i in range(n)}}


def native_rounds(n: int, seconds: float, kernel_s: float = WAIT_KERNEL_S) -> dict[str, Any]:
    """The driver's time-slicing baseline: one process alone against n together,
    alternating over MIN_ROUNDS rounds; the busy fraction of each, their ratio, and Jain
    over the n processes' shares."""
    alone: list[float] = []
    together: list[float] = []
    ratios: list[float] = []
    jains: list[float] = []
    shares: dict[int, float] = {}
    for r in range(MIN_ROUNDS):
        got = {}
        for which in ("alone", "n") if r % 2 == 0 else ("n", "alone"):
            got[which] = native_window(1 if which == "alone" else n, seconds, kernel_s)
        a, many = busy(got["alone"], [0]), busy(got["n"], list(range(n)))
        alone.append(a)
        together.append(many)
        ratios.append(many / a if a else 0.0)
        total = sum(got["n"]["work"].values()) or 1
        shares = {i: got["n"]["work"][i] / total for i in range(n)}
        jains.append(jain(list(shares.values())))
    return {
        "processes": n,
        "busy_alone_wait": spread(alone, 4)[1],
        "busy_together_wait": spread(together, 4)[1],
        "work_ratio_wait": spread(ratios, 4)[1],
        "jain_equal_wait": spread(jains, EQUAL)[1],
        "shares_wait": {f"p{i}": round(v, 4) for i, v in shares.items()},
        "spread": {"busy_alone_wait": spread(alone, 4), "work_ratio_wait": spread(ratios, 4),
                   "jain_equal_wait": spread(jains, EQUAL)},
    }  # fmt: skip


def device_bound(
    quick: bool, backend: str, dev: dict[str, Any], sched: dict[str, Any]
) -> dict[str, Any]:
    """bench sched's runs with the device-bound workload: 8 VFs against one alone
    (alternating, one host), weighted 1,2,3,4, equal weights; on cuda the native
    baseline too. Returns figures (keys ending in _wait), spreads, targets and rows."""
    rounds = MIN_ROUNDS
    switch_s, weighted_s, equal_s = (1.0, 1.0, 1.0) if quick else (3.0, 10.0, 5.0)
    eight = list(range(8))
    ratios: list[float] = []
    busy8: list[float] = []
    lost_sched: list[float] = []
    with scratch_host(device=dev, sriov={"vf_num": 8}, scheduler=sched) as hp:
        for r in range(rounds):
            got = {}
            for which in ("alone", "eight") if r % 2 == 0 else ("eight", "alone"):
                vfs = [0] if which == "alone" else eight
                got[which] = busy_window(hp, vfs, switch_s, kernel_s=WAIT_KERNEL_S,
                                         workload="wait")  # fmt: skip
            alone, many = busy(got["alone"], [0]), busy(got["eight"], eight)
            ratios.append(many / alone if alone else 0.0)
            busy8.append(many)
            lost_sched.append(100 * got["eight"]["lost_ns"] / got["eight"]["span_ns"])
    wsched = {**sched, "policy": "weighted"}
    weights = [1.0, 2.0, 3.0, 4.0]
    vfcfg = [{"index": i, "weight": w} for i, w in enumerate(weights)]
    with scratch_host(device=dev, sriov={"vf_num": 4}, scheduler=wsched, vf=vfcfg) as hp:
        weighted = weight_set(_windows(hp, 4, weighted_s), weights)
    with scratch_host(device=dev, sriov={"vf_num": 4}, scheduler=wsched) as hp:
        equal = weight_set(_windows(hp, 4, equal_s), [1.0] * 4)
    spreads = {
        "work_ratio_wait": spread(ratios, 4),
        "overhead_pct_sched_wait": spread(lost_sched, 3),
        "share_error_pp_max_wait": weighted["spread"]["share_error_pp_max"],
        "share_error_pp_max_sched_wait": weighted["spread"]["share_error_pp_max_sched"],
        "jain_equal_wait": equal["spread"]["jain"],
        "jain_equal_sched_wait": equal["spread"]["jain_sched"],
    }
    figures: dict[str, Any] = {k: v[1] for k, v in spreads.items()}
    figures["share_achieved_wait"] = weighted["achieved"]
    figures["share_achieved_sched_wait"] = weighted["achieved_sched"]
    figures["equal_shares_wait"] = equal["achieved"]
    targets = [
        Target("share_error_pp_max_wait", figures["share_error_pp_max_wait"], 1.0, "<="),
        Target("jain_equal_wait", figures["jain_equal_wait"], 0.99, ">="),
        Target("work_ratio_wait", figures["work_ratio_wait"], 0.95, ">="),
    ]
    rows: list[tuple[str, Any, str]] = [
        ("device-bound: work of 8 VFs / 1 VF alone", figures["work_ratio_wait"], "×"),
        ("device-bound: largest share error, 1:2:3:4 (engine / scheduler)",
         f"{figures['share_error_pp_max_wait']} / {figures['share_error_pp_max_sched_wait']}",
         "pp"),
        ("device-bound: Jain's index, equal weights (engine / scheduler)",
         f"{figures['jain_equal_wait']} / {figures['jain_equal_sched_wait']}", ""),
    ]  # fmt: skip
    if backend == "cuda":
        native = native_rounds(8, switch_s)
        vs = [b / native["busy_alone_wait"] if native["busy_alone_wait"] else 0.0 for b in busy8]
        spreads["work_ratio_vs_native_wait"] = spread(vs, 4)
        figures["work_ratio_vs_native_wait"] = spreads["work_ratio_vs_native_wait"][1]
        figures["native"] = native
        targets.append(Target("work_ratio_vs_native_wait",
                              figures["work_ratio_vs_native_wait"], 0.95, ">="))  # fmt: skip
        rows.append(("device-bound: 8 VFs / one native process alone",
                     figures["work_ratio_vs_native_wait"], "×"))  # fmt: skip
        rows.append(("  native: 8 processes / one alone (driver time-slicing)",
                     native["work_ratio_wait"], "×"))  # fmt: skip
    return {"figures": figures, "spread": spreads, "targets": targets, "rows": rows}


def _windows(hp: Any, n: int, seconds: float) -> list[dict[str, Any]]:
    return busy_windows(hp, list(range(n)), seconds, MIN_ROUNDS, kernel_s=WAIT_KERNEL_S,
                        workload="wait")  # fmt: skip


def weight_sets(sets: list[list[float]], quick: bool, backend: str, dev: dict[str, Any],
                sched: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """`bench sched --weights`: each weight set with the device-bound workload on one
    host under `weighted` (weights set at run time; VFs beyond a set have no guest), its
    rounds' windows back to back; on cuda the native pair beside them."""
    seconds = 1.0 if quick else 5.0
    n = max(len(ws) for ws in sets)
    got = []
    with scratch_host(device=dev, sriov={"vf_num": n},
                      scheduler={**sched, "policy": "weighted"}) as hp:  # fmt: skip
        for ws in sets:
            for vf, w in enumerate(ws):
                hp.admin.vf_set(vf, weight=w)
            got.append(weight_set(_windows(hp, len(ws), seconds), ws))
    worst = max(g["share_error_pp_max"] for g in got)
    figures: dict[str, Any] = {"weight_sets": got, "share_error_pp_max_wait": worst}
    targets = [Target("share_error_pp_max_wait", worst, 1.0, "<=")]
    equal = [g["jain"] for g in got if "jain" in g]
    if equal:
        figures["jain_equal_wait"] = min(equal)
        targets.append(Target("jain_equal_wait", min(equal), 0.99, ">="))
    if backend == "cuda":
        native = native_rounds(2, seconds)
        figures["native"] = native
        for g in got:
            g["work_ratio_vs_native_wait"] = round(g["busy"] / native["busy_alone_wait"], 4)
    rows: list[tuple[str, Any, str]] = []
    for g in got:
        per = " ".join(f"{g['achieved'][k]:.3f}/{v:.3f}" for k, v in g["configured"].items())
        rows.append((f"weights {g['weights']}: achieved/configured per VF", per, ""))
        rows.append(("  largest share error (engine / scheduler)",
                     f"{g['share_error_pp_max']} / {g['share_error_pp_max_sched']}", "pp"))  # fmt: skip
    return {"figures": figures, "targets": targets, "rows": rows}
