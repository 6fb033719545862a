"""deploy/dra/: every manifest valid for every Kubernetes version the driver claims
(resource.k8s.io/v1: 1.34 and later, as far as kubernetes-validate ships schemas),
and consistent with the driver: the flags it takes, the API verbs it uses, the
parameters it accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from gpuvirt.cli.main import app
from gpuvirt.k8s.dra.params import DRIVER, parse_config
from k8s_schema import DRA_VERSIONS, problems

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "dra"


def _docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        out += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def _one(kind: str) -> dict[str, Any]:
    [doc] = [d for _, d in _docs() if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("version", DRA_VERSIONS)
def test_every_manifest_is_valid(version: str) -> None:
    docs = _docs()
    assert {d["kind"] for _, d in docs} >= {
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding", "DeviceClass", "ResourceClaimTemplate", "Pod",
        "DaemonSet",
    }  # fmt: skip
    bad = [
        f"{name} {d['kind']}/{d['metadata']['name']}: {p}"
        for name, d in docs
        for p in problems(d, version)
    ]
    assert bad == []


def test_the_validation_can_fail() -> None:
    dc = _one("DeviceClass")
    dc["spec"]["selectors"][0]["cel"]["expresion"] = "typo"
    assert any("expresion" in p for p in problems(dc, DRA_VERSIONS[0]))


def test_kustomization_is_deploy_without_the_device_plugin() -> None:
    k = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert k["resources"] == ["..", "rbac.yaml", "deviceclass.yaml", "daemonset.yaml"]
    assert all((DEPLOY / r).exists() for r in k["resources"])
    # The patch takes the device plugin out of the base's DaemonSet: both on one node
    # would hand out the same VFs.
    [p] = k["patches"]
    patch = yaml.safe_load(p["patch"])
    base = [d for d in yaml.safe_load_all((DEPLOY.parent / "daemonset.yaml").read_text()) if d]
    [ds] = [d for d in base if d["kind"] == "DaemonSet"]
    assert p["target"] == {"kind": "DaemonSet", "name": ds["metadata"]["name"]}
    assert patch["metadata"]["name"] == ds["metadata"]["name"]
    [gone] = patch["spec"]["template"]["spec"]["containers"]
    assert gone == {"name": "device-plugin", "$patch": "delete"}
    assert "device-plugin" in [c["name"] for c in ds["spec"]["template"]["spec"]["containers"]]
    # The same namespace and ConfigMap as the base.
    base_k = yaml.safe_load((DEPLOY.parent / "kustomization.yaml").read_text())
    assert k["namespace"] == base_k["namespace"] == _one("DaemonSet")["metadata"]["namespace"]
    cms = [
        v["configMap"]["name"]
        for v in ds["spec"]["template"]["spec"]["volumes"]
        if "configMap" in v
    ]
    mine = _one("DaemonSet")["spec"]["template"]["spec"]["volumes"]
    assert [v["configMap"]["name"] for v in mine if "configMap" in v] == cms


def test_the_device_class_and_the_example_claim_fit_the_driver() -> None:
    dc = _one("DeviceClass")
    assert dc["metadata"]["name"] == "vf.gpuvirt.io"
    assert f'device.driver == "{DRIVER}"' in dc["spec"]["selectors"][0]["cel"]["expression"]
    tmpl = _one("ResourceClaimTemplate")["spec"]["spec"]["devices"]
    assert tmpl["requests"][0]["exactly"]["deviceClassName"] == "vf.gpuvirt.io"
    [cfg] = tmpl["config"]
    assert cfg["opaque"]["driver"] == DRIVER
    parsed = parse_config(cfg["opaque"]["parameters"])  # what the driver will make of it
    assert (parsed.fb, parsed.weight) == (4 << 30, 3)
    pod = _one("Pod")["spec"]
    assert pod["resourceClaims"][0]["resourceClaimTemplateName"] == "vf-4gib"
    assert pod["containers"][0]["resources"]["claims"] == [
        {"name": pod["resourceClaims"][0]["name"]}
    ]


def test_rbac_grants_what_the_driver_calls() -> None:
    rules = {(r["resources"][0], v) for r in _one("ClusterRole")["rules"] for v in r["verbs"]}
    # What slices.py and kube.py do: read claims; list, create, update, delete slices.
    needed = {("resourceclaims", "get")} | {
        ("resourceslices", v) for v in ("list", "create", "update", "delete")
    }
    assert needed <= rules
    assert not any(v in ("*", "deletecollection", "patch") for _, v in rules)
    sa = _one("ServiceAccount")["metadata"]
    policy = _one("ValidatingAdmissionPolicy")["spec"]
    assert (
        f"system:serviceaccount:{sa['namespace']}:{sa['name']}"
        in policy["matchConditions"][0]["expression"]
    )
    assert _one("DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"] == sa["name"]


def test_the_daemonset_runs_the_command_with_flags_it_has() -> None:
    c = _one("DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["gpuvirt", "k8s", "dra-plugin"]
    cli = typer.main.get_command(app)
    cmd = cli.commands["k8s"].commands["dra-plugin"]  # type: ignore[attr-defined]
    flags = {o for p in cmd.params for o in p.opts}
    given = {a.split("=", 1)[0] for a in c["args"]}
    assert given <= flags, given - flags
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    for a in c["args"]:
        if a.startswith(("--registry-dir", "--plugin-dir", "--cdi-dir")):
            assert a.split("=", 1)[1] in mounts  # what it writes reaches the node
