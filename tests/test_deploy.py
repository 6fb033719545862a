"""deploy/: every manifest valid against the Kubernetes OpenAPI schema of every version we
claim (strict: unknown fields are errors), and consistent with gpuvirt itself: the
ConfigMap is a host configuration gpuvirt accepts, the containers' commands parse, and
the paths the device plugin hands to pods are the node's own."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import typer.main
import yaml
from kubernetes_validate.utils import all_versions, latest_version, major_minor

from gpuvirt.cli.main import app
from gpuvirt.config import parse_config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
OLDEST = "1.34"  # DESIGN.md: kubelet >= 1.34 (the DRA driver needs resource.k8s.io/v1)
VERSIONS = sorted(
    {major_minor(v) for v in all_versions() if major_minor(v) >= major_minor(OLDEST)},
    key=lambda v: tuple(int(x) for x in v.split(".")),
)
# deploy/dra (the DRA driver, tests/test_dra_deploy.py) is an overlay of its own.
MANIFESTS = sorted(
    p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml" and p.parent.name != "dra"
)


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(kind: str) -> dict[str, Any]:
    (found,) = [d for p in MANIFESTS for d in docs(p) if d["kind"] == kind]
    return found


def test_we_claim_the_oldest_and_the_newest_schema_there_is() -> None:
    assert VERSIONS[0] == OLDEST and VERSIONS[-1] == major_minor(latest_version())


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifest_is_valid_for(path: Path, version: str) -> None:
    for doc in docs(path):
        assert kubernetes_validate.validate(doc, version, strict=True) == version


def test_kustomization_lists_the_manifests_and_the_namespace() -> None:
    k = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert k["kind"] == "Kustomization"
    listed = {DEPLOY / r for r in k["resources"]}
    assert listed == {p for p in MANIFESTS if p.parent == DEPLOY}, "every base manifest, once"
    for p in listed:
        for d in docs(p):
            assert d["metadata"].get("namespace", k["namespace"]) == k["namespace"] or (
                d["kind"] == "Namespace" and d["metadata"]["name"] == k["namespace"]
            )


def _pod() -> dict[str, Any]:
    return by_kind("DaemonSet")["spec"]["template"]["spec"]


def _container(name: str) -> dict[str, Any]:
    (c,) = [c for c in _pod()["containers"] if c["name"] == name]
    return c


def _host_path(container: dict[str, Any], path: str) -> str:
    """Where `path` inside the container lives on the node, by its volume mounts."""
    volumes = {v["name"]: v for v in _pod()["volumes"]}
    for m in sorted(container["volumeMounts"], key=lambda m: -len(m["mountPath"])):
        if PurePosixPath(path).is_relative_to(m["mountPath"]):
            v = volumes[m["name"]]
            assert "hostPath" in v, f"{path} is on volume {m['name']}, not the node's"
            return str(
                PurePosixPath(v["hostPath"]["path"])
                / PurePosixPath(path).relative_to(m["mountPath"])
            )
    raise AssertionError(f"{path} is not mounted in container {container['name']}")


def test_the_configmap_is_a_host_configuration_gpuvirt_accepts() -> None:
    cfg = parse_config(by_kind("ConfigMap")["data"]["gpuvirt.toml"], source="deploy/configmap.yaml")
    sock = cfg.host.socket_path(create=False)
    state = cfg.host.state_path(create=False)
    # The socket alone in its directory (so pods get the directory), tokens elsewhere.
    assert sock.parent != cfg.host.admin_address(create=False).parent
    assert not state.is_relative_to(sock.parent)
    for name in ("host", "device-plugin"):
        c = _container(name)
        for path in (str(sock), str(state)):
            assert _host_path(c, path) == path, f"{name}: {path} must be the node's same path"
    plugin = _container("device-plugin")
    args = plugin["command"]
    plugin_dir = args[args.index("--plugin-dir") + 1]
    assert _host_path(plugin, plugin_dir) == plugin_dir == "/var/lib/kubelet/device-plugins"
    assert args[args.index("--resource") + 1] == "gpuvirt.io/vf"


@pytest.mark.parametrize("name", ["host", "device-plugin"])
def test_the_containers_commands_parse(name: str) -> None:
    command = _container(name)["command"]
    assert command[0] == "gpuvirt"
    sub: Any = typer.main.get_command(app)
    ctx = sub.make_context("gpuvirt", [], resilient_parsing=True)
    words = list(command[1:])
    while hasattr(sub, "get_command"):  # a group (typer's own click, not the click package)
        name_, *words = words
        found = sub.get_command(ctx, name_)
        assert found is not None, f"no command {name_!r}"
        sub = found
        ctx = sub.make_context(name_, [], parent=ctx, resilient_parsing=True)
    ctx = sub.make_context(name_, words, parent=ctx.parent)  # raises on a bad option
    assert ctx.params.get("config") == Path("/etc/gpuvirt/gpuvirt.toml")


def test_the_example_pod_asks_for_a_vf_and_runs_a_guest() -> None:
    (pod,) = docs(DEPLOY / "examples" / "pod.yaml")
    (c,) = pod["spec"]["containers"]
    assert c["resources"]["limits"] == {"gpuvirt.io/vf": 1}
    assert c["command"][:2] == ["python", "-c"]
    code = compile(c["command"][2], "deploy/examples/pod.yaml", "exec")
    assert "attach" in code.co_names
