"""Prometheus metrics for the admin endpoint's GET /metrics.

A custom collector reads the host's own status at scrape time, so nothing on
the scheduler's or the mailbox's path updates a metric: a scrape costs the
host one status() call and no scrape costs nothing. Names, types and labels
are documented in docs/metrics.md; change both together.

Two things need memory between scrapes, kept per Host in `_State`:
- the world-switch latency histogram: the scheduler keeps only the latest
  100 000 latencies in a ring, so each scrape adds the switches since the
  last one to cumulative buckets (a Prometheus histogram must never go down);
- guard trips and device resets, counted from the event log as it grows.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from gpuvirt.host.vfmgr import VFState
from gpuvirt.version import __version__

if TYPE_CHECKING:
    from gpuvirt.host.events import EventLog
    from gpuvirt.host.status import StatusReport

# World-switch latency buckets (seconds). DESIGN.md's targets are p50 ≤ 150 µs
# and p99 ≤ 1 ms on emu, so both are bucket edges and the range around them is fine.
SWITCH_BUCKETS_S = (
    25e-6, 50e-6, 75e-6, 100e-6, 150e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3, 0.25,
)  # fmt: skip
STATES = tuple(str(s) for s in VFState)


@dataclass
class _State:
    switches_seen: int = 0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(SWITCH_BUCKETS_S) + 1))
    latency_sum_s: float = 0.0
    events_seen: int = 0
    guard_trips: dict[int, int] = field(default_factory=dict)
    device_resets: int = 0


_states: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()


def _state(report: StatusReport) -> _State:
    st = _states.get(report)
    if st is None:
        st = _states[report] = _State()
    return st


def _take_switches(report: StatusReport, st: _State) -> None:
    stats = report.sched.stats
    # Read the counter before copying the ring: the scheduler thread appends
    # the latency first and counts the switch after, so the copy holds at least
    # `switches` entries. A switch landing between the two reads is counted by
    # the next scrape; over time the count matches the scheduler's exactly.
    total = stats.switches
    ring = stats.latencies_ns.copy()
    new = total - st.switches_seen
    if new <= 0:
        return
    take = min(new, len(ring))
    for ns in list(ring)[len(ring) - take :]:
        s = ns / 1e9
        st.buckets[bisect.bisect_left(SWITCH_BUCKETS_S, s)] += 1
        st.latency_sum_s += s
    # Switches that fell out of the ring between two scrapes (more than its
    # size) still count, in the +Inf bucket only: their latencies are gone.
    st.buckets[-1] += new - take
    st.switches_seen = total


def _take_events(events: EventLog, st: _State) -> None:
    for ev in events.since(st.events_seen, None, limit=1 << 30):
        st.events_seen = ev.seq
        if ev.kind == "guard.trip" and ev.vf is not None:
            st.guard_trips[ev.vf] = st.guard_trips.get(ev.vf, 0) + 1
        elif ev.kind == "device_reset.start":
            st.device_resets += 1


class HostCollector(Collector):
    """Reads only the host's status report and its event log."""

    def __init__(self, report: StatusReport, events: EventLog) -> None:
        self.report, self.events = report, events

    def collect(self) -> Iterator[Metric]:
        status = self.report.status()
        st = _state(self.report)
        _take_switches(self.report, st)
        _take_events(self.events, st)
        yield from _device(self.report, status, st)
        yield from _vfs(status, st)


