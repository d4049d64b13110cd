"""The package's floors, read from the sources: imports go one way (benchmarks -> compilation -> ops -> files),
with no cycle anywhere, lazy imports inside functions included (they are edges a reader follows too)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "mindiesd"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _is_type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and isinstance(test, (ast.Name, ast.Attribute)) and \
        (getattr(test, "id", None) or getattr(test, "attr", None)) == "TYPE_CHECKING"


def _import_nodes(tree: ast.AST) -> List[ast.AST]:
    found: List[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if _is_type_checking_block(node):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _resolve(name: str, modules: Dict[str, Path]) -> Optional[str]:
    """The deepest module of ours that ``name`` names (``a.b.c`` may be attribute ``c`` of module ``a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports_of(module: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: Set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import sub`` is an edge to the submodule; ``from mod import name`` one to the module
            candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                          for alias in node.names]
        for candidate in candidates:
            resolved = _resolve(candidate, modules)
            if resolved is not None and resolved != module:
                targets.add(resolved)
    return targets


def import_graph() -> Dict[str, Set[str]]:
    modules = _modules()
    return {module: _imports_of(module, path, modules) for module, path in modules.items()}


def _cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import cycle of ``graph`` as a list of modules, or None (iterative depth-first search)."""
    state: Dict[str, int] = {}
    for start in graph:
        if state.get(start):
            continue
        path, iterators = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while path:
            nxt = next(iterators[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iterators.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iterators.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_graph_is_read_from_the_sources():
    graph = import_graph()
    assert "mindiesd.compilation.backend" in graph
    assert any(target.startswith("mindiesd.ops") for target in graph["mindiesd.compilation.backend"])


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("floor, forbidden", [
    ("mindiesd.files", ("mindiesd.ops", "mindiesd.compilation", "mindiesd.benchmarks", "mindiesd.zoo")),
    ("mindiesd.ops", ("mindiesd.compilation", "mindiesd.benchmarks", "mindiesd.zoo")),
    ("mindiesd.compilation", ("mindiesd.benchmarks", "mindiesd.zoo")),
    ("mindiesd.zoo", ("mindiesd.benchmarks", "mindiesd.compilation")),
])
def test_imports_go_down_only(floor, forbidden):
    upward = sorted(f"{module} -> {target}" for module, targets in import_graph().items()
                    if module == floor or module.startswith(floor + ".")
                    for target in targets if target.startswith(forbidden))
    assert not upward, f"{floor} imports what sits above it: {upward}"


def test_no_tooling_at_the_package_top_level():
    top_level = sorted(path.name for path in PACKAGE_ROOT.glob("*.py"))
    assert top_level == ["__init__.py", "__main__.py"], top_level


def test_compilation_keeps_its_pipeline_at_the_top_and_its_concerns_below():
    """The pipeline's modules sit at the top of compilation/; graph clean-up, the runtime and storage are
    sub-packages a reader finds by name (the passes have theirs)."""
    top = PACKAGE_ROOT / "compilation"
    modules = sorted(path.name for path in top.glob("*.py"))
    packages = sorted(path.parent.name for path in top.glob("*/__init__.py"))
    assert len(modules) <= 12, modules
    assert packages == ["cleanup", "passes", "runtime", "storage"], packages


def _area(module: str) -> str:
    """The part of the package a module belongs to: a sub-package of compilation/ or another top-level part."""
    parts = module.split(".")
    if parts[:2] == ["mindiesd", "compilation"] and len(parts) > 3:
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def test_no_private_name_is_imported_across_areas():
    """``from x import _name`` stays inside one area (compilation's top, one of its sub-packages, ops, files...):
    what another area uses is public."""
    modules = _modules()
    crossing = []
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                base = ".".join(anchor[: len(anchor) - (node.level - 1)] + ([base] if base else []))
            target = _resolve(base, modules)
            if target is None or _area(target) == _area(module):
                continue
            crossing += [f"{module} imports {target}.{alias.name}" for alias in node.names
                         if alias.name.startswith("_") and not alias.name.startswith("__")
                         and f"{base}.{alias.name}" not in modules]
    assert not crossing, crossing
