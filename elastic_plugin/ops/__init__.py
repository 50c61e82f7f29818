"""Python front of the ``csrc/`` kernels, with pure-PyTorch fallbacks.

Importing this package loads the compiled extension ``elastic_plugin._C`` if it is built
(and ``ELASTIC_PLUGIN_DISABLE_EXT`` is not set), else defines the same ops in PyTorch.
The ops live in ``torch.ops.elastic_plugin``; the functions here add argument checks.
"""

from __future__ import annotations

from elastic_plugin.ops._batched_gather import ordered_gather_many, reference_ordered_gather_many
from elastic_plugin.ops._binary import arch_targets, fatbin_targets, kernel_sources
from elastic_plugin.ops._fp8 import (
    E4M3_MAX,
    AmaxReduce,
    dequantize_e4m3,
    fp8_prefix_linear,
    quantize_e4m3,
)
from elastic_plugin.ops._fp8 import METHODS as FP8_METHODS
from elastic_plugin.ops._fp8 import SCALINGS as FP8_SCALINGS
from elastic_plugin.ops._gather import ordered_gather, reference_ordered_gather
from elastic_plugin.ops._kd_loss import (
    kd_grad,
    kd_row_stats,
    reference_kd_grad,
    reference_kd_row_stats,
)
from elastic_plugin.ops._loader import BACKENDS, DISABLE_ENV, INFO
from elastic_plugin.ops._masked_gemm import prefix_linear, reference_prefix_linear
from elastic_plugin.ops._quantize import BLOCK as NVFP4_BLOCK
from elastic_plugin.ops._quantize import (
    E2M1_MAX,
    fp8_quantize,
    nvfp4_quantize,
    pack_e2m1,
    reference_fp8_quantize,
    reference_nvfp4_quantize,
    round_e2m1,
)


def backend() -> str:
    """Implementation in use: ``"cpp+cuda"``, ``"cpp"`` or ``"pytorch"``."""
    return INFO.backend


def backend_info() -> dict[str, object]:
    """``backend`` plus ``reason`` (why this one, e.g. why the extension is not used) and build
    details: ``cuda_arch_list`` (the architectures the build asked for) and ``cuda_targets``
    (the code objects the library's fatbin holds: ``sm_90`` cubins, ``compute_90`` PTX)."""
    path = INFO.extension_path
    return {
        "backend": INFO.backend,
        "reason": INFO.reason,
        "extension_path": path,
        "cuda_kernels": INFO.cuda_kernels,
        "built_for_torch": INFO.built_for_torch,
        "cuda_arch_list": INFO.cuda_arch_list,
        "cuda_targets": fatbin_targets(path) if INFO.cuda_kernels and path else [],
    }


__all__ = [
    "BACKENDS",
    "DISABLE_ENV",
    "E2M1_MAX",
    "E4M3_MAX",
    "FP8_METHODS",
    "FP8_SCALINGS",
    "NVFP4_BLOCK",
    "AmaxReduce",
    "arch_targets",
    "backend",
    "backend_info",
    "dequantize_e4m3",
    "fatbin_targets",
    "fp8_prefix_linear",
    "fp8_quantize",
    "kd_grad",
    "kd_row_stats",
    "kernel_sources",
    "nvfp4_quantize",
    "ordered_gather",
    "ordered_gather_many",
    "pack_e2m1",
    "prefix_linear",
    "quantize_e4m3",
    "reference_kd_grad",
    "reference_kd_row_stats",
    "reference_ordered_gather",
    "reference_ordered_gather_many",
    "reference_fp8_quantize",
    "reference_nvfp4_quantize",
    "reference_prefix_linear",
    "round_e2m1",
]
