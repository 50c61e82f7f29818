"""A package's public names, imported on first use (PEP 562's module ``__getattr__``).

``elastic-plugin``'s argument parsing imports every command's ``cli`` module, and through it
their packages' ``__init__``; a package whose names need torch resolves them here on first
access, so that parsing a command line imports no torch (``tests/test_cli_imports.py``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: name -> the submodule (relative) that defines it."""

    def resolve(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    return resolve
