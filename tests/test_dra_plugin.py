"""The DRA driver end to end: a real host, the driver as its own process, a kubelet
stand-in on gRPC and an API-server stand-in that checks every object against the
Kubernetes schema. Nothing of ours is mocked."""

from __future__ import annotations

import json
import logging
import signal
import threading
from typing import Any

import pytest

import gpuvirt
from dra_env import DRIVER, Kubelet, cdi_device, claim, container, node
from gpuvirt.config import MiB
from helpers import MakeHost, bound_under_tmp, last_seq, wait_event

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


def test_registers_publishes_follows_and_removes_its_slice(make_host: MakeHost) -> None:
    with node(make_host, **HOST) as n:
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


def test_a_refused_registration_ends_the_plugin_with_the_reason(make_host: MakeHost) -> None:
    with node(make_host, **HOST) as n:
        n.kubelet.register(accept=False, error="no supported version")
        assert n.plugin.proc is not None
        assert n.plugin.proc.wait(30) == 1
        assert "refused the registration: no supported version" in n.plugin.log.read_text()
        assert n.api.slices == {}


def test_one_claim_from_slice_to_guest_to_scrub(make_host: MakeHost) -> None:
    """The whole path, logged: slice published → claim prepared with fb/weight → a guest
    attached through the CDI spec alone computes with that FB and weight → unprepared
    and scrubbed."""
    with node(make_host, **HOST) as n:
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
        token = [
            m for m in edits["mounts"] if m["containerPath"] == "/run/gpuvirt/tokens/vf1.token"
        ]
        assert token and "ro" in token[0]["options"]
        assert token[0]["hostPath"] == n.host.admin.vf(1)["token_file"]
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
# (/tmp holds only where a clone under /tmp binds the interpreter: BOUND)
assert "GPUVIRT_TOKEN" not in os.environ and sorted(os.listdir("/tmp")) == BOUND
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
""".replace(
    "BOUND",
    repr(bound_under_tmp()),
)


def _set_events(hp: Any, vf: int) -> list[dict[str, Any]]:
    return [e for e in hp.admin.events(after=0, vf=vf) if e["kind"] == "set"]


def test_prepare_and_unprepare_are_idempotent_across_a_plugin_restart(make_host: MakeHost) -> None:
    with node(make_host, **HOST) as n:
        n.kubelet.register()
        c = n.api.put_claim(claim(n.name, ["vf0"], {"fb": "64MiB", "weight": 2}))
        uid = c["metadata"]["uid"]
        first = n.kubelet.prepare(c).claims[uid]
        assert first.error == ""
        assert n.kubelet.prepare(c).claims[uid] == first  # asked again: the same answer
        assert len(_set_events(n.host, 0)) == 1  # ... and the VF set once

        # The plugin dies without cleaning up; the kubelet's next plugin finds the claim.
        assert n.plugin.stop(signal.SIGKILL) == -signal.SIGKILL
        (n.plugin.cdi_dir / f"{DRIVER}-vf_{uid}.json").unlink()  # a runtime dir wiped meanwhile
        n.plugin.start()
        assert "1 prepared claim(s) from the checkpoint" in n.plugin.ready_line
        kubelet = Kubelet(n.plugin.registry_dir)
        kubelet.register()
        try:
            again = kubelet.prepare(c).claims[uid]
            assert again == first
            assert len(_set_events(n.host, 0)) == 1
            assert cdi_device(n.plugin.cdi_dir, first.devices[0].cdi_device_ids[0])
            assert kubelet.unprepare(c).claims[uid].error == ""
            vf = n.host.admin.vf(0)
            assert (vf["fb_total"], vf["weight"]) == (32 * MiB, 1)
            # Restarted once more: the claim is gone from the checkpoint too.
            n.plugin.stop()
            n.plugin.start()
            assert "0 prepared claim(s)" in n.plugin.ready_line
        finally:
            kubelet.close()


def test_a_damaged_checkpoint_is_refused_with_its_path(make_host: MakeHost) -> None:
    with node(make_host, **HOST) as n:
        n.kubelet.register()
        c = n.api.put_claim(claim(n.name, ["vf0"], {"weight": 2}))
        assert n.kubelet.prepare(c).claims[c["metadata"]["uid"]].error == ""
        n.plugin.stop()
        ckpt = n.plugin.plugin_dir / "checkpoint.json"
        text = ckpt.read_text()
        assert '"vf": 0' in text
        ckpt.write_text(text.replace('"vf": 0', '"vf": 1'))  # valid JSON, wrong contents
        with pytest.raises(AssertionError, match="plugin exited with 1"):
            n.plugin.start()
        said = "".join(n.plugin.log.read_text().split())  # the terminal may fold it
        assert "".join(f"checkpoint {ckpt}: checksum or version mismatch".split()) in said


def test_concurrent_claims_never_share_a_vf(make_host: MakeHost) -> None:
    with node(make_host, **HOST) as n:
        n.kubelet.register()
        # A stale scheduler view: two claims allocated the same VF, prepared at once.
        a, b = (n.api.put_claim(claim(n.name, ["vf1"], {"weight": w})) for w in (2, 4))
        results: dict[str, Any] = {}

        def prepare(c: dict[str, Any]) -> None:
            results[c["metadata"]["uid"]] = n.kubelet.prepare(c).claims[c["metadata"]["uid"]]

        threads = [threading.Thread(target=prepare, args=(c,)) for c in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        errors = sorted(r.error for r in results.values())
        assert errors[0] == "" and "VF1 is prepared for claim default/" in errors[1], errors
        winner = a if results[a["metadata"]["uid"]].error == "" else b
        weight = winner["spec"]["devices"]["config"][0]["opaque"]["parameters"]["weight"]
        assert n.host.admin.vf(1)["weight"] == weight
        loser = b if winner is a else a
        # The loser's unprepare (the kubelet sends it) must not free the winner's VF.
        assert n.kubelet.unprepare(loser).claims[loser["metadata"]["uid"]].error == ""
        assert n.host.admin.vf(1)["weight"] == weight

        # Claims on different VFs, in one call and concurrently: each gets its own.
        c0, c1 = (n.api.put_claim(claim(n.name, [f"vf{i}"])) for i in (0, 1))
        assert n.kubelet.unprepare(winner).claims[winner["metadata"]["uid"]].error == ""
        resp = n.kubelet.prepare(c0, c1)
        got = {resp.claims[c["metadata"]["uid"]].devices[0].device_name for c in (c0, c1)}
        assert got == {"vf0", "vf1"}


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"fb": "64MiB", "colour": "red"}, 'colour = "red": unknown key'),
        ({"fbb": "1GiB"}, 'fbb = "1GiB": unknown key; did you mean fb?'),
        ({"fb": "64GiB"}, "fb = 64 GiB: does not fit the device"),
        ({"fb": "8KiB"}, 'fb = "8KiB": must be at least 1 MiB'),
        ({"weight": 0}, "weight = 0: must be greater than 0"),
        ({"weight": "heavy"}, 'weight = "heavy": expected a number'),
        ({"kind": "GpuConfig"}, "kind = \"GpuConfig\": must be 'VfConfig'"),
    ],
)
def test_a_bad_parameter_fails_that_claim_only(
    make_host: MakeHost, params: dict[str, Any], expected: str
) -> None:
    with node(make_host, **HOST) as n:
        n.kubelet.register()
        bad = n.api.put_claim(claim(n.name, ["vf0"], params))
        good = n.api.put_claim(claim(n.name, ["vf1"], {"weight": 2}))
        resp = n.kubelet.prepare(bad, good)
        error = resp.claims[bad["metadata"]["uid"]].error
        assert expected in error, error
        assert f"claim default/{bad['metadata']['name']}" in error
        assert resp.claims[good["metadata"]["uid"]].error == ""
        # The bad claim left nothing behind: VF0 as it was, free for the next claim.
        vf0 = n.host.admin.vf(0)
        assert (vf0["fb_total"], vf0["weight"]) == (32 * MiB, 1)
        retry = n.api.put_claim(claim(n.name, ["vf0"], {"weight": 3}))
        assert n.kubelet.prepare(retry).claims[retry["metadata"]["uid"]].error == ""
        assert n.plugin.proc is not None and n.plugin.proc.poll() is None


def test_claims_the_driver_cannot_serve_fail_with_the_reason(make_host: MakeHost) -> None:
    with node(make_host, **HOST) as n:
        n.kubelet.register()
        missing = claim(n.name, ["vf0"], name="never-stored")
        elsewhere = n.api.put_claim(claim("other-node", ["vf0"]))
        not_ours = n.api.put_claim(claim(n.name, ["gpu7"]))
        stale = n.api.put_claim(claim(n.name, ["vf0"]))
        stale = {**stale, "metadata": {**stale["metadata"], "uid": "0000-old"}}
        resp = n.kubelet.prepare(missing, elsewhere, not_ours, stale)

        def error(c: dict[str, Any]) -> str:
            return resp.claims[c["metadata"]["uid"]].error

        assert 'resourceclaims "never-stored" not found' in error(missing)
        assert f"has no {DRIVER} device on node {n.name!r}" in error(elsewhere)
        assert "(its devices are in pools other-node)" in error(elsewhere)
        assert "allocated device 'gpu7' is not a VF of this node (it has vf0..vf1)" in error(
            not_ours
        )
        assert "it was deleted and made again" in error(stale)
        assert error(not_ours).startswith(f"claim default/{not_ours['metadata']['name']}: ")

        n.host.admin.vf(1, "disable")
        off = n.api.put_claim(claim(n.name, ["vf1"]))
        got = n.kubelet.prepare(off).claims[off["metadata"]["uid"]].error
        assert (
            got
            == f"claim default/{off['metadata']['name']}: VF1 is UNAVAIL; it cannot take a guest now"
        )
        assert n.plugin.proc is not None and n.plugin.proc.poll() is None


def test_the_slice_shows_a_host_restart(make_host: MakeHost) -> None:
    with node(make_host, **HOST) as n:
        n.api.wait_for(lambda a: _attr(a, n.name, "vf0", "health") == "Healthy")
        n.host.stop()
        n.api.wait_for(
            lambda a: {_attr(a, n.name, v, "state") for v in ("vf0", "vf1")} == {"UNKNOWN"}
        )
        assert _attr(n.api, n.name, "vf1", "health") == "Unhealthy"
        n.host.start()
        n.api.wait_for(lambda a: _attr(a, n.name, "vf1", "health") == "Healthy")
        assert n.api.rejected == []
