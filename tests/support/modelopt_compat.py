"""Run NVIDIA ModelOpt's Minitron importance hooks on our local-spec (non-TE) HybridModel on CPU.

Why: ``bench/compare_modelopt.py`` compares our importance scores with ModelOpt's; running
ModelOpt's *own* hook code (not a re-implementation) makes that comparison meaningful. Its Megatron
plugins (``modelopt.torch.nas.plugins.megatron``, ``modelopt.torch.prune.plugins.mcore_minitron``)
assume Transformer Engine, and ``modelopt.torch.utils.import_plugin`` swallows their import errors,
so without TE they silently vanish. What is patched here, and why (nothing in either package's
files is edited; every patch is applied to objects at runtime):

1. Import: ``import transformer_engine`` is served by a stub *only while the two plugin modules
   import* (their ``te.pytorch.{LayerNorm,RMSNorm}`` registry keys become placeholder classes),
   and Megatron's TE wrapper names (``MagicMock``/``None`` without TE) are swapped for placeholder
   ``nn.Module`` classes for the same window, then restored. Every Megatron module they need is
   imported first, so no Megatron module can see the stub (checked afterwards).
2. Registry: the Mamba dynamic modules are registered (ModelOpt registers them only when
   ``mamba_ssm`` imports), for Megatron's ``MambaMixer``/``MambaLayer`` and our pure-PyTorch gated
   norm; our ``LocalRMSNorm`` gets a ``num_features`` dynamic norm like ModelOpt's TE norms.
3. Attention: ``_DynamicSelfAttention._setup`` asserts a ``TEDotProductAttention`` and a fused
   ``TELayerNormColumnParallelLinear`` QKV. For the local spec (``DotProductAttention``, plain
   ``ColumnParallelLinear``/``RowParallelLinear``) the same hparams are registered, reusing
   ModelOpt's own QKV/proj slicing methods.
4. Hidden-size hooks: ModelOpt reads the residual-stream norm output from TE's fused LN+linear
   (``return_layernorm_output``). In the local spec the norm is a separate module in front of that
   linear, so each such hook is attached to the norm instead, feeding ModelOpt's hook function the
   norm output in the fused-output format (:class:`LocalSpecImportanceRegistry`).

Scope: importance estimation at TP=PP=EP=1 (ModelOpt's own restriction). Sorting/pruning a
converted local-spec model is not exercised here.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # Megatron ships no types: this annotates what a function takes
    from megatron.core.models.hybrid.hybrid_model import HybridModel

_LOADED: dict[str, types.ModuleType] = {}

# Megatron modules ModelOpt's two plugin modules import (directly or through specs built at import
# time); imported before the TE stub exists so they record "no TE".
_MEGATRON_FIRST = (
    "megatron.core.extensions.transformer_engine",
    "megatron.core.models.hybrid.hybrid_layer_specs",
    "megatron.core.models.hybrid.hybrid_model",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.moe_module_specs",
    "megatron.core.models.common.embeddings.language_model_embedding",
    "megatron.core.ssm.gated_delta_net",
    "megatron.core.ssm.mamba_layer",
    "megatron.core.ssm.mamba_mixer",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.mlp",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.multi_latent_attention",
    "megatron.core.transformer.transformer_layer",
)


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def _te_stub() -> dict[str, types.ModuleType]:
    te = types.ModuleType("transformer_engine")
    te_pytorch = types.ModuleType("transformer_engine.pytorch")
    vars(te_pytorch).update(  # what Megatron's imports look up; they are never built
        LayerNorm=type("_AbsentTELayerNorm", (torch.nn.Module,), {}),
        RMSNorm=type("_AbsentTERMSNorm", (torch.nn.Module,), {}),
    )
    vars(te).update(pytorch=te_pytorch)
    return {"transformer_engine": te, "transformer_engine.pytorch": te_pytorch}


def _import_plugins_without_te() -> tuple[types.ModuleType, types.ModuleType]:
    from unittest.mock import NonCallableMock

    for name in _MEGATRON_FIRST:
        importlib.import_module(name)
    import megatron.core.utils as mcore_utils

    mcore_utils.get_te_version()  # caches "0.0.0" before the stub exists
    import modelopt.torch.nas  # noqa: F401  (their plugin __init__s fail cleanly here, no TE)
    import modelopt.torch.prune  # noqa: F401

    mte = sys.modules["megatron.core.extensions.transformer_engine"]
    swapped = {
        name: value
        for name, value in vars(mte).items()
        if name.startswith("TE") and (value is None or isinstance(value, NonCallableMock))
    }
    before = set(sys.modules)
    for name in swapped:
        setattr(mte, name, type(f"_AbsentTE_{name}", (torch.nn.Module,), {}))
    stub = _te_stub()
    sys.modules.update(stub)
    try:
        nas_megatron = importlib.import_module("modelopt.torch.nas.plugins.megatron")
        minitron = importlib.import_module("modelopt.torch.prune.plugins.mcore_minitron")
    finally:
        for name in stub:
            sys.modules.pop(name, None)
        for name, value in swapped.items():
            setattr(mte, name, value)
    leaked = [
        n
        for n in set(sys.modules) - before
        if n.startswith("megatron") and getattr(sys.modules[n], "HAVE_TE", False) is True
    ]
    if leaked:
        raise RuntimeError(f"Megatron modules imported while the TE stub was active: {leaked}")
    return nas_megatron, minitron


def _register_local_modules(nm: types.ModuleType) -> None:
    """Dynamic-module registrations ModelOpt skips without TE / mamba_ssm (idempotent)."""
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from modelopt.torch.nas.modules.norm import _DynamicLayerNorm
    from modelopt.torch.nas.registry import DMRegistry

    from elastic_plugin.compat.mamba_ops import ExtendedRMSNormGated
    from elastic_plugin.models.norms import LocalRMSNorm

    class _DynamicLocalRMSNorm(_DynamicLayerNorm):
        """``LocalRMSNorm`` over the shared ``hidden_size`` hparam (as ModelOpt's TE norms)."""

        def _setup(self, *, num_features):
            self._register_hparam("num_features", num_features)
            self._register_dynamic_attribute("weight", self._cut_to_active_features)
            self._register_dynamic_attribute("normalized_shape", self._get_normalized_shape)

    wanted = {
        MambaMixer: ("megatron.core.ssm.mamba_mixer.MambaMixer", nm._DynamicMambaMixer),
        MambaLayer: ("megatron.core.ssm.mamba_layer.MambaLayer", nm._DynamicMambaLayer),
        ExtendedRMSNormGated: (
            "elastic_plugin.compat.mamba_ops.ExtendedRMSNormGated",
            nm._DynamicExtendedRMSNorm,
        ),
        LocalRMSNorm: ("elastic_plugin.models.norms.LocalRMSNorm", _DynamicLocalRMSNorm),
    }
    for nn_cls, (key, dm_cls) in wanted.items():
        if nn_cls not in DMRegistry._registry:
            DMRegistry.register({nn_cls: key})(dm_cls)


def _patch_local_attention(nm: types.ModuleType) -> None:
    """Let ``_DynamicSelfAttention`` convert the local spec's attention (heads + hidden_size)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from modelopt.torch.opt.dynamic import DynamicModule

    if getattr(nm._DynamicSelfAttention, "_elastic_local_patch", False):
        return
    te_qkv, te_proj = (
        nm._DynamicTEQKVLayerNormColumnParallelLinear,
        nm._DynamicTEProjRowParallelLinear,
    )

    def qkv_setup(self, *, num_attention_heads, hidden_size):
        self._register_hparam("input_size", hidden_size)
        self._register_hparam("num_attention_heads", num_attention_heads)
        self._register_dynamic_attribute(
            "output_size_per_partition",
            lambda mod, val: (
                (num_attention_heads.active + 2 * mod.config.num_query_groups)
                * mod.config.kv_channels
            ),
        )
        self._register_dynamic_attribute("weight", te_qkv._get_weight)
        if getattr(self, "bias", None) is not None:
            self._register_dynamic_attribute("bias", te_qkv._get_bias)

    def proj_setup(self, *, num_attention_heads, hidden_size):
        self._register_hparam("output_size", hidden_size)
        self._register_hparam("num_attention_heads", num_attention_heads)
        self._register_dynamic_attribute(
            "input_size_per_partition",
            lambda mod, val: num_attention_heads.active * mod.config.kv_channels,
        )
        self._register_dynamic_attribute("weight", te_proj._get_weight)
        if getattr(self, "bias", None) is not None:
            self._register_dynamic_attribute("bias", te_proj._get_bias)

    local_qkv = type(
        "_DynamicLocalQKVColumnParallelLinear",
        (DynamicModule, ColumnParallelLinear),
        {
            "_setup": qkv_setup,
            "_get_output_size_indices": te_qkv._get_output_size_indices,
        },
    )
    local_proj = type(
        "_DynamicLocalProjRowParallelLinear",
        (DynamicModule, RowParallelLinear),
        {
            "_setup": proj_setup,
            "_get_input_size_indices": te_proj._get_input_size_indices,
        },
    )
    original_setup = nm._DynamicSelfAttention._setup

    def setup(self, *, hidden_size):
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        from elastic_plugin.models.attention import SDPAAttention

        if not (
            self._prunes_attention_heads()
            and isinstance(self.core_attention, (DotProductAttention, SDPAAttention))
            and type(self.linear_qkv) is ColumnParallelLinear
        ):
            return original_setup(self, hidden_size=hidden_size)
        heads = nm.NumAttentionHeadsHp(
            self.num_attention_heads_per_partition, self.num_query_groups_per_partition
        )
        self._register_hparam("num_attention_heads", heads)
        self._register_dynamic_attribute(
            "num_attention_heads_per_partition", lambda mod, val: self.num_attention_heads
        )
        core = type(
            "_DynamicLocalDotProductAttention",
            (DynamicModule, type(self.core_attention)),
            {"_setup": lambda mod: None},
        )
        core.convert(self.core_attention)
        kv = self.config.kv_channels
        self.core_attention._register_dynamic_attribute(
            "num_attention_heads_per_partition", lambda mod, val: self.num_attention_heads
        )
        self.core_attention._register_dynamic_attribute(
            "hidden_size_per_partition", lambda mod, val: self.num_attention_heads * kv
        )
        local_qkv.convert(self.linear_qkv, num_attention_heads=heads, hidden_size=hidden_size)
        local_proj.convert(self.linear_proj, num_attention_heads=heads, hidden_size=hidden_size)

    nm._DynamicSelfAttention._setup = setup
    nm._DynamicSelfAttention._elastic_local_patch = True


def load_minitron() -> tuple[types.ModuleType, types.ModuleType]:
    """ModelOpt's ``(nas.plugins.megatron, prune.plugins.mcore_minitron)``, usable without TE.

    Call after ``elastic_plugin.compat.enable_cpu_megatron()`` (Mamba ops). Idempotent.
    """
    if "minitron" in _LOADED:
        return _LOADED["nas_megatron"], _LOADED["minitron"]
    try:
        import modelopt  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "nvidia-modelopt is not installed (optional; "
            "`pip install --no-deps nvidia-modelopt` plus its import deps)"
        ) from err
    if have_transformer_engine():
        nm = importlib.import_module("modelopt.torch.nas.plugins.megatron")
        mm = importlib.import_module("modelopt.torch.prune.plugins.mcore_minitron")
    else:
        nm, mm = _import_plugins_without_te()
    _register_local_modules(nm)
    _patch_local_attention(nm)
    _LOADED.update(nas_megatron=nm, minitron=mm)
    return nm, mm


class _FusedOutputView:
    """Stands in for a TE fused LN+linear when ModelOpt's hook is fed a separate norm's output."""

    te_return_bias = False

    def __init__(self, norm: torch.nn.Module) -> None:
        self.norm = norm


def _norm_before(model: HybridModel) -> dict[int, torch.nn.Module]:
    """id(linear that TE would fuse a norm into) -> the local spec's separate norm module."""
    from megatron.core.transformer.identity_op import IdentityOp

    pairs: dict[int, torch.nn.Module] = {}
    for layer in model.decoder.layers:
        mixer = getattr(layer, "mixer", None)
        if mixer is not None and hasattr(layer, "norm"):
            pairs[id(mixer.in_proj)] = layer.norm
        attention = getattr(layer, "self_attention", None)
        if (
            attention is not None
            and hasattr(attention, "linear_qkv")
            and not isinstance(layer.input_layernorm, IdentityOp)
        ):
            pairs[id(attention.linear_qkv)] = layer.input_layernorm
        mlp = getattr(layer, "mlp", None)
        if (
            mlp is not None
            and hasattr(mlp, "linear_fc1")
            and not isinstance(layer.pre_mlp_layernorm, IdentityOp)
        ):
            pairs[id(mlp.linear_fc1)] = layer.pre_mlp_layernorm
    return pairs


def local_spec_registry_class() -> type:
    """``ImportanceEstimatorRegistry`` that moves ModelOpt's fused-LN hooks onto separate norms."""
    _, mm = load_minitron()
    registry: Any = mm.ImportanceEstimatorRegistry  # ModelOpt's class, imported at run time

    class LocalSpecImportanceRegistry(registry):
        """ModelOpt's registry; a hook meant for a TE fused LN+linear's layernorm output goes on
        the separate norm in front of that linear and is fed ``((norm_out, norm_out), None)``,
        the ``te_return_bias=False`` format, so ModelOpt's own hook function does the math."""

        def __init__(self, model: torch.nn.Module) -> None:
            self._norm_for = _norm_before(model)
            self._views: list[_FusedOutputView] = []  # keep alive: id(view) keys ModelOpt's dict
            self.redirected = 0
            super().__init__(model)

        def register_hook(
            self,
            module: torch.nn.Module,
            hook_fn: Callable,
            hook_type: str = "forward",
            **hook_kwargs: Any,
        ) -> None:
            target = getattr(hook_fn, "func", None)
            fused = getattr(target, "__name__", "") == "_fused_ln_linear_forward_hook"
            if not fused or hasattr(module, "return_layernorm_output"):
                return super().register_hook(module, hook_fn, hook_type, **hook_kwargs)
            norm = self._norm_for.get(id(module))
            if norm is None:
                raise RuntimeError(f"no separate norm found in front of {type(module).__name__}")
            view = _FusedOutputView(norm)
            self._views.append(view)
            self.redirected += 1

            def on_norm(_mod, inputs, output, view=view):
                hook_fn(view, inputs, ((output, output), None))  # its return value is discarded

            return super().register_hook(norm, on_norm, "forward")

    return LocalSpecImportanceRegistry
