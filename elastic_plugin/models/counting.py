"""Parameter counting from a config alone: the numbers a Megatron-Core ``HybridModel`` would have.

Budgets ("a 23B / 2.8B-active nested model"), the budget loss and memory accounting all need
parameter counts of models that are never built, so this module counts by arithmetic over a
``ModelConfig`` and allocates nothing (no torch, no Megatron import).

The counts match Megatron-Core 0.19.2's ``HybridModel`` built with the local (non-TE) layer spec
(``elastic_plugin.models.specs``); the TE spec fuses each pre-norm into the following linear
(``layer_norm_weight``) and has the same count. Conventions:

* ``total`` is every trainable parameter of the unsharded model (TP/EP/PP do not change it).
* ``active`` is what one token touches: everything counts fully except the routed MoE experts,
  of which ``moe_router_topk`` out of ``num_moe_experts`` count. Router and shared expert count
  fully. **Embeddings (input embedding and untied output layer) count in both total and active**,
  as in the Nemotron Nano v3 "31.6B total / 3.6B active" figures.
* Tied embeddings (``untie_embeddings_and_output_weights: false``) are one tensor, counted once
  (under PP the last stage's copy is a replica, like any replicated tensor).
* Buffers are not parameters: the router's ``expert_bias`` (aux-loss-free balancing) and
  ``local_tokens_per_expert`` are ``register_buffer``s and are not counted.

Breakdown components (stable names; every key is always present, 0 when absent) and the
Megatron parameter names they cover (see :func:`component_of_parameter`):

==================== ==============================================================================
embedding            ``embedding.word_embeddings.weight``
output_layer         ``output_layer.weight`` (0 when embeddings are tied)
mamba                ``mixer.*`` of Mamba layers: in_proj, conv1d weight+bias, A_log, D, dt_bias,
                     the gated RMSNorm over d_inner (``mixer.norm.weight``), out_proj
attention            ``self_attention.*``: linear_qkv (+bias), linear_proj (+bias), the per-head
                     ``q_layernorm``/``k_layernorm`` (head_dim each; not residual-stream norms)
mlp                  ``mlp.*`` of dense MLP layers: linear_fc1 (+bias), linear_fc2 (+bias)
moe_router           ``mlp.router.weight`` (+ ``bias`` with ``add_bias_linear``)
moe_experts          ``mlp.experts.*`` (all routed experts)
moe_shared_expert    ``mlp.shared_experts.*``
norms                the RMSNorms that read the residual stream: each layer's pre-norm
                     (``norm``/``input_layernorm``/``pre_mlp_layernorm``) and ``final_norm``
==================== ==============================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic_plugin.models.config import ModelConfig

COMPONENTS: tuple[str, ...] = (
    "embedding",
    "output_layer",
    "mamba",
    "attention",
    "mlp",
    "moe_router",
    "moe_experts",
    "moe_shared_expert",
    "norms",
)


@dataclass(frozen=True)
class ParamCount:
    """Total and active parameter counts, with a per-component breakdown (keys: ``COMPONENTS``)."""

    total: int
    active: int
    breakdown: dict[str, int] = field(default_factory=dict)
    active_breakdown: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: ``total``/``active`` ints first, then the breakdown per component."""
        return {
            "total": self.total,
            "active": self.active,
            "breakdown": {
                name: {"total": self.breakdown[name], "active": self.active_breakdown[name]}
                for name in COMPONENTS
            },
        }


# ------------------------------------------------------------------------- per-module counts
def _linear(in_features: int, out_features: int, bias: bool) -> int:
    return in_features * out_features + (out_features if bias else 0)


def mamba_mixer_params(model: ModelConfig) -> int:
    """``MambaMixer``: in_proj (z, x, B, C, dt), conv1d over x,B,C with bias, A_log, D, dt_bias,
    gated RMSNorm over d_inner, out_proj. Never biased: the mixer asserts ``bias=False`` and
    the layer does not pass ``add_bias_linear`` (D is per head: ``D_has_hdim=False``)."""
    d_inner = model.mamba_d_inner
    nheads = model.mamba_num_heads
    bc = 2 * model.mamba_num_groups * model.mamba_state_dim
    in_proj = _linear(model.hidden_size, 2 * d_inner + bc + nheads, bias=False)
    conv_dim = d_inner + bc
    conv1d = conv_dim * model.mamba_conv_kernel + conv_dim
    per_head = 3 * nheads  # A_log, D, dt_bias
    gated_norm = d_inner
    out_proj = _linear(d_inner, model.hidden_size, bias=False)
    return in_proj + conv1d + per_head + gated_norm + out_proj


def attention_params(model: ModelConfig) -> int:
    """``SelfAttention``: linear_qkv with (heads + 2*groups) * kv_channels rows (biased with
    ``add_bias_linear`` or ``add_qkv_bias``), linear_proj (biased with ``add_bias_linear`` only),
    and with ``qk_layernorm`` the q and k norms of ``kv_channels`` weights each."""
    q = model.num_attention_heads * model.head_dim
    kv = model.query_groups * model.head_dim
    bias = model.add_bias_linear
    qkv = _linear(model.hidden_size, q + 2 * kv, bias or model.add_qkv_bias)
    head_norms = 2 * model.head_dim if model.qk_layernorm else 0
    return qkv + _linear(q, model.hidden_size, bias) + head_norms


