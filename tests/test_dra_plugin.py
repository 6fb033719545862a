"""The DRA driver end to end: a real host, the driver as its own process, a kubelet
stand-in on gRPC and an API-server stand-in that checks every object against the
Kubernetes schema. Nothing of ours is mocked."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path
from typing import Any

import pytest

import gpuvirt
from dra_env import DRIVER, Kubelet, Plugin, cdi_device, claim, container, node
from gpuvirt.config import MiB
from helpers import MakeHost, last_seq, wait_event, wait_state

log = logging.getLogger("test_dra")
pytestmark = pytest.mark.timeout(180)

# Small VFs, so that a claim can ask for more FB than a VF has by default.
HOST = {
    "sriov": {"vf_num": 2},
    "scheduler": {"policy": "weighted"},
    "vf": [{"index": 0, "fb": "32MiB"}, {"index": 1, "fb": "32MiB"}],
}


def _slice_devices(api: Any, name: str) -> dict[str, dict[str, Any]]:
    s = api.slices.get(f"{name}-{DRIVER}")
    return {d["name"]: d for d in s["spec"]["devices"]} if s else {}


def _attr(api: Any, name: str, vf: str, key: str) -> Any:
    a = _slice_devices(api, name).get(vf, {}).get("attributes", {}).get(key)
    return next(iter(a.values())) if a else None


def test_registers_publishes_follows_and_removes_its_slice(make_host: MakeHost, tmp_path: Path) -> None:
    with node(make_host, tmp_path, **HOST) as n:
        info = n.kubelet.register()
        assert info.type == "DRAPlugin"
        assert info.name == DRIVER
        assert list(info.supported_versions) == ["v1.DRAPlugin"]
        assert info.endpoint == str(n.plugin.plugin_dir / "dra.sock")

        n.api.wait_for(lambda a: _slice_devices(a, n.name))
        s = n.api.slices[f"{n.name}-{DRIVER}"]
        assert s["spec"]["nodeName"] == n.name and s["spec"]["pool"]["name"] == n.name
        vf0 = _slice_devices(n.api, n.name)["vf0"]
        assert vf0["attributes"] == {
            "index": {"int": 0}, "backend": {"string": "emu"}, "fbBytes": {"int": 32 * MiB},
            "weight": {"int": 1}, "health": {"string": "Healthy"}, "state": {"string": "AVAIL"},
        }  # fmt: skip
        assert vf0["capacity"] == {"fb": {"value": str(32 * MiB)}}
        assert sorted(_slice_devices(n.api, n.name)) == ["vf0", "vf1"]

        # Health follows the VF: disabled is Unhealthy, enabled again Healthy.
        gen = s["spec"]["pool"]["generation"]
        n.host.admin.vf(1, "disable")
        n.api.wait_for(lambda a: _attr(a, n.name, "vf1", "health") == "Unhealthy")
        n.host.admin.vf(1, "enable")
        n.api.wait_for(lambda a: _attr(a, n.name, "vf1", "health") == "Healthy")
        # ... and so do the VF's settings, changed by an admin.
        n.host.admin.vf_set(0, weight=5, fb="48MiB")
        n.api.wait_for(lambda a: _attr(a, n.name, "vf0", "weight") == 5)
        n.api.wait_for(lambda a: _attr(a, n.name, "vf0", "fbBytes") == 48 * MiB)
        assert n.api.slices[f"{n.name}-{DRIVER}"]["spec"]["pool"]["generation"] > gen + 2
        assert n.api.rejected == []

        assert n.plugin.stop() == 0
        assert n.api.slices == {}
        assert list(n.plugin.registry_dir.glob("*.sock")) == []
        assert not (n.plugin.plugin_dir / "dra.sock").exists()


def test_a_refused_registration_ends_the_plugin_with_the_reason(
    make_host: MakeHost, tmp_path: Path
) -> None:
    with node(make_host, tmp_path, **HOST) as n:
        n.kubelet.register(accept=False, error="no supported version")
        assert n.plugin.proc is not None
        assert n.plugin.proc.wait(30) == 1
        assert "refused the registration: no supported version" in n.plugin.log.read_text()
        assert n.api.slices == {}


def test_one_claim_from_slice_to_guest_to_scrub(make_host: MakeHost, tmp_path: Path) -> None:
    """The whole path, logged: slice published → claim prepared with fb/weight → a guest
    attached through the CDI spec alone computes with that FB and weight → unprepared
    and scrubbed."""
    with node(make_host, tmp_path, **HOST) as n:
        n.kubelet.register()
        n.api.wait_for(lambda a: _slice_devices(a, n.name))
        log.warning("slice published: %s", json.dumps(n.api.slices[f"{n.name}-{DRIVER}"]["spec"]))

        c = n.api.put_claim(claim(n.name, ["vf1"], {"apiVersion": "gpuvirt.io/v1",
                                                     "kind": "VfConfig", "fb": "96MiB", "weight": 3}))  # fmt: skip
        uid = c["metadata"]["uid"]
        resp = n.kubelet.prepare(c).claims[uid]
        assert resp.error == ""
        [dev] = resp.devices
        assert (dev.pool_name, dev.device_name, list(dev.request_names)) == (n.name, "vf1", ["vf"])
        assert list(dev.cdi_device_ids) == [f"{DRIVER}/vf={uid}-vf1"]
        vf = n.host.admin.vf(1)
        assert (vf["fb_total"], vf["weight"]) == (96 * MiB, 3)
        log.warning("claim %s prepared: VF1 fb %d weight %s, CDI %s", uid, vf["fb_total"],
                    vf["weight"], list(dev.cdi_device_ids))  # fmt: skip
        n.api.wait_for(lambda a: _attr(a, n.name, "vf1", "fbBytes") == 96 * MiB)
        assert _attr(n.api, n.name, "vf1", "weight") == 3

        edits = cdi_device(n.plugin.cdi_dir, dev.cdi_device_ids[0])["containerEdits"]
        token_mount = [m for m in edits["mounts"] if m["containerPath"] == "/run/gpuvirt/token"]
        assert token_mount and "ro" in token_mount[0]["options"]
        # A neighbour on VF0 with weight 1, so that the claim's weight shows in the shares.
        with gpuvirt.attach(vf=0, socket=n.host.socket, token=n.host.token(0)):
            guest = container(edits, GUEST)
            assert guest.stdout is not None and guest.stdin is not None
            line = guest.stdout.readline()
            assert line, f"the guest failed: {guest.communicate()[1]}"
            out = json.loads(line)
            # Both attached: the scheduler gives VF1 its claim's weight against VF0's 1.
            share = n.host.admin.vf(1)["configured_share"]
            guest.stdin.write("done\n")
            guest.stdin.close()
            assert guest.wait(30) == 0, guest.stderr.read() if guest.stderr else ""
        # 40 MiB of data: more than the VF's own 32 MiB, so only the claimed FB holds it.
        assert out["fb_size"] == 96 * MiB
        assert out["sum"] == 3.0 * 10 * MiB
        assert share == pytest.approx(0.75)
        log.warning("guest via CDI on VF1: %s, configured share %.2f", out, share)

        after = last_seq(n.host)
        resp = n.kubelet.unprepare(c).claims[uid]
        assert resp.error == ""
        wait_event(n.host, lambda e: e["vf"] == 1 and e["kind"] == "clear_fb", after=after)
        vf = n.host.admin.vf(1)
        assert (vf["fb_total"], vf["weight"], vf["state"]) == (32 * MiB, 1, "AVAIL")
        assert list(n.plugin.cdi_dir.glob("*.json")) == []
        log.warning("claim %s unprepared: VF1 back to fb %d weight %s, FB scrubbed",
                    uid, vf["fb_total"], vf["weight"])  # fmt: skip
        # Again: nothing left to do, and no error.
        assert n.kubelet.unprepare(c).claims[uid].error == ""
        assert n.api.rejected == []


GUEST = """
import json, os, sys
import numpy as np
import gpuvirt
# Only what the CDI spec gave: no token in the environment, no node paths.
assert "GPUVIRT_TOKEN" not in os.environ and os.listdir("/tmp") == []
with gpuvirt.attach() as gpu:
    x = gpu.alloc((10, 1024 * 1024), np.float32)   # 40 MiB
    x.write(np.ones((10, 1024 * 1024), np.float32))
    @gpuvirt.kernel
    def scale(xp, a, factor):
        a *= factor
    gpu.launch(scale, x, factor=3.0).result(timeout=30)
    total = float(x.read().sum(dtype=np.float64))
    print(json.dumps({"fb_size": gpu.fb_size, "sum": total}), flush=True)
    sys.stdin.readline()  # attached until the test has looked at the host
"""
