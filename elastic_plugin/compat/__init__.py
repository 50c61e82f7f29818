"""Running Megatron-Core where it assumes CUDA: CPU + gloo patches and pure-PyTorch Mamba-2 ops."""

from elastic_plugin.compat.cpu import applied_patches, enable_cpu_megatron, maybe_enable_from_env

__all__ = ["applied_patches", "enable_cpu_megatron", "maybe_enable_from_env"]
