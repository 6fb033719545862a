"""The benchmarks at tiny sizes: real hosts, guests and engines; the JSON they print has the
keys DESIGN.md names and values consistent with each other. No timing thresholds: the
figures themselves belong to a quiet machine, what is checked here is how they are made."""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuvirt.bench import launch, netgpu, netgpu_figures, netgpu_send
from gpuvirt.bench.common import machine, spread
from gpuvirt.bench.flr import run as flr_run
from gpuvirt.bench.scale import fb_memory, pss_bytes
from gpuvirt.bench.sched import busy_windows, disagreement_pp, jain, shares
from gpuvirt.bench.sched import run as sched_run
from gpuvirt.bench.sched_wait import WAIT_KERNEL_S, busy, parse_weights, weight_set
from gpuvirt.bench.wait import EMU_GAP_NS
from gpuvirt.bench.windows import foreign_ns
from gpuvirt.bench.workers import (
    CHECKPOINT_NS,
    THROUGH_NS,
    device_ns,
    running_rate,
    spin_log,
    switch_gaps,
    work_between,
)
from helpers import MakeHost

MACHINE_KEYS = {"cpu", "cores", "kernel", "backend", "sandbox", "virt", "syscall_ns"}


def assert_spread(spreads: dict[str, list[float]], figures: dict[str, object]) -> None:
    for name, (lo, mid, hi) in spreads.items():
        assert lo <= mid <= hi, (name, lo, mid, hi)
        if name in figures:  # the headline is the median of its rounds
            assert figures[name] == mid, name


# ---- pure pieces ------------------------------------------------------------------------


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=30))
def test_spread_is_min_median_max(xs: list[float]) -> None:
    lo, mid, hi = spread(xs, 9)
    assert lo == round(min(xs), 9) and hi == round(max(xs), 9)
    assert lo <= mid <= hi


@given(
    st.lists(st.integers(0, 1000), min_size=1, max_size=40),
    st.lists(st.integers(0, 50_000), min_size=3, max_size=3),
)
def test_work_between_is_additive_and_never_negative(steps: list[int], cuts: list[int]) -> None:
    t = itertools.accumulate(steps)
    progress = list(zip((1000 * i for i in range(len(steps))), t, strict=False))
    a, b, c = sorted(cuts)
    ab, bc, ac = (work_between(progress, x, y) for x, y in ((a, b), (b, c), (a, c)))
    assert ab >= 0 and bc >= 0
    assert ab + bc == ac
    assert work_between(progress, -1, 10**9) == progress[-1][1]


