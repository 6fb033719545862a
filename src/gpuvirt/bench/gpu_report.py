"""`scripts/gpu-check --report`: a GPU run's JSON as bench/results/<date>-h200.md.

Every figure of the run beside its emu counterpart (the same key of the same
bench in an emu `bench all` report.json) and its native baseline (the figure
of plain CUDA processes or of the bare path, where the bench measured one in
the same run). Standard library only: it runs where gpu-check runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
BENCH_STEPS = {"launch": "launch", "flr": "flr", "sched": "sched", "share": "sched",
               "netgpu": "netgpu"}  # fmt: skip
# Where a bench keeps its native baseline beside a figure: a key with one of these
# prefixes, or the figure's key inside one of these dicts.
BASELINE_PREFIXES = ("native_", "floor_", "raw_")
BASELINE_DICTS = ("native",)
SKIP = {"bench", "backend", "targets_met", "machine", "targets", "notes", "spread", "rows"}


def latest_emu_report() -> Path | None:
    """The newest emu `bench all` report.json under bench/results (None: there is none)."""
    found = sorted((ROOT / "bench" / "results").glob("*-emu*/report.json"))
    return found[-1] if found else None


def numbers(d: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number of a result, nested keys joined by '.', bookkeeping left out."""
    out: dict[str, float] = {}
    for k, v in d.items():
        if k in SKIP:
            continue
        if isinstance(v, bool):
            continue
        if isinstance(v, int | float):
            out[prefix + k] = v
        elif isinstance(v, dict):
            out.update(numbers(v, f"{prefix}{k}."))
    return out


def baseline(key: str, figures: dict[str, float]) -> float | None:
    """The native baseline of a figure measured in the same run, where there is one."""
    head, _, last = key.rpartition(".")
    pre = f"{head}." if head else ""
    for p in BASELINE_PREFIXES:
        if f"{pre}{p}{last}" in figures:
            return figures[f"{pre}{p}{last}"]
    for d in BASELINE_DICTS:
        if f"{d}.{key}" in figures:
            return figures[f"{d}.{key}"]
    return None


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def bench_table(name: str, result: dict[str, Any], emu: dict[str, Any] | None) -> list[str]:
    figs = numbers(result)
    emu_figs = numbers(emu) if emu else {}
    lines = [f"### {name}", "", "| figure | H200 | emu | native baseline (same run) |",
             "|---|---|---|---|"]  # fmt: skip
    for key, v in figs.items():
        if key.startswith(BASELINE_PREFIXES) or key.split(".")[0] in BASELINE_DICTS:
            continue  # shown beside the figure it is the baseline of
        lines.append(f"| {key} | {_fmt(v)} | {_fmt(emu_figs.get(key))} | "
                     f"{_fmt(baseline(key, figs))} |")  # fmt: skip
    for t, v in (result.get("targets") or {}).items():
        lines.append(f"| target {t} {v['target']} | {_fmt(v['value'])} | "
                     f"{_fmt((emu or {}).get('targets', {}).get(t, {}).get('value'))} | "
                     f"{'met' if v['met'] else 'MISSED'} |")  # fmt: skip
    return [*lines, ""]


def isolation_table(result: dict[str, Any]) -> list[str]:
    lines = ["### isolation (no emu counterpart: emu has no device to fault)", "",
             "| fault | setup | T0 (faulty) | T1 | T2 | worst neighbour stall s | "
             "T0 back after s | beyond share GiB |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for fault, per in result.get("faults", {}).items():
        for setup, o in per.items():
            t = o["tenants"]
            beyond = o.get("beyond_share_bytes")
            lines.append(
                f"| {fault} | {setup} | {t['T0']['fate']} | {t['T1']['fate']} | "
                f"{t['T2']['fate']} | {o['neighbour_worst_stall_s']} | "
                f"{_fmt(o['faulty_back_after_s'])} | "
                f"{'-' if beyond is None else round(beyond / 2**30, 2)} |"
            )
    skipped = result.get("setups_skipped") or {}
    lines += ["", *(f"- {k} not run: {v}" for k, v in skipped.items())] if skipped else []
    return [*lines, ""]


def render(check: dict[str, Any], emu: list[dict[str, Any]] | None) -> str:
    by_bench = {r["bench"]: r for r in emu or []}
    steps = check.get("steps", {})
    lines = [f"# gpu-check {check.get('date', '?')} on {check.get('nvidia_smi', '?')}", "",
             f"all_ok: **{check.get('all_ok')}**, {check.get('elapsed_s')} s, host "
             f"{check.get('host')}, Python {check.get('python')}, benches' sandbox "
             f"{check.get('sandbox')}", "", "| step | ok | seconds | note |", "|---|---|---|---|"]  # fmt: skip
    for name, st in steps.items():
        note = st.get("error") or st.get("sandbox") or ""
        lines.append(f"| {name} | {st.get('ok')} | {_fmt(st.get('seconds'))} | {note} |")
    lines.append("")
    dev = steps.get("device", {})
    if dev.get("ok"):
        lines += ["### device", ""]
        lines += [f"- {k}: {v}" for k, v in dev.items() if k != "ok"]
        lines.append("")
    for name in ("tests", "confined"):
        st = steps.get(name, {})
        runs = st.get("runs") or [st.get(k) for k in ("gpu_tests", "hostile") if st.get(k)]
        if runs:
            lines += [f"### {name}", ""]
            lines += [f"- {r.get('summary')}" + "".join(f"\n  - {p}" for p in r.get("problems", [])
                      if not p.startswith("skipped")) for r in runs]  # fmt: skip
            lines.append("")
    for name, bench in BENCH_STEPS.items():
        st = steps.get(name, {})
        if st.get("ok"):
            lines += bench_table(name, st["result"], by_bench.get(bench))
    if steps.get("isolation", {}).get("ok") is not None and "result" in steps["isolation"]:
        lines += isolation_table(steps["isolation"]["result"])
    demo = steps.get("demo", {}).get("result")
    if demo:
        lines += ["### demo on cuda", "", f"- verified: {demo.get('ok')}; failures: "
                  f"{demo.get('failures')}"]  # fmt: skip
        lines += [f"- FLR of VF{f['vf']} ({f.get('incident', '?')}, {f['reason']}): "
                  f"{_fmt(f['total_ms'])} ms" for f in demo.get("flrs", [])]  # fmt: skip
        lines += [f"- NetGPU: {demo.get('netgpu', {}).get('status')}", ""]
    return "\n".join(lines) + "\n"


def write_report(check_json: Path, emu_json: Path | None = None) -> Path:
    """Write <date>-h200.md beside the run's JSON; the emu report defaults to the newest."""
    check = json.loads(check_json.read_text())
    emu_path = emu_json or latest_emu_report()
    emu = json.loads(emu_path.read_text()) if emu_path else None
    out = check_json.parent / f"{str(check.get('date', 'undated'))[:10]}-h200.md"
    text = render(check, emu)
    if emu_path:
        text += f"\nemu counterparts from {emu_path.relative_to(ROOT)}\n"
    out.write_text(text)
    return out
