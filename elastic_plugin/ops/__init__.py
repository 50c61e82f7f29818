"""Python front of the ``csrc/`` kernels, with pure-PyTorch fallbacks.

Importing this package loads the compiled extension ``elastic_plugin._C`` if it is built
(and ``ELASTIC_PLUGIN_DISABLE_EXT`` is not set), else defines the same ops in PyTorch.
The ops live in ``torch.ops.elastic_plugin``; the functions here add argument checks.
"""

from __future__ import annotations

from elastic_plugin.ops._gather import ordered_gather, reference_ordered_gather
from elastic_plugin.ops._loader import BACKENDS, DISABLE_ENV, INFO


def backend() -> str:
    """Implementation in use: ``"cpp+cuda"``, ``"cpp"`` or ``"pytorch"``."""
    return INFO.backend


def backend_info() -> dict[str, object]:
    """``backend`` plus ``reason`` (why this one, e.g. why the extension is not used) and build details."""
    return {
        "backend": INFO.backend,
        "reason": INFO.reason,
        "extension_path": INFO.extension_path,
        "cuda_kernels": INFO.cuda_kernels,
        "built_for_torch": INFO.built_for_torch,
    }


__all__ = [
    "BACKENDS",
    "DISABLE_ENV",
    "backend",
    "backend_info",
    "ordered_gather",
    "reference_ordered_gather",
]
