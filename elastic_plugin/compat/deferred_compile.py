"""Megatron-Core's fused kernels compiled on first call, not on import.

Megatron-Core decorates its fused functions with ``torch.compile`` (``megatron/core/jit.py``'s
``jit_fuser``, and a few ``@torch.compile`` methods) while its modules are imported. Decorating
imports TorchDynamo and Inductor: about 2.7 s of the ~7.5 s a process spends importing torch and
Megatron-Core, paid by every command and every rank, also when no fused function is ever called
(CPU runs, fusions switched off). While a ``megatron.*`` module executes, ``torch.compile`` is
replaced by :func:`deferred_compile`, which compiles the same function with the same options the
first time it is called: the compiled code is Megatron's own, only later. ``torch.compile``
called at run time (after the import) is torch's own. Installed by ``elastic_plugin/__init__.py``;
a process that imported Megatron-Core before the plugin keeps torch's decoration.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_real_compile: Callable[..., Any] | None = None
_eager = False  # set on CPU (compat/cpu.py): deferred functions then run as written


def run_eagerly(eager: bool = True) -> bool:
    """From now on deferred functions run uncompiled (``eager``; the same math as written) or
    compiled; returns the previous setting. Why on CPU: Inductor compiles each fused element-wise
    function with the host's C++ compiler at its first call and again per new shape (4-9 s at a
    process's first forward, measured), for kernels of two or three operations."""
    global _eager
    previous, _eager = _eager, eager
    return previous


def deferred_compile(model: Any = None, **options: Any) -> Any:
    """``torch.compile``'s signature; a plain function is compiled on its first call."""
    if model is None:  # used as ``@torch.compile(mode=...)``
        return lambda fn: deferred_compile(fn, **options)
    assert _real_compile is not None, "deferred_compile runs only inside a hooked import"
    real = _real_compile
    if not inspect.isfunction(model):  # an nn.Module etc.: torch's own, now
        return real(model, **options)
    compiled: Callable[..., Any] | None = None

    @functools.wraps(model)
    def compile_on_first_call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if _eager:
            return model(*args, **kwargs)
        if compiled is None:
            compiled = real(model, **options)
        return compiled(*args, **kwargs)

    return compile_on_first_call


class DeferCompileFinder(importlib.abc.MetaPathFinder):
    """Finds modules under ``prefix`` as the path finder does, and runs each with
    ``torch.compile`` deferred; any other module, or one another finder serves, is untouched."""

    def __init__(self, prefix: str = "megatron.") -> None:
        self.prefix = prefix

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(self.prefix):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            global _real_compile
            import torch

            if _real_compile is None:
                _real_compile = torch.compile
            outer = torch.compile
            torch.compile = deferred_compile
            try:
                run_module(module)
            finally:
                torch.compile = outer

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install(prefix: str = "megatron.") -> None:
    """Defer ``torch.compile`` in modules under ``prefix`` imported from now on (idempotent)."""
    if any(isinstance(f, DeferCompileFinder) and f.prefix == prefix for f in sys.meta_path):
        return
    sys.meta_path.insert(0, DeferCompileFinder(prefix))