def mlp_params(model: ModelConfig, ffn_hidden_size: int, bias: bool) -> int:
    """``MLP``: fc1 has 2*ffn rows for a gated unit (swiglu), fc2 maps ffn back to hidden."""
    fc1_rows = ffn_hidden_size * (2 if model.gated_mlp else 1)
    return _linear(model.hidden_size, fc1_rows, bias) + _linear(
        ffn_hidden_size, model.hidden_size, bias
    )


def router_params(model: ModelConfig) -> int:
    """``TopKRouter``: weight [experts, hidden] (+ bias [experts]); ``expert_bias`` is a buffer."""
    return model.num_moe_experts * model.hidden_size + (
        model.num_moe_experts if model.add_bias_linear else 0
    )


def _check_buildable(model: ModelConfig) -> None:
    """Reject what Megatron-Core would refuse to build, so no count is given for a non-model."""
    if not isinstance(model, ModelConfig):
        raise TypeError(f"model must be a ModelConfig, got {type(model).__name__}")
    model.validate()  # also rejects a shared expert with biases (Megatron can't build it)


def _layer(model: ModelConfig, kind: str) -> tuple[dict[str, int], dict[str, int]]:
    """(total, active) parameters of one layer of ``kind``, per component."""
    h = model.hidden_size
    total = dict.fromkeys(COMPONENTS, 0)
    total["norms"] = h  # every layer kind has exactly one pre-norm reading the residual stream
    if kind == "mamba":
        total["mamba"] = mamba_mixer_params(model)
    elif kind == "attention":
        total["attention"] = attention_params(model)
    elif kind == "mlp":
        total["mlp"] = mlp_params(model, model.ffn_hidden_size, model.add_bias_linear)
    elif kind == "moe":
        one_expert = mlp_params(model, model.moe_ffn_hidden_size, model.add_bias_linear)
        total["moe_router"] = router_params(model)
        total["moe_experts"] = model.num_moe_experts * one_expert
        if model.moe_shared_expert_intermediate_size:
            total["moe_shared_expert"] = mlp_params(
                model, model.moe_shared_expert_intermediate_size, bias=False
            )
        active = dict(total)
        active["moe_experts"] = model.moe_router_topk * one_expert
        return total, active
    else:
        raise ValueError(f"layer kind {kind!r}; allowed: mamba, attention, mlp, moe")
    return total, dict(total)


# ------------------------------------------------------------------------------ public API
def count_parameters_per_layer(model: ModelConfig) -> list[dict[str, object]]:
    """One entry per decoder layer, in pattern order: ``layer`` (0-based), ``kind``, ``params``,
    ``active``, ``components`` (non-zero per-component totals). The layer's pre-norm is included;
    embedding, output layer and final norm are not (they are not layers)."""
    _check_buildable(model)
    cache: dict[str, tuple[dict[str, int], dict[str, int]]] = {}
    out: list[dict[str, object]] = []
    for index, kind in enumerate(model.layer_types):
        if kind not in cache:
            cache[kind] = _layer(model, kind)
        total, active = cache[kind]
        out.append(
            {
                "layer": index,
                "kind": kind,
                "params": sum(total.values()),
                "active": sum(active.values()),
                "components": {k: v for k, v in total.items() if v},
            }
        )
    return out


def count_parameters(model: ModelConfig) -> ParamCount:
    """Total and active parameters of the ``HybridModel`` this config builds (no allocation).

    Embeddings are counted in both total and active; see the module docstring for the rules.
    """
    _check_buildable(model)
    h, vocab = model.hidden_size, model.vocab_size
    total = dict.fromkeys(COMPONENTS, 0)
    active = dict.fromkeys(COMPONENTS, 0)
    total["embedding"] = active["embedding"] = vocab * h
    if model.untie_embeddings_and_output_weights:
        total["output_layer"] = active["output_layer"] = vocab * h  # ColumnParallelLinear, no bias
    total["norms"] = active["norms"] = h  # final_norm
    per_kind = {kind: _layer(model, kind) for kind in set(model.layer_types)}
    for kind in model.layer_types:
        layer_total, layer_active = per_kind[kind]
        for name in COMPONENTS:
            total[name] += layer_total[name]
            active[name] += layer_active[name]
    return ParamCount(
        total=sum(total.values()),
        active=sum(active.values()),
        breakdown=total,
        active_breakdown=active,
    )


def component_of_parameter(name: str) -> str:
    """Breakdown key of a Megatron ``HybridModel`` parameter name (from ``named_parameters()``).

    Lets a built model be checked against :func:`count_parameters` by summing ``numel`` per key.
    Covers both the local spec and TE's fused ``layer_norm_weight`` names.
    """
    if name.startswith("embedding."):
        return "embedding"
    if name.startswith("output_layer."):
        return "output_layer"
    if ".final_norm." in f".{name}" or "layer_norm_" in name:
        return "norms"
    parts = name.split(".")
    if any(p in ("norm", "input_layernorm", "pre_mlp_layernorm") for p in parts) and (
        "mixer" not in parts
    ):
        return "norms"
    if "mixer" in parts:
        return "mamba"
    if "self_attention" in parts:
        return "attention"
    if "router" in parts:
        return "moe_router"
    if "shared_experts" in parts:
        return "moe_shared_expert"
    if "experts" in parts:
        return "moe_experts"
    if "mlp" in parts:
        return "mlp"
    raise ValueError(f"parameter {name!r} matches no component; known: {', '.join(COMPONENTS)}")


def format_count(n: int) -> str:
    """Human-readable count: 31.58B, 3.58M, 12.3K, or the plain number below 1000."""
    for scale, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)
