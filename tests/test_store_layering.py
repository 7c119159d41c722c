"""Imports point down: `store` sits below `engine`, and the engine imports no command-level package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "megakd"
FORBIDDEN = {
    "store": ("megakd.engine", "megakd.convert", "megakd.distill", "megakd.finetune", "megakd.bench", "megakd.cli"),
    "engine": ("megakd.convert", "megakd.distill", "megakd.finetune", "megakd.bench", "megakd.cli"),
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", list(FORBIDDEN))
def test_package_imports_only_downward(package):
    offending = sorted(
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in (PACKAGE / package).rglob("*.py")
        for name in _imports(path)
        if name.startswith(FORBIDDEN[package])
    )
    assert not offending, offending
