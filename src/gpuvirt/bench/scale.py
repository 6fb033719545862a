"""bench scale: 31 VFs on one device — switching overhead and memory.

One host with GIM's maximum of 31 VFs, every VF kept busy by its own guest
process. Figures: device time lost to switching (target ≤ 5 %), the work all
31 get done against one VF alone on the same host in the same run, the host
daemon's RSS (target ≤ 150 MiB), an idle engine's RSS (target ≤ 60 MiB), and
the host memory an FB costs before and after it is touched and scrubbed.
"""

from __future__ import annotations

from gpuvirt.bench.common import Result, Target, scratch_host
from gpuvirt.bench.sched import busy_window
from gpuvirt.host.status import rss_bytes

VFS = 31
MiB = 1 << 20


def run(quick: bool = False, backend: str = "emu") -> Result:
    seconds = 2.0 if quick else 5.0
    dev = {"backend": backend, "fb_total": "8GiB", "pf_fb": "256MiB"}
    sched = {"policy": "liquid", "time_slice_ms": 6}
    with scratch_host(device=dev, sriov={"vf_num": VFS}, scheduler=sched) as hp:
        st = hp.status()
        idle_engine = max(rss_bytes(v["engine_pid"]) for v in st["vfs"])
        host_idle = st["host_rss_bytes"]
        fb_untouched = max(v["fb_resident"] for v in st["vfs"])
        alone = busy_window(hp, [0], seconds)
        every = busy_window(hp, list(range(VFS)), seconds)
        host_busy = hp.status()["host_rss_bytes"]
    lost_pct = 100 * every["lost_ns"] / every["span_ns"]
    rate_alone = sum(r.work for r in alone["reports"] if r) / alone["span_ns"]
    rate_all = sum(r.work for r in every["reports"] if r) / every["span_ns"]
    work_ratio = rate_all / rate_alone if rate_alone else 0.0
    host_rss = max(host_idle, host_busy)
    return Result(
        bench="scale",
        backend=backend,
        figures={
            "vfs": VFS,
            "overhead_pct": round(lost_pct, 3),
            "work_ratio_all_vs_alone": round(work_ratio, 4),
            "switches": every["switches"],
            "host_rss_mib": round(host_rss / MiB, 1),
            "idle_engine_rss_mib": round(idle_engine / MiB, 1),
            "fb_resident_untouched_bytes": fb_untouched,
        },
        targets=[
            Target("overhead_pct", round(lost_pct, 3), 5.0, "<="),
            Target("host_rss_mib", round(host_rss / MiB, 1), 150, "<="),
            Target("idle_engine_rss_mib", round(idle_engine / MiB, 1), 60, "<="),
        ],
        rows=[
            (f"device time lost to switching ({VFS} busy VFs, 6 ms)", lost_pct, "%"),
            (f"work of {VFS} VFs / 1 VF alone", work_ratio, "×"),
            ("host daemon RSS", host_rss / MiB, "MiB"),
            ("idle engine RSS (largest)", idle_engine / MiB, "MiB"),
            ("host memory held by an untouched FB", fb_untouched / 1024, "KiB"),
        ],
        notes=[
            "RSS counts shared pages (the interpreter, numpy) in every engine; the "
            "engines' memory is mostly the same library pages",
        ],
    )
