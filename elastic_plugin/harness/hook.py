"""``lm_eval --model elastic-plugin``: our model class registered in lm-eval's own command line.

lm-eval 0.4.13 finds models in its ``MODEL_MAPPING`` (a lazy ``"module:Class"`` per name) and has
no plug-in entry point, so a plain ``lm_eval`` process never hears of a class defined elsewhere.
``install_pth`` writes one line into the environment's ``site-packages``
(``elastic_plugin_lm_eval.pth``: Python runs it at start-up) that loads this file by its path —
without importing ``elastic_plugin``, torch or lm-eval — and puts :class:`RegisterAfterImport`
on ``sys.meta_path``. When, and only when, a process imports ``lm_eval.models``, the finder adds
``elastic-plugin`` to lm-eval's registry as the same kind of lazy entry lm-eval's own models
have (``elastic_plugin.harness.lm:ElasticLM``), imported only if ``--model elastic-plugin`` is
asked for. Every other process pays one small file read.

``scripts/bootstrap_venv.sh`` and ``make demo-real`` run ``python -m elastic_plugin.harness.hook``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

MODEL_NAME = "elastic-plugin"
TARGET = "elastic_plugin.harness.lm:ElasticLM"
PTH_NAME = "elastic_plugin_lm_eval.pth"
WATCHED = "lm_eval.models"


def register(registry: Any = None) -> None:
    """Add ``elastic-plugin`` to lm-eval's model registry as a lazy entry (idempotent)."""
    if registry is None:
        from lm_eval.api.registry import model_registry

        registry = model_registry
    if MODEL_NAME not in registry:
        registry.register(MODEL_NAME, target=TARGET)


class RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``lm_eval.models`` as the path finder does and registers our model right after the
    module has run (lm-eval's own names are registered by then)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != WATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            register()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Watch for lm-eval's models from now on (idempotent); register at once if already imported."""
    if WATCHED in sys.modules:
        register()
        return
    if not any(type(f).__name__ == RegisterAfterImport.__name__ for f in sys.meta_path):
        sys.meta_path.insert(0, RegisterAfterImport())


def pth_line(hook_file: str | Path | None = None) -> str:
    """The ``.pth`` line: load this file by path (no package import) and call :func:`install`."""
    file = str(Path(hook_file or __file__).resolve())
    return (
        "import importlib.util as _u; _s = _u.spec_from_file_location('_elastic_plugin_lm_eval_hook', "
        f"{file!r}); _m = _u.module_from_spec(_s); _s.loader.exec_module(_m); _m.install()\n"
    )


def install_pth(site_packages: str | Path | None = None) -> Path:
    """Write ``elastic_plugin_lm_eval.pth`` into ``site_packages`` (default: this
    environment's purelib); returns its path."""
    folder = Path(site_packages or sysconfig.get_paths()["purelib"])
    path = folder / PTH_NAME
    path.write_text(pth_line())
    return path


if __name__ == "__main__":
    print(f"lm_eval --model {MODEL_NAME}: registered by {install_pth()}")
