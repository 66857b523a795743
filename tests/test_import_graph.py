"""The package's import graph: data flows one way, with no cycles.

Every ``import`` in ``src/detlora`` (at module level, inside functions, or under
TYPE_CHECKING) is an edge. Each module belongs to a layer; an edge may only point to the same
layer or one below, and the module graph has no cycle. So ``ops`` never reaches up to
``layers``, models never to the scheduler, and nothing imports the lab (``benchmarks``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "detlora"

# Longest prefix wins. Lower numbers sit lower: an import may point down or sideways only.
LAYERS: dict[str, int] = {
    "detlora.config": 0,
    "detlora.engine_args": 0,
    "detlora.log": 0,
    "detlora.json_files": 0,
    "detlora.ops": 1,
    "detlora.distributed": 2,
    "detlora.batch_invariant": 2,
    "detlora.layers": 3,
    "detlora.models": 4,
    "detlora.lora": 5,
    "detlora.engine": 6,
    "detlora.decisions": 7,
    "detlora.audit": 7,  # the audit log's format, writer, reader and entries
    "detlora.entrypoints": 8,
    "detlora": 9,  # the package's __init__: the public API
    "detlora.study": 10,  # product commands built on the public API
    "detlora.audit.verify": 10,  # `detlora verify`: replays a log through LLM
    "detlora.entrypoints.cli": 11,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """Modules of the package that ``path`` imports (``from x import y`` counts y when y is a
    submodule)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]
        else:
            continue
        for name in names:
            if name == "benchmarks" or name.startswith("benchmarks."):
                found.add(name)
            if name.split(".")[0] != "detlora":
                continue
            while name and name not in modules:  # an attribute of a module: its module
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    return {m: _imports(p, m, modules) for m, p in files.items()}


def test_no_import_points_to_a_higher_layer_or_the_lab():
    bad = []
    for module, targets in sorted(_graph().items()):
        for target in sorted(targets):
            if target.startswith("benchmarks"):
                bad.append(f"{module} -> {target} (the product never imports the lab)")
            elif _layer(target) > _layer(module):
                bad.append(f"{module} (layer {_layer(module)}) -> {target} "
                           f"(layer {_layer(target)})")
    assert not bad, "imports that run back up:\n" + "\n".join(bad)


def test_the_module_graph_has_no_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if t.startswith("benchmarks"):
                continue
            if state.get(t) == 1:
                return [*stack[stack.index(t):], t]
            if t not in state and (cycle := visit(t)) is not None:
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)) is not None:
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_the_checker_sees_a_back_edge_and_a_cycle(tmp_path, monkeypatch):
    """The walk itself works: a planted back-edge and a planted cycle are both found."""
    pkg = tmp_path / "detlora"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "layers").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "layers" / "__init__.py").write_text("")
    (pkg / "ops" / "a.py").write_text("def f():\n    from detlora.layers import b\n")
    (pkg / "layers" / "b.py").write_text("from detlora.layers.c import x\n")
    (pkg / "layers" / "c.py").write_text("import detlora.layers.b\nx = 1\n")
    monkeypatch.setitem(globals(), "SRC", tmp_path)
    monkeypatch.setitem(globals(), "PACKAGE", pkg)
    with pytest.raises(AssertionError, match=r"detlora\.ops\.a"):
        test_no_import_points_to_a_higher_layer_or_the_lab()
    with pytest.raises(pytest.fail.Exception, match=r"detlora\.layers\.b -> detlora\.layers\.c"):
        test_the_module_graph_has_no_cycle()