def _device(report: StatusReport, status: dict[str, Any], st: _State) -> Iterator[Metric]:
    info = InfoMetricFamily("gpuvirt_host", "The host daemon: backend, policy, version.")
    info.add_metric(
        [],
        {
            "backend": status["backend"],
            "policy": status["policy"],
            "version": __version__,
        },
    )
    yield info
    sandbox = status["sandbox"]
    yield GaugeMetricFamily(
        "gpuvirt_engine_sandbox_confined",
        "1 when engines are confined (bwrap and the rest), 0 when they run as the host.",
        1 if sandbox["confined"] else 0,
    )
    prot = GaugeMetricFamily(
        "gpuvirt_engine_protection",
        "Each engine protection: 1 in force, 0 missing (why: /status sandbox.missing).",
        labels=["protection"],
    )
    for name in sorted({*sandbox["active"], *sandbox["missing"]}):
        prot.add_metric([name], 1 if name in sandbox["active"] else 0)
    yield prot
    yield GaugeMetricFamily(
        "gpuvirt_host_uptime_seconds", "Seconds since the host started.", status["uptime_s"]
    )
    yield GaugeMetricFamily(
        "gpuvirt_host_resident_memory_bytes",
        "Resident memory of the host daemon itself (engines not included).",
        status["host_rss_bytes"],
    )
    yield GaugeMetricFamily(
        "gpuvirt_time_slice_seconds",
        "Configured world-switch time slice.",
        status["time_slice_ms"] / 1000,
    )
    yield GaugeMetricFamily(
        "gpuvirt_vfs", "Number of VFs configured (enabled or not).", len(status["vfs"])
    )
    yield CounterMetricFamily(
        "gpuvirt_world_switches",
        "World switches from one VF to another since the host started.",
        status["sched"]["switches"],
    )
    yield CounterMetricFamily(
        "gpuvirt_world_switch_lost_seconds",
        "Device time spent inside world switches (no VF running) since the host started.",
        report.sched.stats.lost_ns / 1e9,
    )
    cumulative, buckets = 0, []
    for edge, n in zip((*SWITCH_BUCKETS_S, float("inf")), st.buckets, strict=True):
        cumulative += n
        buckets.append((_le(edge), cumulative))
    h = HistogramMetricFamily(
        "gpuvirt_world_switch_latency_seconds",
        "Time of one world switch, IDLE(A) SAVE(A) LOAD(B) RUN(B).",
    )
    h.add_metric([], buckets, sum_value=st.latency_sum_s)
    yield h
    yield CounterMetricFamily(
        "gpuvirt_device_resets",
        "Whole-device resets (a VF FLR that could not restart its engine escalates to one).",
        st.device_resets,
    )


def _le(edge: float) -> str:
    return "+Inf" if edge == float("inf") else repr(edge)


@dataclass(frozen=True)
class _PerVF:
    name: str
    family: type[GaugeMetricFamily] | type[CounterMetricFamily]
    help: str
    value: Callable[[dict[str, Any]], float]


