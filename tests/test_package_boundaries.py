"""The installed package never imports the test support (``tests/support/``, which the wheel does
not ship): a package module that did would work in a checkout and fail for every user."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "elastic_plugin"


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_no_package_module_imports_the_test_support():
    offenders = {
        str(path.relative_to(PACKAGE.parent)): sorted(
            name for name in _imported_modules(path) if name.split(".")[0] == "tests"
        )
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    offenders = {path: names for path, names in offenders.items() if names}
    assert len(list(PACKAGE.rglob("*.py"))) > 100  # the walk saw the package
    assert offenders == {}
