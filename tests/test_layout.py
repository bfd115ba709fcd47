"""The package's shape: layers that only look down (no import cycle between modules or subpackages, imports
inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "adaptive_batching"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, at any depth of the file (function-level imports too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    graph = {name: imported_modules(path, known) - {name} for name, path in files.items()}
    # A package's __init__ importing its own submodules is how a package exposes them, not a cycle.
    return {name: {d for d in deps if not d.startswith(name + ".")} for name, deps in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in graph.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


# Bottom to top; a subpackage (or top-level module) imports only from layers below its own (docs/contributing.md).
LAYERS: list[set[str]] = [
    {"errors", "units"},
    {"core"},
    {"runtime"},
    {"faults", "assets"},
    {"batching"},
    {"growth"},
    {"profiling"},
    {"estimate"},
    {"config"},
    {"training"},
    {"cli", "configs"},
]


def part_of(module: str) -> str:
    """``adaptive_batching.growth.plan`` -> ``growth``; the package itself -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph collapsed to subpackages and top-level modules."""
    collapsed: dict[str, set[str]] = {}
    for module, deps in graph.items():
        part = part_of(module)
        if part:
            collapsed.setdefault(part, set()).update(part_of(d) for d in deps if part_of(d) not in ("", part))
    return collapsed


def test_no_import_cycle_between_subpackages() -> None:
    assert cycles(package_graph(import_graph())) == []


def test_each_subpackage_imports_only_the_layers_below_it() -> None:
    level = {part: i for i, layer in enumerate(LAYERS) for part in layer}
    graph = package_graph(import_graph())
    assert set(graph) - set(level) == set(), "place the new subpackage in LAYERS (and docs/contributing.md)"
    upward = sorted((a, b) for a, deps in graph.items() for b in deps if level[b] >= level[a])
    assert upward == []


def test_the_layer_check_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from adaptive_batching.training import trainer\n")
    assert imported_modules(module, {"adaptive_batching.training", "adaptive_batching.training.trainer"}) == {
        "adaptive_batching.training",
        "adaptive_batching.training.trainer",
    }
    assert package_graph({"adaptive_batching.core.x": {"adaptive_batching.training.trainer"}}) == {"core": {"training"}}


def test_no_import_cycle_between_modules() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_subpackage_is_installed() -> None:
    """pyproject.toml lists the packages by name: one left out imports from a checkout but not once installed."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {module_name(p.parent) for p in PACKAGE.rglob("__init__.py")}
    assert found - listed == set()