G, C = GaugeMetricFamily, CounterMetricFamily
# One sample per VF, labelled vf="N"; docs/metrics.md lists the same.
PER_VF: tuple[_PerVF, ...] = (
    _PerVF("gpuvirt_vf_weight", G, "Scheduling weight (policy weighted).", lambda v: v["weight"]),
    _PerVF("gpuvirt_vf_configured_share", G,
           "Share of device time the policy gives the VF now (0..1).",
           lambda v: v["configured_share"]),
    _PerVF("gpuvirt_vf_achieved_share", G,
           "Share of device time the VF had over the last ~5 s (0..1).",
           lambda v: v["achieved_share"]),
    _PerVF("gpuvirt_vf_device_seconds", C,
           "Device time the VF's engine has run; starts over when its engine restarts.",
           lambda v: v["device_ms"] / 1000),
    _PerVF("gpuvirt_vf_wall_seconds", C,
           "The host's wall-clock view of the VF's turns on the device, beside the device "
           "time charged (equal where the device's time is the wall clock: emu).",
           lambda v: v.get("wall_ms", v["device_ms"]) / 1000),
    _PerVF("gpuvirt_vf_device_disagreement_pp", G,
           "Gap between the VF's device time as the device measured it and the wall clock's "
           "view, in percentage points of the device (0 where not measured).",
           lambda v: v.get("disagree_pp") or 0.0),
    _PerVF("gpuvirt_vf_device_disagrees", G,
           "1 while that gap is over 1 percentage point.",
           lambda v: float(bool(v.get("device_disagrees")))),
    _PerVF("gpuvirt_vf_running", G, "1 while the VF is the one on the device.",
           lambda v: float(bool(v["running"]))),
    _PerVF("gpuvirt_vf_pending_launches", G,
           "Work the VF has, as the scheduler last read it: 1 for a launch or copy its "
           "engine is running, 1 more while others wait in its channel (0-2).",
           lambda v: v["pending"]),
    _PerVF("gpuvirt_vf_fb_bytes", G, "Size of the VF's FB.", lambda v: v["fb_total"]),
    _PerVF("gpuvirt_vf_fb_used_bytes", G,
           "FB bytes the guest has allocated (guest-reported, VF2PF).", lambda v: v["fb_used"]),
    _PerVF("gpuvirt_vf_fb_resident_bytes", G,
           "FB bytes backed by host memory now (touched, not scrubbed).",
           lambda v: v["fb_resident"]),
    _PerVF("gpuvirt_vf_guest_attached", G, "1 while a guest holds the VF.",
           lambda v: float(v["guest_pid"] is not None)),
    _PerVF("gpuvirt_vf_launches", C,
           "Launches completed by the current guest (guest-reported, VF2PF).",
           lambda v: v["launches_completed"]),
    _PerVF("gpuvirt_vf_netgpu_rx_bytes", C,
           "NetGPU bytes received into the FB by the current guest (guest-reported, VF2PF).",
           lambda v: v["netgpu_rx_bytes"]),
    _PerVF("gpuvirt_vf_flrs", C, "VF FLRs since the host started.", lambda v: v["flr_count"]),
    _PerVF("gpuvirt_vf_guard_recent_flrs", G, "FLRs inside the guard's sliding window.",
           lambda v: v["guard"]["recent_flrs"]),
    _PerVF("gpuvirt_vf_guard_limit", G,
           "FLRs the guard allows per window; one more quarantines the VF.",
           lambda v: v["guard"]["limit"]),
    _PerVF("gpuvirt_vf_guard_tripped", G, "1 while the guard holds the VF quarantined.",
           lambda v: float(bool(v["guard"]["tripped"]))),
    _PerVF("gpuvirt_vf_vf2pf_untrusted", G,
           "1 when the VF2PF block failed its checksum too often and is no longer read.",
           lambda v: float(bool(v.get("vf2pf_untrusted")))),
)  # fmt: skip


def _vfs(status: dict[str, Any], st: _State) -> Iterator[Metric]:
    vfs = status["vfs"]
    state = GaugeMetricFamily(
        "gpuvirt_vf_state", "1 for the VF's current state, 0 for the others.",
        labels=["vf", "state"],
    )  # fmt: skip
    for v in vfs:
        for s in STATES:
            state.add_metric([str(v["index"]), s], 1.0 if v["state"] == s else 0.0)
    yield state
    for spec in PER_VF:
        fam = spec.family(spec.name, spec.help, labels=["vf"])
        for v in vfs:
            fam.add_metric([str(v["index"])], spec.value(v))
        yield fam
    trips = CounterMetricFamily(
        "gpuvirt_vf_guard_trips", "Times the guard quarantined the VF since the host started.",
        labels=["vf"],
    )  # fmt: skip
    last = GaugeMetricFamily(
        "gpuvirt_vf_last_flr_seconds", "Duration of the VF's last FLR.", labels=["vf"]
    )
    steps = GaugeMetricFamily(
        "gpuvirt_vf_last_flr_step_seconds", "Duration of each step of the VF's last FLR.",
        labels=["vf", "step"],
    )  # fmt: skip
    for v in vfs:
        vf = str(v["index"])
        trips.add_metric([vf], v["guard"].get("trips", st.guard_trips.get(v["index"], 0)))
        if v.get("last_flr"):
            last.add_metric([vf], v["last_flr"]["total_ms"] / 1000)
            for step, ms in v["last_flr"].get("steps", {}).items():
                steps.add_metric([vf, step], ms / 1000)
    yield from (trips, last, steps)


def render(report: StatusReport, events: EventLog) -> tuple[bytes, str]:
    """The Prometheus text exposition of the host's metrics, and its content type."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HostCollector(report, events))
    return generate_latest(registry), CONTENT_TYPE_LATEST
