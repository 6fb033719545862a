"""The import graph: DESIGN.md's layers (import-linter) and no cycle between modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    scc.append(m)
                    if m == node:
                        break
                if len(scc) > 1:
                    found.append(sorted(scc))
    return found


def test_no_import_cycle_between_modules() -> None:
    graph = grimp.build_graph("gpuvirt", exclude_type_checking_imports=True)
    assert cycles(graph) == []


def test_cycle_finder_finds_a_cycle() -> None:
    """The finder itself, on a graph with one cycle and one chain."""
    g = grimp.ImportGraph()
    for m in ("a", "b", "c", "d"):
        g.add_module(m)
    g.add_import(importer="a", imported="b")
    g.add_import(importer="b", imported="c")
    g.add_import(importer="c", imported="a")
    g.add_import(importer="c", imported="d")
    assert cycles(g) == [["a", "b", "c"]]


def test_layer_contracts_hold() -> None:
    """import-linter's contracts in pyproject.toml (make test runs them too, as lint-imports)."""
    r = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:]


def test_a_tenant_process_does_not_load_pydantic() -> None:
    """What a guest imports to attach (its token, its socket) pulls in no host config."""
    code = (
        "import sys, gpuvirt.guest.client, gpuvirt.guest.queue; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('pydantic', 'typer', 'rich') or m.startswith(('gpuvirt.config', 'gpuvirt.host'))))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_engine_loop_imports_no_backend() -> None:
    """The engine process loads only its executor, never the host-side backend modules."""
    graph = grimp.build_graph("gpuvirt", exclude_type_checking_imports=True)
    imported = graph.find_upstream_modules("gpuvirt.device.engine")
    assert not imported & {"gpuvirt.device.emu", "gpuvirt.device.cuda"}


def _private_names(package: Path) -> set[str]:
    """Private attribute and method names the classes of a package define (`self._x = ...`,
    `def _x`), dunders aside."""
    import ast

    names: set[str] = set()
    for path in package.rglob("*.py"):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in ast.walk(cls):
                name = None
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    name = node.name
                elif (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                ):
                    name = node.attr
                if name and name.startswith("_") and not name.startswith("__"):
                    names.add(name)
    return names


def test_netgpu_reads_no_private_field_of_the_guest_library() -> None:
    """The import contract sees modules, not attributes: netgpu reaching `gpu._fb` or
    `gpu._queue` would pass it. So no attribute of a private name that only the guest
    library defines is read in netgpu, by `.name` or by getattr's string. The names both
    define are netgpu's own (Pool._gpu, Pool._lock, ...): those must stay the few listed,
    so a new clash is looked at rather than waved through."""
    import ast

    src = ROOT / "src" / "gpuvirt"
    guest, netgpu = _private_names(src / "guest"), _private_names(src / "netgpu")
    assert {"_fb", "_allocator", "_queue", "_mem", "_check_attached"} <= guest
    assert guest & netgpu == {"_free", "_gpu", "_lock", "_ready"}
    forbidden = guest - netgpu
    found = []
    for path in sorted((src / "netgpu").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value  # getattr(gpu, "_fb")
            if name in forbidden:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert found == []


def test_the_host_never_asks_which_kind_of_world_switch_an_engine_does() -> None:
    """Preemptive (emu) and cooperative (cuda) engines differ only inside
    Engine.switch_out (DESIGN.md, "Scheduling"): no host module reads the flags that
    say which (`cooperative`, `can_post`), nor the world-switch words those backends
    use (`ACK_SERIAL`, `CMD_SERIAL`, `CMD_CODE`, `NOTIFY_IDLE`)."""
    import ast

    flags = {"cooperative", "can_post", "ACK_SERIAL", "CMD_SERIAL", "CMD_CODE", "NOTIFY_IDLE"}
    found = []
    for path in sorted((ROOT / "src" / "gpuvirt" / "host").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in flags:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert found == []
