"""The device, guest and NetGPU layers have no import cycles (#15), checked on the real graph."""

from __future__ import annotations

import grimp
import pytest

LAYERS = ("gpuvirt.device", "gpuvirt.guest", "gpuvirt.netgpu")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("gpuvirt", exclude_type_checking_imports=True)


def test_no_module_cycle_in_device_guest_netgpu(graph: grimp.ImportGraph) -> None:
    cycles = []
    for module in sorted(graph.modules):
        if not module.startswith(LAYERS):
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            if graph.chain_exists(importer=imported, imported=module):
                cycles.append(graph.find_shortest_chain(importer=module, imported=imported))
                cycles.append(graph.find_shortest_chain(importer=imported, imported=module))
    assert cycles == []


@pytest.mark.parametrize(
    ("lower", "upper"),
    [("gpuvirt.guest", "gpuvirt.netgpu"), ("gpuvirt.device", "gpuvirt.guest")],
)
def test_lower_layer_does_not_import_upper(
    graph: grimp.ImportGraph, lower: str, upper: str
) -> None:
    """NetGPU is built on the guest library, not the other way round."""
    assert graph.find_illegal_dependencies_for_layers(layers=(upper, lower)) == set()


def test_engine_loop_imports_no_backend(graph: grimp.ImportGraph) -> None:
    """The engine process loads only its executor, never the host-side backend modules."""
    imported = graph.find_upstream_modules("gpuvirt.device.engine")
    assert not imported & {"gpuvirt.device.emu", "gpuvirt.device.cuda"}
