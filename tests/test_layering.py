"""The import contract of docs/architecture.md: every import points down the layers, nested ones too.

A package may import packages of lower layers and, within its own layer, others as long as no
two packages import each other (no cycles). Below that, no two modules import each other, directly
or around a longer circle. A function-level import is checked like any other, so it cannot hide
an upward dependency or a circle.
"""

from __future__ import annotations

import ast
import itertools
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]

# Bottom to top. `kernels` (installed as megakd.kernels) knows nothing of megakd.
LAYERS: list[set[str]] = [
    {"kernels", "errors", "fsutil", "signals", "launch"},
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


def test_every_package_is_installed():
    """A wheel holds the packages pyproject lists and no others: every directory of megakd with an
    `__init__.py` must be listed (an editable install finds them all, so nothing else notices)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    present = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "megakd").rglob("__init__.py")}
    assert present | {"megakd.kernels"} == listed


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


# -- import side effects -------------------------------------------------------------------------
# Importing megakd does no work beyond defining things: no atexit handler, no torch computation or
# global setting, no signal handler, environment variable or warning filter (what a module needs
# it sets up on first use, as kernels/linear_head.py does for oneMKL). Its third-party imports run
# first, so what they register on import is not counted.

_STATE = """
import atexit, random, sys, warnings
import numpy as np
import torch
from tests import global_state

def state():
    return {
        "process-wide": global_state.snapshot(),
        "atexit handlers": atexit._ncallbacks(),
        "torch interop threads": torch.get_num_interop_threads(),
        "rng": [torch.initial_seed(), torch.get_rng_state().tolist(), random.getstate()[1][:8],
                np.random.get_state()[1][:8].tolist()],
        "warning filters": len(warnings.filters),
        "excepthook": str(sys.excepthook),
    }
"""

_IMPORT_ALL = """
class Calls(torch.overrides.TorchFunctionMode):
    seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):  # a computation; torch.device("cuda", 0) is a constant
            self.seen.append(getattr(func, "__name__", str(func)))
        return out

import importlib
before = state()
with Calls():
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:  # an optional dependency (triton, deepspeed) not installed
            if err.name.split(".")[0] in ("megakd", "kernels"):
                raise
after = state()
changed = {k: [before[k], after[k]] for k in before if k != "process-wide" and before[k] != after[k]}
changed.update({k: global_state.describe({k: v}) for k, v in
                global_state.changes(before["process-wide"], after["process-wide"]).items()})
print(json.dumps({"torch calls": Calls.seen, "changed": changed}))
"""


def _third_party_imports(path: Path) -> list[str]:
    """The module-level imports of `path` that are not megakd's, each as a guarded statement."""
    out = []
    nodes = list(ast.parse(path.read_text()).body)
    while nodes:
        node = nodes.pop(0)
        if isinstance(node, ast.Try):
            nodes[:0] = node.body
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.names[0].name if isinstance(node, ast.Import) else node.module
            if not getattr(node, "level", 0) and module.split(".")[0] not in ("megakd", "__future__"):
                out.append(f"try:\n    {ast.unparse(node)}\nexcept ImportError:\n    pass")
    return out


def test_importing_megakd_has_no_side_effects():
    modules = _module_files()
    preload = sorted({line for path in modules.values() for line in _third_party_imports(path)})
    script = "\n".join(["import json", _STATE, *preload, f"MODULES = {sorted(modules)!r}", _IMPORT_ALL])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.splitlines()[-1])
    assert found == {"torch calls": [], "changed": {}}, found
