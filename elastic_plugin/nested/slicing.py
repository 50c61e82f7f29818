"""Zero-shot extraction: the weights of one nested model, as a plain smaller Megatron model's.

An importance-reordered elastic ``HybridModel`` computes, at a hard choice of sizes, exactly a
smaller model whose weights are the active blocks of its own (``elastic.layers.modules``): the first
``h'`` hidden channels everywhere (embeddings, norms, every linear's input columns / output rows),
the first ``f`` neurons of each dense / shared-expert FFN, the first ``k`` query heads of every
query group (K/V heads stay), the first ``k`` Mamba heads of every Mamba group with the first
``p'`` channels of every head (``models.prefix.mamba_active_rows``), and the first ``E'`` experts with
their router rows and per-expert buffers. ``sliced_state_dict`` cuts those blocks out, so a plain
``HybridModel`` built from ``models.axes.model_for_choice(cfg, choice)`` loads them (``strict=True``) and
gives the elastic model's output at that choice: the nested model is a real, smaller model.

Heterogeneous choices (one size per layer) give a state dict whose layers differ in shape. Plain
Megatron builds every layer of a kind from one ``TransformerConfig``, so no Megatron model can
load it; it is the input of the per-layer (HF) export.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from elastic_plugin import ops
from elastic_plugin.checkpoint.layout import canonical_weights
from elastic_plugin.elastic.router import ROUTER_ATTR
from elastic_plugin.models.config import ConfigError, ModelConfig
from elastic_plugin.models.layers import hybrid_layer_kind
from elastic_plugin.models.prefix import Index, ffn_rows, mamba_active_rows, proj_cols, qkv_rows
from elastic_plugin.nested.choice import choice_sizes

if TYPE_CHECKING:  # Megatron ships no types: this annotates what a function takes
    from megatron.core.models.hybrid.hybrid_model import HybridModel

__all__ = ["nested_state_dict", "sliced_state_dict"]

Rule = tuple[tuple[int, Index], ...]  # (dim, active index) per sliced dimension
EXTRA_STATE = "_extra_state"
_SKIPPED_MODULES = (f"{ROUTER_ATTR}.",)  # the budget router is not part of a nested model
_PER_EXPERT_BUFFERS = ("expert_bias", "qb_beta")


def _check_model(inner: HybridModel, model_cfg: ModelConfig) -> None:
    """Only an unsharded, whole model holds every unit in canonical order."""
    config = inner.config
    sharded = {
        name: getattr(config, name, 1)
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "expert_model_parallel_size",
        )
    }
    if any(v != 1 for v in sharded.values()) or not (inner.pre_process and inner.post_process):
        raise ConfigError(
            f"sliced_state_dict needs the whole model on one rank (TP=PP=EP=1); got "
            f"{sharded} (gather a canonical checkpoint into a 1-rank model first)"
        )
    layers = len(inner.decoder.layers)
    if config.hidden_size != model_cfg.hidden_size or layers != len(model_cfg.layer_types):
        raise ConfigError(
            f"model_cfg (hidden_size={model_cfg.hidden_size}, {len(model_cfg.layer_types)} "
            f"layers) does not describe the model (hidden_size={config.hidden_size}, "
            f"{layers} layers)"
        )


# ------------------------------------------------------------------------------ the plan
class _Plan:
    """Which block of every state-dict entry the nested model keeps."""

    def __init__(self) -> None:
        self.rules: dict[str, Rule] = {}
        self.dropped: list[str] = []  # module prefixes the nested model does not have

    def tensor(self, key: str, *dims: tuple[int, Index]) -> None:
        self.rules[key] = dims

    def param(
        self, module: torch.nn.Module, prefix: str, name: str, *dims: tuple[int, Index]
    ) -> None:
        if getattr(module, name, None) is not None:
            self.tensor(f"{prefix}{name}", *dims)

    def linear(self, module: torch.nn.Module, prefix: str, out: Index, inp: Index) -> None:
        """weight [out, in] and bias [out] of a Megatron linear."""
        self.param(module, prefix, "weight", (0, out), (1, inp))
        self.param(module, prefix, "bias", (0, out))

    def norm(self, module: torch.nn.Module, prefix: str, h: Index) -> None:
        self.param(module, prefix, "weight", (0, h))
        self.param(module, prefix, "bias", (0, h))

    def is_dropped(self, key: str) -> bool:
        return any(key.startswith(p) for p in self.dropped)


def _mlp(plan: _Plan, mlp, prefix: str, h: int, neurons: int | None) -> None:
    plan.linear(mlp.linear_fc1, f"{prefix}linear_fc1.", ffn_rows(mlp, neurons), h)
    plan.linear(mlp.linear_fc2, f"{prefix}linear_fc2.", h, neurons)


def _mamba(plan: _Plan, mixer, prefix: str, h: int, heads: int, head_dim: int) -> None:
    rows = mamba_active_rows(mixer, heads // mixer.ngroups_local_tp, head_dim)
    plan.linear(mixer.in_proj, f"{prefix}in_proj.", rows["in_proj"], h)
    plan.param(mixer, prefix, "conv1d_weight", (0, rows["conv"]))
    plan.param(mixer, prefix, "conv1d_bias", (0, rows["conv"]))
    plan.param(mixer, prefix, "dt_bias", (0, rows["heads"]))
    plan.param(mixer, prefix, "A_log", (0, rows["heads"]))
    plan.param(mixer, prefix, "D", (0, rows["channels"] if mixer.D_has_hdim else rows["heads"]))
    if getattr(mixer, "norm", None) is not None:
        plan.norm(mixer.norm, f"{prefix}norm.", rows["channels"])
    plan.linear(mixer.out_proj, f"{prefix}out_proj.", h, rows["channels"])


def _attention(plan: _Plan, attn, prefix: str, h: int, heads: int) -> None:
    per_group = heads // attn.num_query_groups_per_partition
    plan.linear(attn.linear_qkv, f"{prefix}linear_qkv.", qkv_rows(attn, per_group), h)
    plan.linear(attn.linear_proj, f"{prefix}linear_proj.", h, proj_cols(attn, per_group))
    for name in ("q_layernorm", "k_layernorm"):  # over the head dim: not elastic
        norm = getattr(attn, name, None)
        if norm is not None:
            plan.norm(norm, f"{prefix}{name}.", None)


def _moe(plan: _Plan, moe, prefix: str, h: int, experts: int, shared: int | None) -> None:
    router = moe.router
    plan.linear(router, f"{prefix}router.", experts, h)
    for name in _PER_EXPERT_BUFFERS:
        plan.param(router, f"{prefix}router.", name, (0, experts))
    local = getattr(moe.experts, "local_experts", None)
    if local is None:
        raise ConfigError(
            f"sliced_state_dict needs SequentialMLP experts (moe_grouped_gemm="
            f"false); got {type(moe.experts).__name__}"
        )
    for j, expert in enumerate(local):
        expert_prefix = f"{prefix}experts.local_experts.{j}."
        if j < experts:
            _mlp(plan, expert, expert_prefix, h, None)  # expert FFN width is not elastic
        else:
            plan.dropped.append(expert_prefix)
    shared_mlp = getattr(moe, "shared_experts", None)
    if shared_mlp is not None:
        _mlp(plan, shared_mlp, f"{prefix}shared_experts.", h, shared)
        plan.param(shared_mlp, f"{prefix}shared_experts.", "gate_weight", (1, h))


def _plan(inner: HybridModel, sizes: dict[str, dict[int | None, int]]) -> _Plan:
    """Rules for every layer, classified by ``models.layers.hybrid_layer_kind`` as the elastic
    layers classify them."""
    plan = _Plan()
    h = sizes["embedding"][None]
    get = lambda axis, layer: sizes[axis][layer] if axis in sizes else None  # noqa: E731

    def need(axis: str, layer: int) -> int:
        """The size of an axis every layer of this kind has (``model_axes``)."""
        size = get(axis, layer)
        if size is None:
            raise ConfigError(
                f"sliced_state_dict: model_cfg has no {axis!r} axis for layer {layer} "
                "(model_cfg does not describe the model)"
            )
        return size

    embedding = inner.embedding
    plan.param(embedding.word_embeddings, "embedding.word_embeddings.", "weight", (1, h))
    if getattr(embedding, "position_embeddings", None) is not None:
        plan.param(
            embedding.position_embeddings, "embedding.position_embeddings.", "weight", (1, h)
        )
    for i, layer in enumerate(inner.decoder.layers):
        prefix, number = f"decoder.layers.{i}.", int(layer.layer_number)
        kind = hybrid_layer_kind(layer)
        if kind == "mamba":
            plan.norm(layer.norm, f"{prefix}norm.", h)
            _mamba(
                plan,
                layer.mixer,
                f"{prefix}mixer.",
                h,
                need("mamba_heads", number),
                need("mamba_head_dim", number),
            )
        elif kind == "attention" and hasattr(layer.self_attention, "linear_qkv"):
            plan.norm(layer.input_layernorm, f"{prefix}input_layernorm.", h)
            _attention(
                plan,
                layer.self_attention,
                f"{prefix}self_attention.",
                h,
                need("attention_heads", number),
            )
        elif kind == "moe":
            plan.norm(layer.pre_mlp_layernorm, f"{prefix}pre_mlp_layernorm.", h)
            _moe(
                plan,
                layer.mlp,
                f"{prefix}mlp.",
                h,
                need("experts", number),
                get("shared_ffn", number),
            )
        elif kind == "mlp":
            plan.norm(layer.pre_mlp_layernorm, f"{prefix}pre_mlp_layernorm.", h)
            _mlp(plan, layer.mlp, f"{prefix}mlp.", h, get("ffn", number))
        else:
            raise ConfigError(
                f"sliced_state_dict: no slicing rule for layer type "
                f"{type(layer).__name__} (layer {number})"
            )
    plan.norm(inner.decoder.final_norm, "decoder.final_norm.", h)
    output = getattr(inner, "output_layer", None)
    if output is not None:
        plan.param(output, "output_layer.", "weight", (1, h))
        plan.param(output, "output_layer.", "bias")  # over the vocabulary: kept whole
    return plan


def _apply(tensor: torch.Tensor, rule: Rule) -> torch.Tensor:
    """A fresh contiguous copy of the rule's block: each (dim, prefix length or index set) is one
    ``ordered_gather`` of the canonical (importance) order, the csrc slicing kernel."""
    out = tensor.detach()
    copied = False
    for dim, index in rule:
        if index is None:
            continue
        if isinstance(index, int):
            perm, keep = torch.arange(out.shape[dim], device=out.device), index
        else:
            perm = index.to(device=out.device, dtype=torch.long)
            keep = perm.numel()
        out, copied = ops.ordered_gather(out, perm, keep, dim), True
    return out if copied else out.clone(memory_format=torch.contiguous_format)


# ------------------------------------------------------------------------------ public
@torch.no_grad()
def sliced_state_dict(
    model: torch.nn.Module, model_cfg: ModelConfig, choice: Mapping[str, int | Sequence[int]]
) -> dict[str, torch.Tensor]:
    """The state dict of the nested model at ``choice``, cut from a TP=PP=EP=1 model.

    ``model``: the (elastic or plain, possibly DDP-wrapped) ``HybridModel`` in canonical
    (importance) order; ``model_cfg`` its config; ``choice``: axis -> size (one int for all
    layers) or a list with one size per layer of the axis (``AxisSpec.layers`` order); axes left
    out stay full. For a homogeneous choice the keys are exactly those of the plain model built
    from ``models.axes.model_for_choice(model_cfg, choice)``, including the router's ``expert_bias``
    buffer and Megatron's ``_extra_state`` entries (passed through: strict loading expects them;
    those of dropped experts are dropped). Tensors are fresh copies. Heterogeneous choices: see the
    module docstring. Raises ``ConfigError`` (naming the axis) for a choice the elastic layers
    cannot compute, before any tensor is copied.
    """
    sizes = choice_sizes(model_cfg, choice)
    inner = getattr(model, "module", model)
    _check_model(inner, model_cfg)
    plan = _plan(inner, sizes)
    out: dict[str, torch.Tensor] = {}
    for key, value in inner.state_dict(keep_vars=True).items():
        if key.startswith(_SKIPPED_MODULES) or plan.is_dropped(key):
            continue
        if key in plan.rules:
            out[key] = _apply(value, plan.rules[key])
        elif key.rsplit(".", 1)[-1] == EXTRA_STATE:
            out[key] = value
        else:
            raise ConfigError(
                f"sliced_state_dict: no slicing rule for state-dict entry {key!r} "
                "(a module the elastic layers do not know)"
            )
    return out


def nested_state_dict(
    model: torch.nn.Module, model_cfg: ModelConfig, choice: Mapping[str, int | Sequence[int]]
) -> dict[str, torch.Tensor]:
    """``sliced_state_dict`` of a model in any memory layout: a reordered (strided) model is put
    in canonical order for the cut and restored after. The one recipe for the weights of one
    budget's plain model, used by extraction, export and generation alike."""
    with canonical_weights(model), torch.no_grad():
        return sliced_state_dict(model, model_cfg, choice)
