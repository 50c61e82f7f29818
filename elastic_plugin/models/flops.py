"""Model FLOPs of one forward (and training) pass, for throughput reporting in model TFLOP/s.

Like ``counting.py`` this is arithmetic over a ``ModelConfig`` (no torch, no Megatron import):
the FLOPs of the matrix products a Megatron-Core 0.19.2 ``HybridModel`` built with the local
spec (``models/specs.py``) executes, for the full model or a nested one. A *choice* maps width
axes to sizes as everywhere else (``models/axes.py``): an int per axis, or one int per layer of
the axis (heterogeneous); axes left out are full. Every layer is counted at its own widths, and
the ``embedding`` axis (hidden channels) narrows the input or output of every GEMM.

Conventions:

* **2 FLOPs per multiply-accumulate**; bias adds, activations, norms, softmax, rotary, routing
  (top-k, permutation) and other elementwise work are not counted (``torch.utils.flop_counter``
  does not count them either).
* ``T = batch_size * seq_length`` tokens; ``h`` the (nested) hidden size.
* The embedding is a lookup: 0 FLOPs.
* Attention score products (``QK^T`` and ``AV``) are counted **as a full square** by default:
  each ``2 * b * heads * s * s * head_dim``. That is what Megatron's unfused
  ``DotProductAttention`` computes (``baddbmm`` + ``bmm`` over all ``s x s`` scores, masked
  afterwards), what SDPA's math backend computes, and what ``torch.utils.flop_counter`` counts
  for every SDPA kernel (the usual model-FLOPs convention, as in PaLM). Causal flash kernels (the
  local spec's ``SDPAAttention`` on CPU and GPU, TE's fused attention) skip the key blocks wholly
  above the diagonal, i.e. a little over half; ``causal_scores=True`` counts exactly the
  ``s (s + 1) / 2`` unmasked query-key pairs instead, a lower bound of that work. KV heads are
  repeated (or broadcast) to every query head: GQA saves no score FLOPs.
* MoE: the router GEMM covers the layer's (nested) experts; every token goes to exactly
  ``moe_router_topk`` experts (no capacity dropping), so the routed experts run
  ``topk * T`` token-rows of one expert MLP in total, however the tokens are spread. The shared
  expert runs on all ``T`` tokens. ``full_router=True`` counts the router over all
  ``num_moe_experts`` instead: the elastic sliced forward (``elastic/layers``) computes every
  expert's logit and masks the inactive ones, whereas an extracted nested model has only the
  active experts' router rows.
* A gated MLP (swiglu) has a fc1 of twice the rows.
* Mamba: ``in_proj`` (z, x, B, C, dt rows: ``2*d_inner + 2*groups*state + heads``), ``out_proj``,
  the depthwise causal ``conv1d`` over the x, B, C channels (``2 * T * conv_dim * kernel``) and
  the SSD scan. The scan term counts the matrix products of the chunked scan the model runs
  on CPU (``compat/mamba_ops.ssd_chunk_scan``). ``mamba_ssm``'s Triton kernels compute the same
  terms except that they pass states by a sequential recurrence over chunks (about
  ``c*H*P*N`` multiply-adds instead of ``(c+1)^2*H*P*N``) and do not pad the last chunk.
  Per sequence, with chunk ``Q = min(chunk_size, s)``, ``c = ceil(s / Q)`` chunks and the padded
  length ``L = c * Q``, heads ``H``, head dim ``P``, groups ``G``, state ``N``::

      scan = 2 * (L*G*Q*N          # C B^T inside each chunk, per group
                  + L*H*Q*P        # (decay * C B^T) @ (dt x): the intra-chunk output
                  + L*H*P*N        # chunk-end states from the chunk's inputs
                  + (c+1)^2*H*P*N  # state passing between chunks (einsum over chunk pairs)
                  + L*H*N*P)       # C @ (state entering the chunk): the inter-chunk output

  Left out (elementwise): discretisation (softplus of dt, ``exp`` of the decays, the segment
  sums), the ``D`` skip connection, the ``silu(z)`` gate and the gated RMSNorm.
* The output layer's logits GEMM is ``2 * T * h * vocab_size`` (tied or untied weights alike).
* The GPT-family options add no GEMM: the q/k norms (``qk_layernorm``) and the qkv bias
  (``add_qkv_bias``) are elementwise, and RoPE scaling changes only the rotary frequencies.

``forward_flops`` counts one forward pass of the whole model over the given tokens, however it
is sharded. Model TFLOP/s per rank = ``training_flops`` of the step's global batch (each
micro-batch at its budget's choice) / (step time x world size x ``1e12``).
``training_flops`` = ``3 x`` forward, or ``4 x`` with full activation recomputation (see there).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from elastic_plugin.models.axes import choice_sizes
from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = ["COMPONENTS", "FlopCount", "forward_flops", "ssd_scan_flops", "training_flops"]

COMPONENTS: tuple[str, ...] = (
    "embedding",
    "mamba_in_proj",
    "mamba_conv1d",
    "mamba_scan",
    "mamba_out_proj",
    "attention_qkv",
    "attention_scores",
    "attention_proj",
    "mlp",
    "moe_router",
    "moe_experts",
    "moe_shared_expert",
    "output_layer",
)


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one pass: ``total``, per component (keys ``COMPONENTS``, every key present) and
    per decoder layer (pattern order; embedding and output layer are not layers)."""

    total: int
    breakdown: dict[str, int] = field(default_factory=dict)
    per_layer: tuple[int, ...] = ()

    def scaled(self, factor: int) -> FlopCount:
        """Every count times ``factor`` (forward -> training)."""
        return FlopCount(
            total=self.total * factor,
            breakdown={k: v * factor for k, v in self.breakdown.items()},
            per_layer=tuple(v * factor for v in self.per_layer),
        )

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: ``total``, ``breakdown`` (component -> FLOPs), ``per_layer``."""
        return {
            "total": self.total,
            "breakdown": {name: self.breakdown[name] for name in COMPONENTS},
            "per_layer": list(self.per_layer),
        }


# ------------------------------------------------------------------------- choice -> widths
def _layer_sizes(
    model: ModelConfig, choice: Mapping[str, int | Sequence[int]] | None
) -> tuple[int, list[dict[str, int]]]:
    """(hidden size, per decoder layer {axis: size}) of a choice, checked by ``choice_sizes``
    (a multiple of the axis' group count in [minimum, full], TP = EP = 1)."""
    per_layer: list[dict[str, int]] = [{} for _ in model.layer_types]
    hidden = model.hidden_size
    for name, sizes in choice_sizes(model, dict(choice or {})).items():
        for number, size in sizes.items():
            if number is None:
                hidden = size
            else:
                per_layer[number - 1][name] = size
    return hidden, per_layer


# ------------------------------------------------------------------------- per-layer FLOPs
def _mlp(model: ModelConfig, tokens: int, h: int, ffn: int) -> int:
    """fc1 (twice the rows when gated) + fc2 over ``tokens`` rows."""
    return 2 * tokens * h * ffn * (2 if model.gated_mlp else 1) + 2 * tokens * ffn * h


def ssd_scan_flops(
    seq_length: int, heads: int, head_dim: int, groups: int, state: int, chunk_size: int
) -> int:
    """Matrix-product FLOPs of the chunked SSD scan over one sequence (module docstring)."""
    q = min(chunk_size, max(seq_length, 1))
    chunks = max(1, math.ceil(seq_length / q))
    padded = chunks * q
    return 2 * (
        padded * groups * q * state
        + padded * heads * q * head_dim
        + padded * heads * head_dim * state
        + (chunks + 1) ** 2 * heads * head_dim * state
        + padded * heads * state * head_dim
    )


def _layer(
    model: ModelConfig,
    kind: str,
    sizes: Mapping[str, int],
    h: int,
    seq_length: int,
    batch_size: int,
    full_router: bool,
    causal_scores: bool,
) -> dict[str, int]:
    """FLOPs of one decoder layer of ``kind`` at its widths ``sizes``, per component."""
    t = seq_length * batch_size
    out: dict[str, int] = {}
    if kind == "mamba":
        nh = sizes.get("mamba_heads", model.mamba_num_heads)
        p = sizes.get("mamba_head_dim", model.mamba_head_dim)
        d_inner = nh * p
        bc = 2 * model.mamba_num_groups * model.mamba_state_dim
        out["mamba_in_proj"] = 2 * t * h * (2 * d_inner + bc + nh)
        out["mamba_conv1d"] = 2 * t * (d_inner + bc) * model.mamba_conv_kernel
        out["mamba_scan"] = batch_size * ssd_scan_flops(
            seq_length,
            nh,
            p,
            model.mamba_num_groups,
            model.mamba_state_dim,
            model.mamba_chunk_size,
        )
        out["mamba_out_proj"] = 2 * t * d_inner * h
    elif kind == "attention":
        heads = sizes.get("attention_heads", model.num_attention_heads)
        d = model.head_dim  # not elastic: nested models keep the original kv_channels
        out["attention_qkv"] = 2 * t * h * (heads + 2 * model.query_groups) * d
        pairs = seq_length * (seq_length + 1) // 2 if causal_scores else seq_length**2
        out["attention_scores"] = 2 * (2 * batch_size * heads * pairs * d)  # QK^T and AV
        out["attention_proj"] = 2 * t * heads * d * h
    elif kind == "mlp":
        out["mlp"] = _mlp(model, t, h, sizes.get("ffn", model.ffn_hidden_size))
    elif kind == "moe":
        experts = model.num_moe_experts
        if not full_router:
            experts = sizes.get("experts", experts)
        out["moe_router"] = 2 * t * h * experts
        out["moe_experts"] = _mlp(model, model.moe_router_topk * t, h, model.moe_ffn_hidden_size)
        shared = sizes.get("shared_ffn", model.moe_shared_expert_intermediate_size)
        out["moe_shared_expert"] = _mlp(model, t, h, shared) if shared else 0
    else:
        raise ValueError(f"layer kind {kind!r}; allowed: mamba, attention, mlp, moe")
    return out


# ------------------------------------------------------------------------------ public API
def forward_flops(
    model: ModelConfig,
    seq_length: int,
    batch_size: int = 1,
    choice: Mapping[str, int | Sequence[int]] | None = None,
    *,
    full_router: bool = False,
    causal_scores: bool = False,
) -> FlopCount:
    """FLOPs of one forward pass over ``batch_size`` sequences of ``seq_length`` tokens.

    ``choice``: the nested model (axis -> an int, or one int per layer of the axis); None or
    axes left out are full. ``full_router``: count MoE routers over all experts, as the elastic
    sliced forward runs them; ``causal_scores``: count only the unmasked half of the causal
    attention scores instead of the full square (module docstring). Conventions and the scan formula: module
    docstring. No allocation: pure arithmetic.
    """
    if not isinstance(model, ModelConfig):
        raise TypeError(f"model must be a ModelConfig, got {type(model).__name__}")
    model.validate()
    for name, value in (("seq_length", seq_length), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{name}={value!r}; allowed: a positive integer")
    h, layer_sizes = _layer_sizes(model, choice)
    breakdown = dict.fromkeys(COMPONENTS, 0)
    per_layer: list[int] = []
    for kind, sizes in zip(model.layer_types, layer_sizes):
        layer = _layer(model, kind, sizes, h, seq_length, batch_size, full_router, causal_scores)
        for name, value in layer.items():
            breakdown[name] += value
        per_layer.append(sum(layer.values()))
    breakdown["output_layer"] = 2 * seq_length * batch_size * h * model.vocab_size
    return FlopCount(sum(breakdown.values()), breakdown, tuple(per_layer))


def training_flops(
    model: ModelConfig,
    seq_length: int,
    batch_size: int = 1,
    choice: Mapping[str, int | Sequence[int]] | None = None,
    *,
    recompute: bool = False,
    full_router: bool = False,
    causal_scores: bool = False,
) -> FlopCount:
    """FLOPs of one training step's forward + backward over ``batch_size`` sequences.

    Convention (as in Megatron-LM's and PaLM's model-FLOPs accounting): the backward pass costs
    twice the forward (every product ``Y = X W`` needs ``dX = dY W^T`` and ``dW = X^T dY``), so
    training = ``3 x forward_flops``. ``recompute=True`` (full activation recomputation: the
    forward runs again before the backward) gives ``4 x``. The same factor is applied to every
    component, including the conv and scan terms, where it is an approximation. Optimizer,
    gradient reduction and a distillation teacher's forward are not included (add
    ``forward_flops`` of the teacher for the latter). Megatron's selective recomputation
    (``recompute_granularity="selective"``) reruns only part of each layer; it is not modelled.
    """
    forward = forward_flops(
        model,
        seq_length,
        batch_size,
        choice,
        full_router=full_router,
        causal_scores=causal_scores,
    )
    return forward.scaled(4 if recompute else 3)
