"""Operator tools against a real host: /metrics, `gpuvirt top`, `gpuvirt events`.

One scratch host (3 VFs, weighted 1:2:3) serves the module; two guests in
this process have done work on VF0 and VF1. The CLI is run as a real
subprocess (`python -m gpuvirt ...`), off a terminal, as a script would.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import gpuvirt
from gpuvirt.bench.common import scratch_host
from gpuvirt.cli.events import FIELDS, parse_since
from gpuvirt.host.process import HostProcess

VFS = 3
WEIGHTS = (1.0, 2.0, 3.0)
CATEGORIES = {"state", "mailbox", "sched", "reset", "guard", "admin", "host"}
PLAIN_ENV = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "160"}


@pytest.fixture(scope="module")
def host() -> Iterator[HostProcess]:
    vf = [{"index": i, "weight": w} for i, w in enumerate(WEIGHTS)]
    with scratch_host(sriov={"vf_num": VFS}, scheduler={"policy": "weighted"}, vf=vf) as hp:
        guests = [gpuvirt.attach(vf=i, socket=hp.socket, token=hp.token(i)) for i in (0, 1)]

        def work(xp: Any, n: int) -> float:
            a = xp.ones((n, n))
            return float((a @ a).sum())

        # Interleaved so the scheduler switches between the two VFs.
        futs = [g.launch(work, 64) for _ in range(20) for g in guests]
        assert [f.result(30) for f in futs] == [64.0**3] * len(futs)
        yield hp
        for g in guests:
            g.close()


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuvirt", *args],
        capture_output=True, text=True, timeout=timeout, env=PLAIN_ENV,
    )  # fmt: skip


def scrape(hp: HostProcess) -> dict[str, Any]:
    raw, ctype = hp.admin.raw("GET", "/metrics")
    assert ctype.startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(raw.decode())}


def by_vf(family: Any, sample_name: str | None = None) -> dict[int, float]:
    name = sample_name or family.name
    return {int(s.labels["vf"]): s.value for s in family.samples if s.name == name}


# ---- /metrics ---------------------------------------------------------------------------

PER_VF_FAMILIES = {
    "gpuvirt_vf_weight": "gauge",
    "gpuvirt_vf_configured_share": "gauge",
    "gpuvirt_vf_achieved_share": "gauge",
    "gpuvirt_vf_device_seconds": "counter",
    "gpuvirt_vf_running": "gauge",
    "gpuvirt_vf_pending_launches": "gauge",
    "gpuvirt_vf_fb_bytes": "gauge",
    "gpuvirt_vf_fb_used_bytes": "gauge",
    "gpuvirt_vf_fb_resident_bytes": "gauge",
    "gpuvirt_vf_guest_attached": "gauge",
    "gpuvirt_vf_launches": "counter",
    "gpuvirt_vf_netgpu_rx_bytes": "counter",
    "gpuvirt_vf_flrs": "counter",
    "gpuvirt_vf_guard_recent_flrs": "gauge",
    "gpuvirt_vf_guard_limit": "gauge",
    "gpuvirt_vf_guard_tripped": "gauge",
    "gpuvirt_vf_guard_trips": "counter",
    "gpuvirt_vf_vf2pf_untrusted": "gauge",
}


@pytest.mark.timeout(60)
def test_metrics_parse_and_carry_every_vf(host: HostProcess) -> None:
    fams = scrape(host)
    for name, kind in PER_VF_FAMILIES.items():
        assert fams[name].type == kind, name
        suffix = "_total" if kind == "counter" else ""
        assert sorted(by_vf(fams[name], name + suffix)) == list(range(VFS)), name
    assert by_vf(fams["gpuvirt_vf_weight"]) == dict(enumerate(WEIGHTS))
    assert by_vf(fams["gpuvirt_vf_guest_attached"]) == {0: 1.0, 1: 1.0, 2: 0.0}
    states = {
        (s.labels["vf"], s.labels["state"]): s.value for s in fams["gpuvirt_vf_state"].samples
    }
    for vf in range(VFS):
        assert sum(v for (i, _), v in states.items() if i == str(vf)) == 1.0
    assert states[("0", "ACTIVE")] == states[("1", "ACTIVE")] == states[("2", "AVAIL")] == 1.0
    info = fams["gpuvirt_host_info"].samples[0].labels
    assert info["backend"] == "emu" and info["policy"] == "weighted"
    for name in ("gpuvirt_world_switches", "gpuvirt_world_switch_lost_seconds"):
        assert fams[name].type == "counter"
    assert fams["gpuvirt_world_switch_latency_seconds"].type == "histogram"


@pytest.mark.timeout(60)
def test_docs_name_every_metric_and_nothing_else(host: HostProcess) -> None:
    doc = (Path(__file__).parents[1] / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(gpuvirt_[a-z0-9_]+)` \|", doc, re.MULTILINE))
    exposed = {f.name + ("_total" if f.type == "counter" else "") for f in scrape(host).values()}
    assert documented == exposed


def histogram(fams: dict[str, Any]) -> tuple[list[tuple[float, float]], float]:
    fam = fams["gpuvirt_world_switch_latency_seconds"]
    buckets = [(float(s.labels["le"]), s.value) for s in fam.samples if s.name.endswith("_bucket")]
    count = next(s.value for s in fam.samples if s.name.endswith("_count"))
    return buckets, count


@pytest.mark.timeout(60)
def test_switch_histogram_is_cumulative_across_scrapes(host: HostProcess) -> None:
    first, count1 = histogram(scrape(host))
    second, count2 = histogram(scrape(host))
    for buckets, count in ((first, count1), (second, count2)):
        values = [v for _, v in buckets]
        assert values == sorted(values), "buckets must be cumulative"
        assert buckets[-1] == (float("inf"), count)
    assert count1 > 0, "the fixture's guests made the scheduler switch"
    assert all(b >= a for (_, a), (_, b) in zip(first, second, strict=True))
    assert count2 >= count1


@pytest.mark.timeout(60)
def test_metrics_follow_an_flr(host: HostProcess) -> None:
    before = by_vf(scrape(host)["gpuvirt_vf_flrs"], "gpuvirt_vf_flrs_total")
    host.admin.vf(2, "reset")  # returns once the FLR is done
    fams = scrape(host)
    after = by_vf(fams["gpuvirt_vf_flrs"], "gpuvirt_vf_flrs_total")
    assert after == {**before, 2: before[2] + 1}
    steps = {
        s.labels["step"]
        for s in fams["gpuvirt_vf_last_flr_step_seconds"].samples
        if s.labels["vf"] == "2"
    }
    assert {"off_schedule", "notify", "kill", "scrub", "engine_start"} <= steps
    assert by_vf(fams["gpuvirt_vf_last_flr_seconds"])[2] > 0


@pytest.mark.timeout(60)
def test_metrics_count_guard_trips() -> None:
    with scratch_host(sriov={"vf_num": 1}, reset={"guard_flr": "1/60s"}) as hp:
        hp.admin.vf(0, "reset")
        assert hp.admin.vf(0, "reset")["state"] == "QUARANTINED"  # the second FLR in the window
        fams = scrape(hp)
        assert by_vf(fams["gpuvirt_vf_guard_tripped"]) == {0: 1.0}
        assert by_vf(fams["gpuvirt_vf_guard_trips"], "gpuvirt_vf_guard_trips_total") == {0: 1.0}
        assert by_vf(fams["gpuvirt_vf_flrs"], "gpuvirt_vf_flrs_total") == {0: 2.0}
        hp.admin.vf(0, "clear-guard")
        fams = scrape(hp)
        assert by_vf(fams["gpuvirt_vf_guard_tripped"]) == {0: 0.0}
        assert by_vf(fams["gpuvirt_vf_guard_trips"], "gpuvirt_vf_guard_trips_total") == {0: 1.0}


# ---- gpuvirt top ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_top_once_shows_every_vf_in_plain_text(host: HostProcess) -> None:
    r = cli("top", "--once", "--config", str(host.config_path))
    assert r.returncode == 0, r.stderr
    assert "\x1b[" not in r.stdout, "no colour or cursor codes off a terminal"
    rows = {m[1]: line for line in r.stdout.splitlines() if (m := re.match(r"│ (VF\d+) ", line))}
    assert sorted(rows) == [f"VF{i}" for i in range(VFS)]
    assert "ACTIVE" in rows["VF0"] and "ACTIVE" in rows["VF1"] and "AVAIL" in rows["VF2"]
    assert "emu" in r.stdout and "weighted" in r.stdout


@pytest.mark.timeout(60)
def test_top_once_json(host: HostProcess) -> None:
    r = cli("top", "--once", "--json", "--config", str(host.config_path))
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert [v["index"] for v in st["vfs"]] == list(range(VFS))
    for v in st["vfs"]:
        assert {"state", "guest_pid", "configured_share", "achieved_share", "fb_used",
                "fb_total", "flr_count", "guard", "launches_per_s",
                "netgpu_rx_bytes_per_s"} <= v.keys()  # fmt: skip
    assert {"switches", "lost_pct", "switch_p50_us", "switch_p99_us"} <= st["sched"].keys()


@pytest.mark.timeout(60)
def test_top_refreshes_with_rates(host: HostProcess) -> None:
    """Off a terminal, top prints frame after frame; from the second on it has rates."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuvirt", "top", "--json", "--interval", "0.2",
         "--config", str(host.config_path)],
        stdout=subprocess.PIPE, text=True, env=PLAIN_ENV,
    )  # fmt: skip
    try:
        out = lines_of(proc)
        frames = [json.loads(out.get(timeout=30)) for _ in range(2)]
    finally:
        proc.terminate()
        proc.wait(10)
    assert frames[0]["sched"]["switches_per_s"] is None
    assert frames[1]["sched"]["switches_per_s"] is not None
    assert all(v["launches_per_s"] is not None for v in frames[1]["vfs"])


