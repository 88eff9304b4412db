"""The import graph of the four framework packages' sources, read with ast (every import statement,
function-level ones included, which a fresh `python -c "import ..."` of each module would not
catch): it has no cycle, and packages import only downwards (ops <- engine <- models <- train)."""

import ast
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[2]
LAYERS = ["pith_ops", "pith_engine", "pith_models", "pith_train"]  # each may import those before it


def framework_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the four packages under `root`."""
    out = {}
    for pkg in LAYERS:
        src = root / pkg.replace("_", "-") / "src"
        for f in (src / pkg).rglob("*.py"):
            parts = f.relative_to(src).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the framework modules its import statements name (`from pkg import submodule` names
    the submodule; a name inside a module names that module)."""
    modules = framework_modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, f in modules.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        targets = []
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, one level up per extra dot
                    up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{up}.{base}".rstrip(".")
                targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        graph[name] = {t for t in map(resolve, targets) if t and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first search)."""
    state, path = {}, []

    def visit(m: str) -> list[str] | None:
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path[path.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        state[m] = "done"
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_find_cycle_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_framework_import_graph_is_acyclic_and_imports_only_downwards():
    graph = import_graph(PACKAGES)
    assert {"pith_engine.attention", "pith_engine.ring_attention", "pith_models.hf"} <= graph.keys()
    assert "pith_engine.ring_attention" in graph["pith_engine.attention"]  # edges are found
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    layer = lambda m: LAYERS.index(m.partition(".")[0])
    upward = sorted(f"{m} -> {n}" for m, targets in graph.items() for n in targets if layer(n) > layer(m))
    assert not upward, upward
