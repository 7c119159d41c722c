"""The import contract of docs/architecture.md: every import points down the layers, nested ones too.

A package may import packages of lower layers and, within its own layer, others as long as no
two packages import each other (no cycles). Below that, no two modules import each other, directly
or around a longer circle. A function-level import is checked like any other, so it cannot hide
an upward dependency or a circle.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).parents[1]

# Bottom to top. `kernels` (installed as megakd.kernels) knows nothing of megakd.
LAYERS: list[set[str]] = [
    {"kernels", "errors", "fsutil", "signals"},
    {"configio"},
    {"models", "objectives"},
    {"config"},
    {"data"},
    {"finish"},
    {"store"},
    {"engine"},
    {"finetune", "glue", "eval", "convert", "bench", "repro"},
    {"cli", "__init__"},
]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _package_files() -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {"kernels": sorted((ROOT / "kernels").glob("*.py"))}
    for path in sorted((ROOT / "megakd").rglob("*.py")):
        rel = path.relative_to(ROOT / "megakd")
        if "remote" in rel.parts:  # remote-code templates copied into HF exports; never imported by megakd
            continue
        out.setdefault(rel.parts[0].removesuffix(".py"), []).append(path)
    return out


def _megakd_imports(path: Path) -> set[str]:
    """Top-level megakd packages this file imports (anywhere in it)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "megakd" and len(parts) > 1:
                found.add(parts[1])
    return found


def _edges() -> dict[str, dict[str, list[str]]]:
    edges: dict[str, dict[str, list[str]]] = {}
    for package, files in _package_files().items():
        for path in files:
            for target in _megakd_imports(path) - {package}:
                edges.setdefault(package, {}).setdefault(target, []).append(str(path.relative_to(ROOT)))
    return edges


def test_every_package_has_a_layer():
    assert set(_package_files()) <= set(LAYER_OF), set(_package_files()) - set(LAYER_OF)


def test_imports_point_down():
    upward = [f"{pkg} -> {target} ({', '.join(files)})"
              for pkg, targets in _edges().items() for target, files in targets.items()
              if LAYER_OF[target] > LAYER_OF[pkg]]
    assert not upward, upward


def test_kernels_import_nothing_of_megakd():
    assert "kernels" not in _edges(), _edges().get("kernels")


def test_no_import_cycles_within_a_layer():
    edges = _edges()
    cycles = [(a, b) for layer in LAYERS for a, b in itertools.combinations(sorted(layer), 2)
              if b in edges.get(a, {}) and a in edges.get(b, {})]
    assert not cycles, cycles


# -- modules -------------------------------------------------------------------------------------
# The same contract one level down: no two modules import each other, directly or around a longer
# circle, function-level and TYPE_CHECKING imports included. `kernels` is named as installed
# (megakd.kernels); importing a submodule is an edge to that module, not to its packages.


def _module_files() -> dict[str, Path]:
    """Dotted module name -> file, for megakd (remote-code templates left out) and kernels."""
    out = {}
    for package, files in _package_files().items():
        for path in files:
            base = ROOT / "kernels" if package == "kernels" else ROOT / "megakd"
            parts = ("megakd", "kernels") if package == "kernels" else ("megakd",)
            parts += path.relative_to(base).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _module_imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that the module `name` (at `path`) imports anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return (found & modules) - {name}


def _module_cycles() -> list[list[str]]:
    """The circles of the module import graph: its strongly connected components of two or more."""
    files = _module_files()
    graph = {name: _module_imports(name, path, set(files)) for name, path in files.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_no_import_cycles_between_modules():
    assert not _module_cycles(), _module_cycles()
