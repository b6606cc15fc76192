"""The house's rules (docs/architecture.md, "The rooms"): among the project's modules no
import cycle (imports inside functions and under TYPE_CHECKING count: they are edges a
reader follows too), `statemachine/` imports neither `store/` nor `workers/`, `store/` never
imports `workers/`, and no module of the three packages is over 450 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("statemachine", "store", "workers")
MAX_LINES = 450
# What a package may not import: the layers below never reach up.
FORBIDDEN = {"statemachine": ("store", "workers"), "store": ("workers",)}


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The project module an import names (``a.b.C`` -> ``a.b``), if any."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    path = MODULES[module]
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[: len(base) - (node.level - 1)]
                origin = ".".join([*parent, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            names = [f"{origin}.{a.name}" for a in node.names]
        else:
            continue
        found |= {r for n in names if (r := _resolve(n)) is not None}
    found.discard(module)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
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
    return out


def test_the_scan_finds_the_project_and_its_imports() -> None:
    assert {"statemachine.events", "store.event_store", "workers.worker"} <= set(MODULES)
    assert "store.event_store" in GRAPH["workers.worker"] or any(
        "store" in m for m in GRAPH["workers.worker"]
    )


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(planted) == [["a", "b", "c"]]


def test_no_import_cycle() -> None:
    assert cycles(GRAPH) == []


def test_no_upward_import() -> None:
    upward = [
        f"{m} -> {d}"
        for m, deps in GRAPH.items()
        for d in deps
        if d.split(".")[0] in FORBIDDEN.get(m.split(".")[0], ())
    ]
    assert upward == []


def test_modules_of_a_few_hundred_lines() -> None:
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
