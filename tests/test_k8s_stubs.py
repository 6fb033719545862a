"""The committed gRPC stubs are exactly what the pinned generator makes of the pinned .proto."""

from __future__ import annotations

from pathlib import Path

from gpuvirt.k8s.proto import generate
from gpuvirt.k8s.proto.deviceplugin.v1beta1 import api_pb2


def test_regenerating_the_stubs_changes_nothing(tmp_path: Path) -> None:
    made = generate.generate(tmp_path)
    assert made, "no stubs generated"
    for path in made:
        rel = path.relative_to(tmp_path)
        committed = generate.SRC / rel
        assert committed.exists(), f"{rel} is generated but not committed"
        assert committed.read_text() == path.read_text(), (
            f"{rel} differs from what grpcio-tools makes of its .proto; "
            "run `python -m gpuvirt.k8s.proto.generate` and commit the result"
        )
    committed = {p.relative_to(generate.SRC) for p in generate.HERE.rglob("*_pb2*.py")}
    assert committed == {p.relative_to(tmp_path) for p in made}, "a stub without its .proto"


def test_the_stubs_speak_the_kubelets_api() -> None:
    # What the kubelet dials and calls: package v1beta1, these services and methods.
    file = api_pb2.DESCRIPTOR
    assert file.package == "v1beta1"
    methods = {s: [m.name for m in d.methods] for s, d in file.services_by_name.items()}
    assert methods == {
        "Registration": ["Register"],
        "DevicePlugin": [
            "GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate",
            "PreStartContainer",
        ],
    }  # fmt: skip
    assert not file.dependencies, "no gogo (or any other) import"
    resp = api_pb2.ContainerAllocateResponse.DESCRIPTOR
    assert [(f.name, f.number) for f in resp.fields] == [
        ("envs", 1), ("mounts", 2), ("devices", 3), ("annotations", 4), ("cdi_devices", 5),
    ]  # fmt: skip