def logged_run(rate: float, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The log spin_log writes for a kernel that runs at `rate` iterations per ns through
    each (stopped ns, running ns) in turn: a checkpoint every CHECKPOINT_NS while it runs,
    none while it is stopped, the next one as it resumes."""
    log, t, n, nxt = [], 0, 0.0, 0
    for stopped, running in runs:
        t += stopped
        end = t + running
        while True:
            nxt = max(nxt, t)
            if nxt > end:
                n += rate * (end - t)
                t = end
                break
            n += rate * (nxt - t)
            t = nxt
            log.append((t, int(n)))
            nxt = t + CHECKPOINT_NS
    return log


@given(
    st.floats(0.5, 50.0),
    st.lists(st.tuples(st.one_of(st.just(0), st.integers(THROUGH_NS, 50_000_000)),
                       st.integers(1_000_000, 20_000_000)),
             min_size=1, max_size=12),
)  # fmt: skip
def test_device_time_from_the_log_is_the_time_the_kernel_ran(
    rate: float, runs: list[tuple[int, int]]
) -> None:
    """However long its stops, the device time read back from a kernel's log is the time it
    ran, to within a checkpoint at each end of the window; and its rate is the one it ran at.
    (A stop shorter than THROUGH_NS is, by design, not told from running.)"""
    log = logged_run(rate, runs)
    got = running_rate(log, log[0][0], log[-1][0])
    assert got is not None and abs(got - rate) <= rate * 0.01
    ran = sum(r for _, r in runs)
    est = device_ns(log, -1, log[-1][0] + 1, got)
    assert abs(est - ran) <= 2 * CHECKPOINT_NS + ran * 0.01


@given(
    st.lists(st.floats(0.5, 50.0), min_size=3, max_size=3),
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2_000_000),
                       st.integers(1_000_000, 8_000_000)),
             min_size=2, max_size=16),
)  # fmt: skip
def test_switch_gaps_from_the_logs_are_the_times_between_two_vfs_turns(
    rates: list[float], turns: list[tuple[int, int, int]]
) -> None:
    """VFs take turns on one device, each (vf, gap before it, running ns): the switches
    read back from their kernels' logs are the gaps between two turns of different VFs,
    each to within the rate's error over a checkpoint."""
    turns = [t for i, t in enumerate(turns) if i == 0 or t[0] != turns[i - 1][0]]
    runs: dict[int, list[tuple[int, int]]] = {0: [], 1: [], 2: []}
    last_end, t = dict.fromkeys(runs, 0), 0
    expected = []
    for i, (vf, gap, running) in enumerate(turns):
        t += gap
        if i:
            expected.append(gap)
        runs[vf].append((t - last_end[vf], running))
        t += running
        last_end[vf] = t
    logs = {vf: logged_run(rates[vf], r) for vf, r in runs.items() if r}
    for vf, log in logs.items():  # as spin_log, a last checkpoint where the kernel ends
        log.append((last_end[vf], int(rates[vf] * sum(run for _, run in runs[vf]))))
    got = switch_gaps(logs, -1, t + 1)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert abs(g - e) <= 0.02 * CHECKPOINT_NS, (got, expected)


def test_no_rate_without_a_stretch_the_kernel_ran_through() -> None:
    assert running_rate([(0, 0), (10 * CHECKPOINT_NS, 5)], 0, 10 * CHECKPOINT_NS) is None
    assert device_ns([(0, 0), (10, 5)], 0, 10, 0.0) == 0.0


def test_spin_log_is_a_cumulative_record_in_its_own_clock() -> None:
    log = spin_log(None, 0.02, checkpoint_ns=2_000_000)
    times = [t for t, _ in log]
    work = [n for _, n in log]
    assert times == sorted(times) and work == sorted(work)
    assert log[-1][0] - log[0][0] >= 20_000_000
    assert len(log) >= 5 and work[-1] > 0


# A child that runs emu's device-bound kernel back to back, one JSON log per line, until
# its stdin closes: a process the test can stop with SIGSTOP, as the scheduler stops an
# engine.
WAIT_CHILD = """
import json, select, sys
import numpy as np
from gpuvirt.bench.wait import wait_log
while not select.select([sys.stdin], [], [], 0)[0]:
    print(json.dumps(wait_log(np, 0.02)), flush=True)
"""
STOP_S = 0.1


@pytest.mark.timeout(60)
def test_wait_log_counts_its_own_time_and_not_a_stop() -> None:
    """emu's device-bound kernel counts, step by step, the wall time it held the device
    (its own wake-up late included, as a GPU kernel holds the device for all of its
    time), and nothing of a step a stop cut: the stopped time is not its work."""
    import json
    import signal
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", WAIT_CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        logs = [json.loads(child.stdout.readline())]  # running: kernels back to back
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(STOP_S)  # the stop's length: what must not be counted
        os.kill(child.pid, signal.SIGCONT)
        logs += [json.loads(child.stdout.readline()) for _ in range(3)]
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    for log in logs:
        times = [t for t, _ in log]
        assert times == sorted(times) and log[0][1] == 0 and log[-1][1] >= 0.02 * 1e9
        for (ta, na), (tb, nb) in itertools.pairwise(log):
            assert nb - na == (tb - ta if tb - ta < EMU_GAP_NS else 0), (ta, na, tb, nb)
    # the stop fell inside a kernel (a step that counted nothing) or between two; either
    # way the kernels' own time leaves it out
    span = logs[-1][-1][0] - logs[0][0][0]
    assert sum(log[-1][1] for log in logs) <= span - STOP_S * 1e9


def test_weights_parse_and_refuse_what_is_not_a_weight_set() -> None:
    assert parse_weights("1:3,3:1,1:1,1:2:3:4") == [[1, 3], [3, 1], [1, 1], [1, 2, 3, 4]]
    assert parse_weights("0.5:2") == [[0.5, 2.0]]
    for bad in ("1", "1:0", "a:b", "1:3,", "-1:2"):
        with pytest.raises(ValueError, match="weights"):
            parse_weights(bad)


def test_weight_set_compares_configured_and_achieved_per_vf() -> None:
    """Three rounds' windows of a 1:3 set whose work and scheduler's time are known."""

    def window(work: tuple[int, int], sched: tuple[int, int]) -> dict[str, object]:
        return {"span_ns": 10_000, "work": dict(enumerate(work)),
                "device_ns": dict(enumerate(sched))}  # fmt: skip

    wins = [window((25, 75), (24, 76)), window((26, 74), (25, 75)), window((20, 80), (25, 75))]
    got = weight_set(wins, [1.0, 3.0])
    assert got["weights"] == "1:3" and got["configured"] == {"vf0": 0.25, "vf1": 0.75}
    assert got["share_error_pp_max"] == 1.0  # the median round: 0, 1, 5 pp
    assert got["achieved"] == {"vf0": 0.26, "vf1": 0.74}
    assert got["spread"]["share_error_pp_max"] == [0.0, 1.0, 5.0]
    assert got["share_error_pp_max_sched"] == 0.0 and "jain" not in got
    assert got["busy"] == busy(wins[0], [0, 1]) == 0.01
    equal = weight_set(wins[:1], [1.0, 1.0])
    assert equal["jain"] == pytest.approx(jain([0.25, 0.75]), abs=1e-5) and "jain_sched" in equal


def test_machine_names_what_the_figures_were_measured_on() -> None:
    m = machine("emu")
    assert set(m) >= MACHINE_KEYS
    assert m["cores"] == os.cpu_count() and m["backend"] == "emu"
    assert isinstance(m["syscall_ns"], float) and m["syscall_ns"] > 0


def test_netgpu_result_judges_every_mode_and_stream_count() -> None:
    trials = [
        {"mode": mode, "path": path, "streams": n, "rep": rep,
         "gbytes_per_s": 2.0 if path != "zerocopy" else 2.0 * (0.9 if mode == "raw" else 1.0),
         "cpu_s_per_gb": {"zerocopy": 0.1 * (1.0 + 0.01 * n), "raw-lowat": 0.08}.get(path, 0.1),
         **({"fragments_per_gb": 1000.0 * n} if path == "zerocopy" else {})}
        for rep in range(3) for mode in netgpu_figures.MODES for n in netgpu_figures.STREAMS
        for path in netgpu_figures.PATHS
    ]  # fmt: skip
    r = netgpu_figures.result(trials, "emu", 1 << 20, 3, "userspace", ["raw·1"], "setup")
    r = r.to_json()
    assert {row["mode"] for row in r["rows"]} == {"framed", "raw"}
    assert {row["streams"] for row in r["rows"]} == {1, 2, 4}
    assert r["throughput_ratio"] == pytest.approx(0.9)  # the raw-mode rows, the worst
    assert r["cpu_ratio"] == pytest.approx(1.04)  # 4 streams, the worst
    assert r["cpu_ratio_lowat"] == pytest.approx(1.3)  # reported beside it, never judged
    # the staged rows are judged against raw like zerocopy (their figures: 1.0 and 1.0 here)
    assert set(r["targets"]) == {
        "throughput_ratio",
        "cpu_ratio",
        "staged_throughput_ratio",
        "staged_cpu_ratio",
    }
    assert r["staged_throughput_ratio"] == 1.0 and r["staged_cpu_ratio"] == 1.0
    assert r["staged_verified"] == ["raw·1"]
    assert {row["streams"]: row["fragments_per_gb"] for row in r["rows"]
            if row["path"] == "zerocopy"} == {1: 1000, 2: 2000, 4: 4000}  # fmt: skip
    assert r["rounds"] == 3 and set(r["machine"]) >= MACHINE_KEYS
    assert_spread(r["spread"], r)
    assert r["targets"]["throughput_ratio"]["met"] is False


def test_netgpu_staged_rows_say_what_one_cpu_shared_with_the_engine_allows() -> None:
    """shared_cpu_gbps = 1 / (receiver + engine CPU per GB), per trial, then the median."""
    trials = [
        {"mode": mode, "path": path, "streams": n, "rep": rep, "gbytes_per_s": 3.0,
         "cpu_s_per_gb": 0.2 if path == "staged" else 0.1,
         "engine_cpu_s_per_gb": (0.05 * (rep + 1)) if path == "staged" else 0.0,
         **({"fragments_per_gb": 1000.0} if path == "zerocopy" else {})}
        for rep in range(3) for mode in netgpu_figures.MODES for n in netgpu_figures.STREAMS
        for path in netgpu_figures.PATHS
    ]  # fmt: skip
    r = netgpu_figures.result(trials, "emu", 1 << 20, 3, "userspace", [], "setup").to_json()
    staged = [row for row in r["rows"] if row["path"] == "staged"]
    assert len(staged) == 6
    assert all(row["shared_cpu_gbps"] == pytest.approx(1 / 0.3, abs=1e-3) for row in staged)
    assert not any("shared_cpu_gbps" in row for row in r["rows"] if row["path"] != "staged")


# ---- real runs ----------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_launch_bench_pins_both_placements_and_reports_rounds() -> None:
    r = launch.run(quick=True).to_json()
    for key in ("p50_us", "p99_us", "floor_p50_us", "rounds", "spread", "machine", "placement"):
        assert key in r, key
    assert r["rounds"] >= 3
    assert set(r["machine"]) >= MACHINE_KEYS
    assert_spread(r["spread"], r)
    names = list(r["placements"])
    assert "together" in names and r["placement"] == names[0]
    if len(os.sched_getaffinity(0)) > 1:
        assert names == ["apart", "together"]
        apart = r["placements"]["apart"]
        assert apart["guest_cpu"] not in apart["engine_cpus"]
    together = r["placements"]["together"]
    assert together["guest_cpu"] in together["engine_cpus"]
    for p in r["placements"].values():
        assert all(v >= 0 for v in p["ctx_switches_per_launch"].values())
        sp = p["spread"]
        assert sp["p50_us"][0] <= sp["p99_us"][2]
    assert r["targets"]["ratio_p50"]["value"] == r["ratio_p50"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("workload", "kernel_s", "key"),
                         [("spin", 0.02, "engine_ns"), ("wait", WAIT_KERNEL_S, "work")])  # fmt: skip
def test_engine_measured_shares_sum_to_one_beside_the_schedulers(
    make_host: MakeHost, workload: str, kernel_s: float, key: str
) -> None:
    hp = make_host(sriov={"vf_num": 3}, scheduler={"policy": "weighted", "time_slice_ms": 6})
    vfs = [0, 1, 2]
    windows = busy_windows(hp, vfs, 0.4, windows=3, kernel_s=kernel_s, workload=workload)
    assert len(windows) == 3
    for a, b in itertools.pairwise(windows):
        assert a["span_ns"] > 0 and b["span_ns"] > 0
    for w in windows:
        eng, sch = shares(w, vfs, key), shares(w, vfs, "device_ns")
        assert sum(eng.values()) == pytest.approx(1.0)
        assert sum(sch.values()) == pytest.approx(1.0)
        # every busy VF got work done, by its own kernels' count
        assert all(w["work"][vf] > 0 for vf in vfs)
        if key == "engine_ns":
            gap = disagreement_pp(w, vfs)
            assert gap == pytest.approx(max(100 * abs(eng[v] - sch[v]) for v in vfs))
        else:  # the device-bound work is the kernels' own device ns, one engine running
            # at a time: never more than the window, but for the step across its start
            assert 0 < busy(w, vfs) <= 1 + EMU_GAP_NS / w["span_ns"]
        assert 0 < jain(list(eng.values())) <= 1.0 + 1e-9


@pytest.mark.timeout(120)
def test_fb_memory_untouched_touched_and_scrubbed(make_host: MakeHost) -> None:
    hp = make_host(sriov={"vf_num": 2})
    fb = fb_memory(hp, 1)
    assert fb["untouched"] < fb["touched"]
    assert fb["touched"] - fb["untouched"] >= 32 << 20
    assert fb["after_scrub"] == fb["untouched"]
    engine = hp.status()["vfs"][0]["engine_pid"]
    assert pss_bytes(engine) > 0


@pytest.mark.timeout(600)
def test_flr_bench_reports_every_neighbour_and_the_schedulers_view() -> None:
    r = flr_run(quick=True).to_json()
    assert r["rounds"] >= 3
    assert len(r["neighbour_share_ratios"]) == 2 * r["rounds"]
    assert len(r["neighbour_share_ratios_sched"]) == 2 * r["rounds"]
    assert all(x >= 0 for x in r["neighbour_share_ratios"])
    assert_spread(r["spread"], r)
    assert r["neighbour_share_ratio"] == r["spread"]["neighbour_share_ratio"][1]
    assert set(r["machine"]) >= MACHINE_KEYS
    # the same FLRs beside device-bound neighbours, judged the same way
    assert len(r["neighbour_share_ratios_wait"]) == 2 * r["rounds"]
    assert r["neighbour_share_ratio_wait"] == r["spread"]["neighbour_share_ratio_wait"][1]
    assert {"neighbour_share_ratio", "neighbour_share_ratio_wait"} <= set(r["targets"])
    assert "native" not in r  # emu: no driver to time-slice


@pytest.mark.timeout(300)
def test_sched_weight_sets_give_configured_and_achieved_per_vf() -> None:
    """`bench sched --weights` (gpu-check's share step): each set, device-bound, on emu."""
    r = sched_run(quick=True, weights="1:3,1:1").to_json()
    sets = r["weight_sets"]
    assert [s["weights"] for s in sets] == ["1:3", "1:1"]
    assert sets[0]["configured"] == {"vf0": 0.25, "vf1": 0.75}
    for s in sets:
        assert set(s["achieved"]) == set(s["configured"]) == set(s["achieved_sched"])
        assert sum(s["achieved"].values()) == pytest.approx(1.0, abs=1e-3)
        assert 0 < s["busy"] <= 1
    assert r["share_error_pp_max_wait"] == max(s["share_error_pp_max"] for s in sets)
    assert r["jain_equal_wait"] == sets[1]["jain"]
    assert set(r["targets"]) == {"share_error_pp_max_wait", "jain_equal_wait"}
    assert r["rounds"] >= 3 and set(r["machine"]) >= MACHINE_KEYS
    assert_spread(r["spread"], r)


@pytest.mark.timeout(180)
def test_netgpu_trials_take_every_stream_count_on_every_path(make_host: MakeHost) -> None:
    import multiprocessing as mp

    import gpuvirt

    hp = make_host(sriov={"vf_num": 1})
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    sender = ctx.Process(target=netgpu_send.sender_main, args=(child,), daemon=True)
    sender.start()
    try:
        with gpuvirt.attach(0, socket=hp.socket, token=hp.token(0)) as gpu:
            paths = netgpu._Paths(gpu)
            for mode in netgpu.MODES:
                for path in netgpu.PATHS:
                    t = netgpu._trial(paths, parent, mode, path, max(netgpu.STREAMS), 8 << 20, 0)
                    assert t["gbytes_per_s"] > 0 and t["cpu_s_per_gb"] >= 0
                    assert (t.get("fragments_per_gb", 0) > 0) == (path == "zerocopy"), t
    finally:
        parent.send(None)
        sender.join(10)


def test_foreign_work_on_the_device_cpu_is_its_busy_time_less_the_engines() -> None:
    """What ran on emu's device CPU beside the engines (another host, a test run): the
    CPU's busy time over the window less each engine's own, one that started in the
    window counted from zero; None on a device that is not one of our CPUs."""
    before = (1_000, {11: 100, 12: 200})
    after = (5_000, {11: 1_100, 12: 1_200, 13: 500})
    assert foreign_ns(before, after) == 4_000 - (1_000 + 1_000 + 500)
    assert foreign_ns(None, after) is None and foreign_ns(before, None) is None
