"""No import cycles inside the aioengine package, and imports point one way down its layers.

Every `import` / `from ... import` statement in every module counts, wherever it is: at module level, inside
a function (a lazy import is still a dependency), and under `if TYPE_CHECKING:` (the strict choice: a cycle
that only type checking sees is still two modules that each need the other's names; break it with a small
Protocol instead). What does not count: the implicit import of a module's parent packages (importing
`aioengine.http.app` runs `aioengine/__init__.py`, which every module would otherwise cycle through).

`from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg` (its __init__).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "aioengine"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _resolve(name: str, level: int, current: str, is_package: bool) -> str:
    if level == 0:
        return name
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the package modules it imports (any statement, anywhere in the file)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node.module or "", node.level, mod, is_package)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for t in targets:
                while t and t not in modules and "." in t:  # `import a.b.c` of a non-module attribute path
                    t = t.rsplit(".", 1)[0]
                if t in modules and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _example_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One concrete loop through the component's first module, for the failure message."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    return component


def test_lazy_and_type_checking_imports_count(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import f\n")  # parents' __init__ imports do not count
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.c import C\n"
    )
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("import pkg.a\nclass C: ...\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(_example_cycle(graph, c)) for c in found)


# Imports point one way, down this list; a package may import its own modules and anything lower. Leaf types
# (the public data types, errors and env) are importable from anywhere and import only each other.
LAYERS: dict[str, int] = {
    "aioengine": 7,  # the package root re-exports the public API
    "aioengine.__main__": 7,
    "aioengine.ray_serve": 7,  # an entry point, as the CLI is: a Serve application over serve's flags
    "aioengine.cli": 6,
    "aioengine.http": 5,
    "aioengine.engine": 4,
    "aioengine.executor": 3,
    "aioengine.sched": 2,
    "aioengine.structured": 2,
    "aioengine.gpu": 2,
    "aioengine.model": 2,
    "aioengine.kernels": 1,
}
LEAVES = {f"aioengine.{m}" for m in ("config", "sampling_params", "outputs", "errors", "env", "version")}


def _layer_of(module: str) -> tuple[str, int]:
    if module in LEAVES:
        return module, 0
    parts = module.split(".")
    unit = ".".join(parts[:2])
    assert unit in LAYERS, f"{module} is in no layer: add its package to LAYERS, or make it a leaf type"
    return unit, LAYERS[unit]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, targets in sorted(graph.items()):
        unit, rank = _layer_of(mod)
        for t in sorted(targets):
            t_unit, t_rank = _layer_of(t)
            if t_unit == unit:
                continue
            if rank == 0 and t_rank != 0:
                bad.append(f"{mod} -> {t} (a leaf type imports only leaf types)")
            elif t_rank > rank:
                bad.append(f"{mod} -> {t} (layer {rank} imports layer {t_rank})")
    return bad


def test_imports_point_down_the_layers():
    assert upward_imports(import_graph()) == []


def test_an_upward_import_is_caught():
    """The layer check is live: a scheduler module that imports the engine, or a leaf that imports sched."""
    graph = {m: set(t) for m, t in import_graph().items()}
    graph["aioengine.sched.scheduler"].add("aioengine.engine.async_engine")
    graph["aioengine.config"].add("aioengine.sched.request")
    graph["aioengine.http.app"].add("aioengine")
    found = upward_imports(graph)
    assert "aioengine.sched.scheduler -> aioengine.engine.async_engine (layer 2 imports layer 4)" in found
    assert "aioengine.config -> aioengine.sched.request (a leaf type imports only leaf types)" in found
    assert "aioengine.http.app -> aioengine (layer 5 imports layer 7)" in found
    assert len(found) == 3
