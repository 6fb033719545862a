"""`gpuvirt bench netgpu`'s judgment: from its trials to rows, ratios against raw and
targets. Ratios are taken within a repetition (neighbouring trials share the machine's
mood) before the median across repetitions; every mode and stream count is judged,
the worst of them is the headline, and the spread is that worst case per repetition.
"""

from __future__ import annotations

import statistics
from typing import Any

from gpuvirt.bench.common import Result, Target, spread

PATHS = ("zerocopy", "staged", "raw", "copy", "raw-lowat")
JUDGED = ("zerocopy", "staged")  # each against raw, with the same targets
MODES = ("framed", "raw")  # DESIGN.md: rows' mode = framed|raw (raw: any byte stream)
STREAMS = (1, 2, 4)
TARGET_THROUGHPUT = 0.97
TARGET_CPU = 1.05
# netgpu_cpu's figures beside the judged ones, per row (docs/netgpu.md, "The staged path")
ENGINE = "engine_cpu_s_per_gb"
SIDE_FIGURES = ("sender_cpu_s_per_gb", ENGINE, "rx_preempted_per_gb", "busy_cpus")


def result(
    trials: list[dict[str, Any]], backend: str, per_trial: int, reps: int, provider: str,
    verified: list[str], setup: str,
) -> Result:  # fmt: skip
    """The rows, the judged ratios and their targets, from every trial of a run; `setup`
    says what was measured (the first note)."""

    def pick(mode: str, path: str, streams: int, key: str) -> list[float]:
        return [
            t[key]
            for t in trials
            if t["mode"] == mode and t["path"] == path and t["streams"] == streams
        ]

    def ratio(path: str, mode: str, streams: int, key: str, base: str = "raw") -> float:
        # within each repetition first: neighbouring trials share the machine's mood
        got, raw = pick(mode, path, streams, key), pick(mode, base, streams, key)
        return statistics.median(z / r for z, r in zip(got, raw, strict=True))

    def row(mode: str, path: str, n: int) -> dict[str, Any]:
        r = {"mode": mode, "path": path, "streams": n}
        r["gbytes_per_s"] = round(statistics.median(pick(mode, path, n, "gbytes_per_s")), 3)
        r["cpu_s_per_gb"] = round(statistics.median(pick(mode, path, n, "cpu_s_per_gb")), 4)
        for key in SIDE_FIGURES:  # where the CPU went, where the trials carry it
            if key in trials[0]:
                r[key] = round(statistics.median(pick(mode, path, n, key)), 4)
        if path == "zerocopy":
            r["fragments_per_gb"] = round(
                statistics.median(pick(mode, path, n, "fragments_per_gb"))
            )
        if path == "staged" and ENGINE in trials[0]:
            # The rate of a receiver and an engine sharing one CPU and keeping it busy:
            # where staged runs at it, that CPU is the limit (docs/netgpu-staged-log.md,
            # "A fourth look").
            cpu, eng = pick(mode, path, n, "cpu_s_per_gb"), pick(mode, path, n, ENGINE)
            r["shared_cpu_gbps"] = round(
                statistics.median(1 / (c + e) for c, e in zip(cpu, eng, strict=True)), 3
            )
        return r

    rows = [row(mode, path, n) for mode in MODES for n in STREAMS for path in PATHS]
    # per judged path ("" for zerocopy, "staged_" for staged), mode and stream count
    prefix = {"zerocopy": "", "staged": "staged_"}
    by_mode = {
        mode: {
            str(n): {
                key: round(value, 3)
                for path in JUDGED
                for key, value in (
                    (f"{prefix[path]}throughput_ratio", ratio(path, mode, n, "gbytes_per_s")),
                    (f"{prefix[path]}cpu_ratio", ratio(path, mode, n, "cpu_s_per_gb")),
                    (f"{prefix[path]}cpu_ratio_lowat",
                     ratio(path, mode, n, "cpu_s_per_gb", "raw-lowat")),
                )
            }
            for n in STREAMS
        }
        for mode in MODES
    }  # fmt: skip
    # judged: every mode and stream count; the headline is the worst of them
    judged = [v for by_n in by_mode.values() for v in by_n.values()]

    def per_rep(path: str, key: str, worst: Any) -> list[float]:
        """The headline figure within each repetition (path over raw, worst case)."""
        out = []
        for rep in sorted({t["rep"] for t in trials}):
            at = {(t["mode"], t["path"], t["streams"]): t[key] for t in trials if t["rep"] == rep}
            out.append(worst([at[m, path, n] / at[m, "raw", n] for m in MODES for n in STREAMS]))
        return out

    figures: dict[str, Any] = {"rows": rows}
    spreads: dict[str, list[float]] = {}
    targets: list[Target] = []
    for path in JUDGED:
        tp, cpu = f"{prefix[path]}throughput_ratio", f"{prefix[path]}cpu_ratio"
        figures[tp] = min(v[tp] for v in judged)
        figures[cpu] = max(v[cpu] for v in judged)
        figures[f"{cpu}_lowat"] = max(v[f"{cpu}_lowat"] for v in judged)
        spreads[tp] = spread(per_rep(path, "gbytes_per_s", min), 3)
        spreads[cpu] = spread(per_rep(path, "cpu_s_per_gb", max), 3)
        targets.append(Target(tp, figures[tp], TARGET_THROUGHPUT, ">="))
        targets.append(Target(cpu, figures[cpu], TARGET_CPU, "<="))

    table: list[tuple[str, Any, str]] = []
    for r in rows:
        what = f"{r['mode']} {r['path']} · {r['streams']} stream{'s' if r['streams'] > 1 else ''}"
        table.append((what, r["gbytes_per_s"], "GB/s"))
        table.append((what, r["cpu_s_per_gb"], "CPU s/GB"))
        if "fragments_per_gb" in r:
            table.append((what, r["fragments_per_gb"], "fragments/GB"))
        if "shared_cpu_gbps" in r:
            table.append((what, r["shared_cpu_gbps"], "GB/s on one CPU with its engine"))
    for mode, by_n in by_mode.items():
        for n, v in by_n.items():
            for path in JUDGED:
                pre = prefix[path]
                table += [
                    (f"{mode} {path}/raw throughput · {n} stream(s)", v[f"{pre}throughput_ratio"],
                     "×"),
                    (f"{mode} {path}/raw CPU per GB · {n} stream(s)", v[f"{pre}cpu_ratio"], "×"),
                    (f"{mode} {path}/raw-lowat CPU per GB · {n} stream(s)",
                     v[f"{pre}cpu_ratio_lowat"], "×"),
                ]  # fmt: skip
    return Result(
        bench="netgpu",
        backend=backend,
        figures={
            **figures,
            "rounds": reps,
            "spread": spreads,
            "by_mode": by_mode,
            "provider": provider,
            "staged_verified": verified,
            "bytes_per_trial": per_trial,
            "repetitions": reps,
        },
        targets=targets,
        rows=table,
        notes=[
            setup,
            "CPU = the receiving process's user+system time (getrusage) per GB; the sender "
            "is another process, and so is the engine that copies staged bytes",
            "ratios: zerocopy (staged) over raw within each repetition, median across "
            "repetitions; targets judge the worst mode and stream count; spread: that worst "
            "case per repetition",
            f"staged bytes checked in device memory (sha256 per stream): {', '.join(verified)}",
        ],
        series={
            mode: {
                path: {
                    str(n): {
                        "gbytes_per_s": pick(mode, path, n, "gbytes_per_s"),
                        "cpu_s_per_gb": pick(mode, path, n, "cpu_s_per_gb"),
                    }
                    for n in STREAMS
                }
                for path in PATHS
            }
            for mode in MODES
        },
    )