@pytest.mark.timeout(30)
def test_top_without_a_host_fails_cleanly(tmp_path: Path) -> None:
    cfg = tmp_path / "gpuvirt.toml"
    cfg.write_text(f'[host]\nadmin = "{tmp_path / "nothing.sock"}"\n')
    r = cli("top", "--once", "--config", str(cfg))
    assert r.returncode == 1
    assert "no gpuvirt host" in r.stderr and "Traceback" not in r.stderr


# ---- gpuvirt events ---------------------------------------------------------------------


def check_event(ev: dict[str, Any]) -> None:
    assert tuple(ev) == FIELDS
    assert isinstance(ev["seq"], int) and isinstance(ev["ts"], float)
    assert ev["category"] in CATEGORIES and isinstance(ev["kind"], str)
    assert ev["vf"] is None or isinstance(ev["vf"], int)
    assert isinstance(ev["message"], str) and isinstance(ev["data"], dict)


@pytest.mark.timeout(60)
def test_events_json_lines(host: HostProcess) -> None:
    r = cli("events", "--json", "--config", str(host.config_path))
    assert r.returncode == 0, r.stderr
    evs = [json.loads(line) for line in r.stdout.splitlines()]
    for ev in evs:
        check_event(ev)
    seqs = [e["seq"] for e in evs]
    assert seqs == sorted(set(seqs))
    enabled = {e["vf"] for e in evs if e["kind"] == "transition" and e["data"]["new"] == "AVAIL"}
    assert enabled >= set(range(VFS))
    assert any(e["category"] == "host" and e["kind"] == "ready" for e in evs)


