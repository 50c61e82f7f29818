"""Build Megatron-Core ``HybridModel``s from our config files.

``transformer_config`` maps a ``ModelConfig`` + layout onto Megatron's ``TransformerConfig``;
``build_hybrid_model`` is a Megatron-style model provider (``pre_process``/``post_process``/
``vp_stage``) so the same function feeds ``get_model`` and our own loops.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from elastic_plugin.models.config import ConfigError, Layout, ModelConfig
from elastic_plugin.models.context_parallel import check_context_parallel
from elastic_plugin.models.megatron_fields import architecture_fields
from elastic_plugin.models.spec_choice import choose_layer_spec
from elastic_plugin.models.specs import add_head_norms, hybrid_stack_spec


def _activation(name: str) -> tuple[Any, bool]:
    """Megatron activation function and whether it is a gated linear unit."""
    from megatron.core.activations import squared_relu

    table = {
        "squared_relu": (squared_relu, False),
        "swiglu": (F.silu, True),
        "gelu": (F.gelu, False),
        "relu": (F.relu, False),
        "silu": (F.silu, False),
    }
    return table[name]


def transformer_config(
    model: ModelConfig,
    parallel: Layout | None = None,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
):
    """The Megatron ``TransformerConfig`` for a model config and a parallel layout."""
    from megatron.core.transformer import TransformerConfig

    parallel = parallel or Layout()
    model.check_parallel(parallel.tp, parallel.pp, parallel.ep)
    check_context_parallel(model, parallel.cp, parallel.tp)
    activation, gated = _activation(model.activation)
    has_moe = model.count("moe") > 0
    if has_moe and parallel.tp > 1 and not parallel.sequence_parallel:
        raise ConfigError(
            "MoE layers with tensor_model_parallel_size > 1 need parallel.sequence_parallel=true "
            "(--sequence-parallel); Megatron-Core refuses to train them otherwise"
        )
    kwargs: dict[str, Any] = architecture_fields(model) | dict(
        activation_func=activation,
        gated_linear_unit=gated,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep if has_moe else 1,
        sequence_parallel=parallel.sequence_parallel and parallel.tp > 1,
        context_parallel_size=parallel.cp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    if has_moe:
        kwargs["moe_grouped_gemm"] = False
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def mamba_mixer_params(model: ModelConfig) -> dict[str, Any]:
    """Constructor arguments of ``MambaMixer`` that TransformerConfig does not carry."""
    return {"d_conv": model.mamba_conv_kernel, "chunk_size": model.mamba_chunk_size}


def stack_spec_for(model: ModelConfig, use_te: bool | None = None):
    """The hybrid stack spec with this model's Mamba settings filled in (``use_te`` None: the
    spec of a model whose layers are sliced, ``spec_choice.choose_layer_spec``)."""
    if use_te is None:
        use_te = choose_layer_spec("sliced").use_te
    spec = copy.deepcopy(hybrid_stack_spec(use_te))
    mixer = spec.submodules.mamba_layer.submodules.mixer
    mixer.params = {**(mixer.params or {}), **mamba_mixer_params(model)}
    if model.qk_layernorm and not use_te:
        add_head_norms(spec)
    return spec


def scaled_rotary_embedding(model: ModelConfig, hybrid) -> None:
    """Give ``hybrid`` (a built ``HybridModel``) Llama 3.1's scaled RoPE frequencies.

    ``HybridModel`` builds its ``RotaryEmbedding`` without ``rope_scaling``; Megatron-Core's
    ``RotaryEmbedding`` has it (low/high frequency factors 1 and 4, original context 8192 fixed
    there). The module holds no parameters or buffers, so swapping it changes no checkpoint key.
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    old = hybrid.rotary_pos_emb
    hybrid.rotary_pos_emb = RotaryEmbedding(
        kv_channels=hybrid.config.kv_channels,
        rotary_percent=1.0,
        rotary_interleaved=old.rotary_interleaved,
        seq_len_interpolation_factor=old.seq_len_interpolation_factor,
        rotary_base=model.rotary_base,
        rope_scaling=True,
        rope_scaling_factor=float(model.rope_scaling_factor),
        use_cpu_initialization=hybrid.config.use_cpu_initialization,
        cp_group=old.cp_group,
    )


def build_hybrid_model(
    model: ModelConfig,
    config,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    use_te: bool | None = None,
    pg_collection=None,
):
    """Build the (local stage of the) HybridModel; call after ``initialize_model_parallel``.

    ``use_te``: TE's spec (True) or the local one (False); None: the spec of a model whose layers
    are sliced (``spec_choice``; a Megatron-LM script's elastic student and its teacher)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    kwargs: dict[str, Any] = {}
    if pg_collection is not None:
        kwargs["pg_collection"] = pg_collection
    hybrid = HybridModel(
        config=config,
        hybrid_stack_spec=stack_spec_for(model, use_te),
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_sequence_length,
        hybrid_layer_pattern=model.hybrid_layer_pattern,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type,
        rotary_base=model.rotary_base,
        vp_stage=vp_stage,
        **kwargs,
    )
    if model.rope_scaling:
        scaled_rotary_embedding(model, hybrid)
    return hybrid


def model_provider(model: ModelConfig, config, use_te: bool | None = None):
    """A Megatron ``model_provider_func(pre_process, post_process, vp_stage=None)``."""

    def provide(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None):
        return build_hybrid_model(model, config, pre_process, post_process, vp_stage, use_te)

    return provide
