"""Layer specs for hybrid models: Megatron-Core's own TE spec, and a local (non-TE) spec built
from Megatron-Core's plain parallel layers. Which one a model gets is ``models/spec_choice.py``.

Upstream only ships a TE hybrid spec. The local one mirrors it module for module, with the norms
that TE fuses into the following linear (``TELayerNormColumnParallelLinear``) as separate
``WrappedTorchNorm`` modules, so the same model runs on a CPU. Its core attention is
:class:`~elastic_plugin.models.attention.SDPAAttention` (``"sdpa"``, no ``[s, s]`` score
matrix) by default, or Megatron's ``DotProductAttention`` (``"unfused"``, the full score matrix);
neither has parameters, so checkpoints are the same for both.
"""

from __future__ import annotations

from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from elastic_plugin.models.attention import SDPAAttention
from elastic_plugin.models.config import ConfigError
from elastic_plugin.models.norms import HeadRMSNorm, LocalRMSNorm

CORE_ATTENTIONS = {"sdpa": SDPAAttention, "unfused": DotProductAttention}
"""The local spec's core attention modules by name (``core_attention=``)."""


def have_transformer_engine() -> bool:
    """True when TE imports (which alone does not make its layers run: they need a CUDA device,
    ``spec_choice.transformer_engine_missing``)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install
        return False
    return True


class LocalHybridStack(HybridStack):
    """``HybridStack`` whose final norm is ``LocalRMSNorm`` (same ``final_norm.weight`` key).

    Megatron-Core's ``HybridStack`` hard-codes TE's ``TENorm`` for its final norm: without TE
    that raises, and with TE importable but no GPU, TE refuses to build it. The stack is built
    without Megatron's final norm and given the local one, so the local spec never touches TE
    (no process-wide patch: a TE-spec teacher may be built beside it)."""

    def __init__(self, *args, post_layer_norm: bool = True, **kwargs) -> None:
        super().__init__(*args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = LocalRMSNorm(
                config=self.config,
                hidden_size=self.config.hidden_size,
                eps=self.config.layernorm_epsilon,
            )


def _core_attention(name: str) -> type:
    try:
        return CORE_ATTENTIONS[name]
    except KeyError:
        raise ConfigError(
            f"core_attention must be one of {sorted(CORE_ATTENTIONS)}, got {name!r}"
        ) from None


def local_hybrid_stack_spec(core_attention: str = "sdpa") -> ModuleSpec:
    """A HybridStack spec using only Megatron-Core modules (runs on CPU, no TE).

    ``core_attention``: ``"sdpa"`` (``SDPAAttention``, flash / memory-efficient kernels) or
    ``"unfused"`` (Megatron's ``DotProductAttention``).
    """
    attention = _core_attention(core_attention)
    norm = LocalRMSNorm
    moe = get_moe_module_spec_for_backend(
        backend=LocalSpecProvider(), num_experts=8, moe_grouped_gemm=False
    )
    return ModuleSpec(
        module=LocalHybridStack,
        submodules=HybridStackSubmodules(
            mamba_layer=ModuleSpec(
                module=MambaLayer,
                submodules=MambaLayerSubmodules(
                    norm=norm,
                    mixer=ModuleSpec(
                        module=MambaMixer,
                        submodules=MambaMixerSubmodules(
                            in_proj=ColumnParallelLinear, out_proj=RowParallelLinear
                        ),
                    ),
                    mamba_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"},
                ),
            ),
            attention_layer=ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(
                    input_layernorm=norm,
                    self_attention=ModuleSpec(
                        module=SelfAttention,
                        params={"attn_mask_type": AttnMaskType.causal},
                        submodules=SelfAttentionSubmodules(
                            linear_qkv=ColumnParallelLinear,
                            core_attention=attention,
                            linear_proj=RowParallelLinear,
                        ),
                    ),
                    self_attn_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map={
                        "input_layernorm.": "self_attention.linear_qkv.layer_norm_"
                    },
                ),
            ),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=norm,
                    mlp=partial(
                        MLP.as_mlp_submodule,
                        submodules=MLPSubmodules(
                            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
                        ),
                    ),
                    mlp_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map={
                        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"
                    },
                ),
            ),
            moe_layer=ModuleSpec(
                module=MoETransformerLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=norm, mlp=moe, mlp_bda=get_bias_dropout_add
                ),
            ),
        ),
    )


def hybrid_stack_spec(use_te: bool | None = None, core_attention: str | None = None) -> ModuleSpec:
    """The spec to build with: TE's (``use_te=True``), the local one (``False``), or, by default,
    the one ``spec_choice.choose_layer_spec`` gives a model whose layers are sliced (the local
    spec while TE's linears are not elastic: an elastic student in a Megatron-LM script).

    ``core_attention`` picks the local spec's core attention (default ``"sdpa"``); TE's spec has
    its own (``TEDotProductAttention``), so naming one together with TE is an error.
    """
    from elastic_plugin.models.spec_choice import SPEC_BACKENDS, choose_layer_spec

    if use_te is None:
        use_te = choose_layer_spec("sliced").use_te
    return SPEC_BACKENDS["te" if use_te else "local"].stack_spec(core_attention)


def add_head_norms(spec: ModuleSpec) -> ModuleSpec:
    """``spec`` (a local hybrid stack spec, changed in place) with the per-head q/k norms of
    ``qk_layernorm`` set to ``HeadRMSNorm``. Megatron-Core's ``SelfAttention`` falls back to TE's
    ``TENorm`` when the spec names none, which fails without TE; the TE spec keeps that fallback."""
    attention = spec.submodules.attention_layer.submodules.self_attention.submodules
    if attention.q_layernorm in (None, IdentityOp):
        attention.q_layernorm = HeadRMSNorm
    if attention.k_layernorm in (None, IdentityOp):
        attention.k_layernorm = HeadRMSNorm
    return spec
