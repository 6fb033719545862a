"""The DRA driver's pure parts and files, without gRPC or a host: claim parameters,
the CDI spec, the checkpoint, the slice's devices, and the pinned wire contract."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dra_env import claim
from gpuvirt.config import GiB, MiB
from gpuvirt.k8s.devices import allocate, host_view
from gpuvirt.k8s.dra import cdi
from gpuvirt.k8s.dra.checkpoint import (
    Checkpoint,
    CheckpointError,
    ClaimEntry,
    Phase,
    PreparedDevice,
)
from gpuvirt.k8s.dra.params import ClaimError, VfConfig, parse_config, vf_index, wanted
from gpuvirt.k8s.dra.slices import build_slice, devices
from gpuvirt.k8s.proto.dra.v1 import api_pb2 as dra
from gpuvirt.k8s.proto.pluginregistration.v1 import api_pb2 as reg
from k8s_apiserver import ApiServer
from k8s_schema import DRA_VERSIONS

# ---- parameters --------------------------------------------------------------------


def test_parameters_in_the_documented_form() -> None:
    full = {"apiVersion": "gpuvirt.io/v1", "kind": "VfConfig", "fb": "4GiB", "weight": 3}
    assert parse_config(full) == VfConfig(fb=4 * GiB, weight=3)
    assert parse_config({}) == VfConfig()
    assert parse_config(json.dumps({"fb": 64 * MiB})) == VfConfig(fb=64 * MiB)
    assert VfConfig(weight=2).as_admin() == {"weight": 2}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(
    params=json_values
    | st.dictionaries(st.sampled_from(["fb", "weight", "kind", "x"]), json_values)
)
def test_any_parameters_give_a_config_or_a_claim_error(params: Any) -> None:
    try:
        cfg = parse_config(params, "claim ns/c: parameters")
    except ClaimError as e:
        assert str(e).startswith("claim ns/c: parameters")
    else:
        assert isinstance(params, dict) and set(params) <= {"fb", "weight", "kind"}
        assert cfg.weight is None or cfg.weight > 0


def test_class_config_then_claim_config_key_by_key() -> None:
    c = claim("n1", ["vf0", "vf1"], {"weight": 5}, class_parameters={"fb": "2GiB", "weight": 1})
    got = wanted(c, "n1")
    assert [(w.device, w.config) for w in got] == [
        ("vf0", VfConfig(fb=2 * GiB, weight=5)),
        ("vf1", VfConfig(fb=2 * GiB, weight=5)),
    ]


def test_a_config_for_other_requests_or_drivers_does_not_apply() -> None:
    c = claim("n1", ["vf0"], {"weight": 5})
    c["status"]["allocation"]["devices"]["config"] += [
        {"source": "FromClaim", "requests": ["other"], "opaque": {"driver": "gpuvirt.io", "parameters": {"x": 1}}},
        {"source": "FromClaim", "opaque": {"driver": "gpu.example.com", "parameters": {"y": 2}}},
    ]  # fmt: skip
    assert wanted(c, "n1")[0].config == VfConfig(weight=5)


def test_a_subrequest_result_takes_its_parent_requests_config() -> None:
    c = claim("n1", ["vf0"], {"weight": 2})
    c["status"]["allocation"]["devices"]["results"][0]["request"] = "vf/small"
    [w] = wanted(c, "n1")
    assert (w.request, w.config) == ("vf/small", VfConfig(weight=2))


def test_each_config_is_checked_where_it_was_written() -> None:
    c = claim("n1", ["vf0"], {"weight": 2}, class_parameters={"bogus": True})
    with pytest.raises(
        ClaimError, match=r"config\[0\] \(FromClass\) parameters: bogus = true: unknown key"
    ):
        wanted(c, "n1")


def test_unallocated_claims_and_foreign_devices() -> None:
    c = claim("n1", ["vf0"])
    del c["status"]
    with pytest.raises(ClaimError, match="is not allocated yet"):
        wanted(c, "n1")
    for name in ("vf2", "vf01", "vf-1", "gpu0", "vf"):
        with pytest.raises(ClaimError, match=f"'{name}' is not a VF of this node"):
            vf_index(name, 2)
    assert vf_index("vf1", 2) == 1


# ---- CDI ---------------------------------------------------------------------------


def _status(run: Path, socket: Path) -> dict[str, Any]:
    vfs = []
    for i in (0, 1):
        token = run / f"vf{i}.token"
        token.write_text(str(i) * 64)
        vfs.append({"index": i, "state": "AVAIL", "fb_total": MiB, "token_file": str(token)})
    return {"socket": str(socket), "pid": 1, "vfs": vfs}


def _spec(status: dict[str, Any], vf: int) -> dict[str, Any]:
    return cdi.build_spec("uid-1", {vf: allocate(host_view(status), [f"vf{vf}"])})


def _mounts(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["containerPath"]: m for m in spec["devices"][0]["containerEdits"]["mounts"]}


def test_cdi_spec_mounts_the_socket_and_only_this_vfs_token(tmp_path: Path) -> None:
    sock = tmp_path / "host.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))
        # tokens beside the socket: the directory must never be mounted
        spec = _spec(_status(tmp_path, sock), 1)
    assert spec["kind"] == "gpuvirt.io/vf" and spec["devices"][0]["name"] == "uid-1-vf1"
    mounts = _mounts(spec)
    assert set(mounts) == {"/run/gpuvirt/mailbox/host.sock", "/run/gpuvirt/tokens/vf1.token"}
    assert mounts["/run/gpuvirt/mailbox/host.sock"]["hostPath"] == str(sock)
    assert mounts["/run/gpuvirt/tokens/vf1.token"]["hostPath"] == str(tmp_path / "vf1.token")
    assert all("ro" in m["options"] for m in mounts.values())
    env = spec["devices"][0]["containerEdits"]["env"]
    assert "GPUVIRT_VF=1" in env and "GPUVIRT_TOKEN_FILE=/run/gpuvirt/tokens/vf1.token" in env
    assert "GPUVIRT_SOCKET=/run/gpuvirt/mailbox/host.sock" in env
    assert not any(e.startswith("GPUVIRT_TOKEN=") for e in env)  # never the secret itself


def test_cdi_spec_mounts_a_socket_dir_that_holds_nothing_else(tmp_path: Path) -> None:
    # A host restart makes a new socket file; a directory mount still sees it.
    (tmp_path / "sock").mkdir()
    sock = tmp_path / "sock" / "host.sock"
    sock.touch()
    mounts = _mounts(_spec(_status(tmp_path, sock), 0))
    assert mounts["/run/gpuvirt/mailbox"]["hostPath"] == str(sock.parent)


def test_cdi_files_are_written_whole_and_removed(tmp_path: Path) -> None:
    (tmp_path / "sock").mkdir()
    status = _status(tmp_path, tmp_path / "sock" / "host.sock")
    edits = {0: allocate(host_view(status), ["vf0"])}
    path = cdi.write_spec(tmp_path / "cdi", "u1", edits)
    assert path == tmp_path / "cdi" / "gpuvirt.io-vf_u1.json"
    assert json.loads(path.read_text())["cdiVersion"] == cdi.CDI_VERSION
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file left
    cdi.remove_spec(tmp_path / "cdi", "u1")
    cdi.remove_spec(tmp_path / "cdi", "u1")  # again: nothing to do
    assert list(path.parent.iterdir()) == []
    with pytest.raises(ValueError, match="does not make a CDI device name"):
        cdi.device_id("bad uid/", 0)


# ---- checkpoint --------------------------------------------------------------------


def _entry(vf: int = 1) -> ClaimEntry:
    dev = PreparedDevice(
        "vf", "n1", f"vf{vf}", vf, [f"gpuvirt.io/vf=u-vf{vf}"], {"fb": 1, "weight": 1.0}
    )
    return ClaimEntry("default", "c", Phase.PREPARED, [dev])


def test_checkpoint_round_trip_and_holder(tmp_path: Path) -> None:
    ck = Checkpoint(tmp_path / "ck.json")
    ck.claims["u"] = _entry(1)
    ck.save()
    assert os.stat(ck.path).st_mode & 0o777 == 0o600
    again = Checkpoint(ck.path).load()
    assert again.claims == ck.claims
    assert (again.holder(1), again.holder(0)) == ("u", None)
    assert Checkpoint(tmp_path / "none.json").load().claims == {}


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda t: t.replace('"vf": 1', '"vf": 0'), "checksum or version mismatch"),
        (lambda t: t.replace('"version": 1', '"version": 9'), "checksum or version mismatch"),
        (lambda t: t[: len(t) // 2], "unreadable"),
        (lambda t: "[]", "unreadable"),
    ],
)
def test_a_damaged_checkpoint_is_refused(tmp_path: Path, damage: Any, message: str) -> None:
    ck = Checkpoint(tmp_path / "ck.json")
    ck.claims["u"] = _entry(1)
    ck.save()
    ck.path.write_text(damage(ck.path.read_text()))
    with pytest.raises(CheckpointError, match=message):
        Checkpoint(ck.path).load()


# ---- the slice ---------------------------------------------------------------------


VFS = [
    {"index": 0, "state": "ACTIVE", "fb_total": 512 * MiB, "weight": 2.0},
    {"index": 1, "state": "QUARANTINED", "fb_total": 256 * MiB, "weight": 0.5},
]


def test_slice_devices_follow_the_vf_table() -> None:
    d0, d1 = devices(VFS, "emu")
    assert d0["attributes"]["health"] == {"string": "Healthy"}
    assert d1["attributes"]["health"] == {"string": "Unhealthy"}
    assert d1["attributes"]["weight"] == {"int": 1}  # no floats in DRA attributes
    assert d0["capacity"]["fb"] == {"value": str(512 * MiB)}
    gone = devices(VFS, "emu", reachable=False)
    assert {d["attributes"]["health"]["string"] for d in gone} == {"Unhealthy"}
    assert {d["attributes"]["state"]["string"] for d in gone} == {"UNKNOWN"}


def test_the_slice_is_valid_for_every_version_claimed() -> None:
    assert DRA_VERSIONS[0] == "1.34.0" and len(DRA_VERSIONS) >= 2
    body = build_slice("worker-1.example.com", 7, devices(VFS, "cuda"))
    assert ApiServer().check(body) == []
    bad = build_slice("worker-1", 1, devices(VFS, "emu"))
    bad["spec"]["devices"][0]["attributes"]["index"] = {"int": 0, "string": "0"}
    bad["spec"]["devices"][0]["colour"] = "red"
    problems = ApiServer().check(bad)
    assert any("colour" in p for p in problems) and any("exactly one of" in p for p in problems)


# ---- the pinned wire contract ------------------------------------------------------


def _fields(msg: Any) -> list[tuple[str, int, str]]:
    return [(f.name, f.number, f.type) for f in msg.DESCRIPTOR.fields]


def test_rpc_paths_and_fields_are_upstreams() -> None:
    """What the kubelet sends and expects, from upstream's api.proto (Kubernetes 1.34)."""
    assert dra.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"
    svc = dra.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert [m.name for m in svc.methods] == ["NodePrepareResources", "NodeUnprepareResources"]
    string, msg, boolean = 9, 11, 8
    assert _fields(dra.Claim) == [("namespace", 1, string), ("uid", 2, string), ("name", 3, string)]
    assert _fields(dra.Device) == [
        ("request_names", 1, string), ("pool_name", 2, string),
        ("device_name", 3, string), ("cdi_device_ids", 4, string),
    ]  # fmt: skip
    assert _fields(dra.NodePrepareResourceResponse) == [("devices", 1, msg), ("error", 2, string)]
    assert _fields(dra.NodeUnprepareResourceResponse) == [("error", 1, string)]
    assert _fields(dra.NodePrepareResourcesRequest) == [("claims", 1, msg)]
    assert (
        dra.NodePrepareResourcesResponse.DESCRIPTOR.fields_by_name["claims"]
        .message_type.GetOptions()
        .map_entry
    )
    assert not dra.DESCRIPTOR.dependencies and not reg.DESCRIPTOR.dependencies  # no gogo
    assert reg.DESCRIPTOR.package == "pluginregistration"
    rsvc = reg.DESCRIPTOR.services_by_name["Registration"]
    assert [m.name for m in rsvc.methods] == ["GetInfo", "NotifyRegistrationStatus"]
    assert _fields(reg.PluginInfo) == [
        ("type", 1, string), ("name", 2, string), ("endpoint", 3, string),
        ("supported_versions", 4, string),
    ]  # fmt: skip
    assert _fields(reg.RegistrationStatus) == [
        ("plugin_registered", 1, boolean),
        ("error", 2, string),
    ]