@pytest.mark.timeout(60)
def test_events_filters(host: HostProcess) -> None:
    cfg = str(host.config_path)
    one = cli("events", "--json", "--vf", "1", "--config", cfg)
    assert one.returncode == 0, one.stderr
    vfs = {json.loads(line)["vf"] for line in one.stdout.splitlines()}
    assert vfs == {1}
    future = cli("events", "--json", "--since", "2999-01-01T00:00:00", "--config", cfg)
    assert future.returncode == 0 and future.stdout == ""
    last = cli("events", "--json", "--lines", "2", "--since", "1h", "--config", cfg)
    assert len(last.stdout.splitlines()) == 2
    bad = cli("events", "--since", "yesterday-ish", "--config", cfg)
    assert bad.returncode == 2 and "--since" in bad.stderr
    text = cli("events", "--vf", "0", "--config", cfg)
    assert text.returncode == 0 and "\x1b[" not in text.stdout
    assert all(" VF0 " in line for line in text.stdout.splitlines())


def lines_of(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    """The process's stdout, line by line, as it comes (a reader thread; no polling)."""
    q: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            q.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return q


@pytest.mark.timeout(60)
def test_events_follow_sees_an_flr_as_it_happens(host: HostProcess) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuvirt", "events", "--follow", "--json", "--vf", "2",
         "--lines", "1", "--config", str(host.config_path)],
        stdout=subprocess.PIPE, text=True, env=PLAIN_ENV,
    )  # fmt: skip
    try:
        out = lines_of(proc)
        backlog = json.loads(out.get(timeout=30))  # printed, so the backlog fetch is done
        host.admin.vf(2, "reset")
        kinds: list[str] = []
        while "flr.done" not in kinds:
            ev = json.loads(out.get(timeout=30))
            check_event(ev)
            assert ev["vf"] == 2 and ev["seq"] > backlog["seq"]
            kinds.append(ev["kind"])
    finally:
        proc.terminate()
        proc.wait(10)
    assert kinds.count("flr.start") == 1
    assert {"flr.off_schedule", "flr.kill", "flr.scrub", "flr.engine_start"} <= set(kinds)


def test_parse_since() -> None:
    now = 1_000_000.0
    assert parse_since("30s", now) == now - 30
    assert parse_since("5m", now) == now - 300
    assert parse_since("1h30m", now) == now - 5400
    assert parse_since("2d", now) == now - 172_800
    assert parse_since("250ms", now) == now - 0.25
    assert parse_since("2025-01-02T03:04:05+00:00") == 1_735_787_045.0
    local = parse_since("2025-01-02T03:04:05")
    assert local == time.mktime((2025, 1, 2, 3, 4, 5, 0, 0, -1))
    for bad in ("", "5", "5x", "m5", "1h 30", "soon"):
        with pytest.raises(ValueError, match="--since"):
            parse_since(bad, now)
