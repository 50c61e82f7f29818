"""Pick the implementation behind ``torch.ops.elastic_plugin``: compiled extension or PyTorch.

Loading ``elastic_plugin._C`` registers the C++ (and, if compiled in, CUDA) kernels.  When
it is absent, fails to load, or ``ELASTIC_PLUGIN_DISABLE_EXT=1`` is set, the ops are
defined in pure PyTorch instead, so the package works everywhere; the reason is recorded
so a slow run can be traced to a missing build rather than guessed at.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import warnings
from types import ModuleType

import torch

DISABLE_ENV = "ELASTIC_PLUGIN_DISABLE_EXT"
EXTENSION_MODULE = "elastic_plugin._C"
BACKENDS = ("cpp+cuda", "cpp", "pytorch")


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    """Which implementation serves the ops in this process, and why."""

    backend: str  # one of BACKENDS
    reason: str
    extension_path: str | None  # the loaded shared library, if any
    cuda_kernels: bool  # CUDA tensors run compiled CUDA kernels (else PyTorch ops)
    built_for_torch: str | None  # torch version the extension was compiled against
    cuda_arch_list: str | None = None  # the TORCH_CUDA_ARCH_LIST its CUDA kernels were built for

    @property
    def uses_extension(self) -> bool:
        return self.backend != "pytorch"


def _env_disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _from_module(module: ModuleType, note: str = "") -> BackendInfo:
    with_cuda = bool(getattr(module, "WITH_CUDA", 0))
    built_for = getattr(module, "TORCH_VERSION", "") or None
    arch_list = getattr(module, "CUDA_ARCHS", "").replace("_", ";") or None
    if with_cuda:
        reason = "compiled extension with CPU and CUDA kernels"
    else:
        reason = (
            "compiled extension with CPU kernels only; CUDA tensors use the PyTorch implementation"
        )
    if built_for is not None and built_for != torch.__version__:
        mismatch = f"built for torch {built_for} but running torch {torch.__version__}; rebuild it"
        warnings.warn(f"elastic_plugin._C was {mismatch}", RuntimeWarning, stacklevel=3)
        reason += f" (WARNING: {mismatch})"
    if note:
        reason += f" ({note})"
    return BackendInfo(
        backend="cpp+cuda" if with_cuda else "cpp",
        reason=reason,
        extension_path=getattr(module, "__file__", None),
        cuda_kernels=with_cuda,
        built_for_torch=built_for,
        cuda_arch_list=arch_list,
    )


def _fallback(reason: str) -> BackendInfo:
    return BackendInfo(
        "pytorch", reason, extension_path=None, cuda_kernels=False, built_for_torch=None
    )


def load() -> BackendInfo:
    """Load the extension unless disabled; never raises for a missing or broken build."""
    if _env_disabled():
        loaded = sys.modules.get(EXTENSION_MODULE)
        if loaded is not None:
            # Its kernels are registered already and cannot be unloaded; say so.
            return _from_module(
                loaded, f"{DISABLE_ENV} is set, but {EXTENSION_MODULE} was imported earlier"
            )
        return _fallback(
            f"{DISABLE_ENV}={os.environ[DISABLE_ENV]} is set: using the pure-PyTorch ops"
        )
    try:
        module = importlib.import_module(EXTENSION_MODULE)
    except (ImportError, OSError) as exc:
        return _fallback(
            f"{EXTENSION_MODULE} could not be imported ({type(exc).__name__}: {exc}); build it with "
            "`pip install --no-build-isolation -e .`"
        )
    return _from_module(module)


INFO: BackendInfo = load()


def register_cpu_ops(entries) -> torch.library.Library:
    """Register ops whose compiled kernels are CPU ones: ``entries`` of (qualified name, schema,
    reference, fake). Without the extension the PyTorch reference is the op; the fake (meta)
    rule is registered either way. Returns the library, which the caller keeps alive."""
    lib = torch.library.Library("elastic_plugin", "FRAGMENT")
    for name, schema, reference, fake in entries:
        if not INFO.uses_extension:
            torch.library.custom_op(name, reference, mutates_args=(), schema=schema)
        torch.library.register_fake(name, fake, lib=lib)
    return lib


def cpu_kernel_serves(x: torch.Tensor) -> bool:
    """The compiled CPU kernel runs for ``x``; elsewhere (CUDA, or no extension) the reference."""
    return INFO.uses_extension and x.device.type == "cpu"
