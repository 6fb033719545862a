"""The demo's verdict: shares, verified work, the stream, the FLRs; what failed, by VF."""

from __future__ import annotations

from typing import Any

from gpuvirt.cli.demo.guest import Guest
from gpuvirt.cli.demo.knobs import INCIDENTS, STOP_TIMEOUT_S
from gpuvirt.cli.demo.meter import ShareMeter
from gpuvirt.cli.demo.run import Run


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
    hostile = [f for f in flrs if any(g.vf == f["vf"] and g.role == "hostile" for g in run.guests)]
    for kind, f in zip(INCIDENTS, hostile, strict=False):
        f["incident"] = kind
    work = []
    for g in run.guests:
        row, problems = _work_row(g, flrs)
        failures.extend(f"VF{g.vf}: {p}" for p in problems)
        work.append(row)
    for f in flrs:
        if all(g.vf != f["vf"] or g.role != "hostile" for g in run.guests):
            failures.append(
                f"VF{f['vf']}: an FLR hit a VF that neither hung nor faulted ({f['reason']})"
            )
    netgpu = _netgpu_summary(run, failures)
    sched = st.get("sched", {})
    return {
        "ok": not failures,
        "backend": st.get("backend", run.backend),
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
    if g.role == "hostile":
        seen = d.get("incidents") or g.incidents
        ours = [f for f in flrs if f["vf"] == g.vf and not f.get("unfinished")]
        row["incidents"] = {}
        for i, kind in enumerate(INCIDENTS):
            h = seen.get(kind, {})
            row["incidents"][kind] = {
                "caught_after_ms": _ms(h.get("submitted"), h.get("error")),
                "back_after_ms": _ms(h.get("error"), h.get("ready")),
                "kernel_error": h.get("kernel_error"),
                "flr_reason": ours[i]["reason"] if i < len(ours) else None,
            }
            if "recovered" not in h:
                problems.append(f"the guest did not go on working after its {kind}'s reset")
        if len(ours) < len(INCIDENTS):
            problems.append(
                f"{len(ours)} FLRs of this VF finished; its {' and '.join(INCIDENTS)} each need one"
            )
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
