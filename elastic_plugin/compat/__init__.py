"""Running Megatron-Core where it assumes CUDA: CPU + gloo patches and pure-PyTorch Mamba-2 ops.

The names are resolved on first use (``compat.lazy``): the package also holds torch-free helpers
that argument parsing imports."""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic_plugin.compat.lazy import lazy_exports

__all__ = ["applied_patches", "enable_cpu_megatron", "maybe_enable_from_env"]

if TYPE_CHECKING:
    from elastic_plugin.compat.cpu import (
        applied_patches,
        enable_cpu_megatron,
        maybe_enable_from_env,
    )

__getattr__ = lazy_exports(__name__, dict.fromkeys(__all__, "cpu"))
