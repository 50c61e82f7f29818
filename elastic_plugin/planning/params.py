"""The parameters one rank holds under a layout: every tensor's element count, per pipeline stage,
split into the dense ones (reduced over the data-parallel group) and the routed experts' (reduced
over the expert-data-parallel group, ``DP / EP``), as Megatron-Core 0.19.2's ``HybridModel`` with
the local spec lays them out (``models/counting.py`` counts the same tensors unsharded).

Tensor by tensor, not just a total, because Megatron's DDP pads every tensor's start in the
distributed optimizer's buffers to 64 elements: the bytes a rank allocates depend on the list.

Sharding: TP splits every column/row-parallel weight (Mamba's whole mixer, attention, MLP, the
shared expert, the vocabulary of the embedding and output layer); EP splits the routed experts,
whose weights TP splits again (expert tensor parallel = TP); norms, MoE routers and the elastic
budget router are replicated. PP gives each stage its layers ('|' segments, or an even split),
the embedding to the first stage and the final norm + output layer to the last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic_plugin.models.config import ModelConfig

__all__ = ["StageParams", "elastic_router_tensors", "stage_layer_types", "stage_params"]


def stage_layer_types(model: ModelConfig, pp: int) -> list[list[str]]:
    """Layer kinds of each pipeline stage: whole '|' segments per stage when the pattern has
    them, else ``num_layers / pp`` consecutive layers (``ModelConfig.check_parallel`` has
    checked that these divide)."""
    from elastic_plugin.models.config import LAYER_SYMBOLS

    segments = model.hybrid_layer_pattern.split("|")
    if len(segments) > 1:
        per = len(segments) // pp
        return [
            [LAYER_SYMBOLS[c] for seg in segments[i * per : (i + 1) * per] for c in seg]
            for i in range(pp)
        ]
    kinds = model.layer_types
    per = len(kinds) // pp
    return [kinds[i * per : (i + 1) * per] for i in range(pp)]


@dataclass
class StageParams:
    """Element counts of one rank's tensors on one pipeline stage."""

    dense: list[int] = field(default_factory=list)  # reduced over DP (incl. the budget router)
    expert: list[int] = field(default_factory=list)  # routed experts under EP > 1: DP / EP
    router: int = 0  # the elastic budget router's share of ``dense``

    @property
    def total(self) -> int:
        return sum(self.dense) + sum(self.expert)

    @property
    def model(self) -> int:
        """Everything but the elastic budget router (what a frozen teacher copy holds)."""
        return self.total - self.router


def _linear(rows: int, cols: int, bias: bool, tp_rows: int = 1, tp_cols: int = 1) -> list[int]:
    """A linear's weight (+ bias) with its rows or columns split ``tp`` ways; a row-parallel
    linear's bias is not split."""
    out = [rows // tp_rows * (cols // tp_cols)]
    if bias:
        out.append(rows // tp_rows)
    return out


def _mlp(model: ModelConfig, ffn: int, tp: int, bias: bool) -> list[int]:
    rows = ffn * (2 if model.gated_mlp else 1)
    h = model.hidden_size
    return _linear(rows, h, bias, tp_rows=tp) + _linear(h, ffn, bias, tp_cols=tp)


def _layer(model: ModelConfig, kind: str, tp: int, ep: int) -> tuple[list[int], list[int]]:
    """(dense, expert) tensors of one decoder layer on one rank (its pre-norm included)."""
    h, bias = model.hidden_size, model.add_bias_linear
    dense = [h]  # the pre-norm
    expert: list[int] = []
    if kind == "mamba":
        d, nh = model.mamba_d_inner, model.mamba_num_heads
        bc = 2 * model.mamba_num_groups * model.mamba_state_dim
        conv = d + bc
        dense += [
            (2 * d + bc + nh) // tp * h,  # in_proj
            conv // tp * model.mamba_conv_kernel,  # conv1d weight
            conv // tp,  # conv1d bias
            nh // tp,  # A_log
            nh // tp,  # D
            nh // tp,  # dt_bias
            d // tp,  # gated RMSNorm
            h * (d // tp),  # out_proj
        ]
    elif kind == "attention":
        q = model.num_attention_heads * model.head_dim
        kv = model.query_groups * model.head_dim
        qkv_bias = bias or model.add_qkv_bias
        dense += _linear(q + 2 * kv, h, qkv_bias, tp_rows=tp) + _linear(h, q, bias, tp_cols=tp)
        if model.qk_layernorm:  # per-head q / k norms: replicated over TP
            dense += [model.head_dim, model.head_dim]
    elif kind == "mlp":
        dense += _mlp(model, model.ffn_hidden_size, tp, bias)
    elif kind == "moe":
        dense += _linear(model.num_moe_experts, h, bias)  # router: replicated
        for _ in range(model.num_moe_experts // ep):
            expert += _mlp(model, model.moe_ffn_hidden_size, tp, bias)
        if model.moe_shared_expert_intermediate_size:
            dense += _mlp(model, model.moe_shared_expert_intermediate_size, tp, False)
    else:
        raise ValueError(f"layer kind {kind!r}; allowed: mamba, attention, mlp, moe")
    return dense, expert


def elastic_router_tensors(
    num_budgets: int, axes: dict[str, tuple[int, int]], hidden: int
) -> list[int]:
    """The budget router's tensors (``elastic/router.py``: per axis ``Linear(budgets, hidden) ->
    Linear(hidden, layers * candidates)``); ``axes``: name -> (candidates, router layers)."""
    out: list[int] = []
    for candidates, layers in axes.values():
        out += [hidden * num_budgets, hidden, layers * candidates * hidden, layers * candidates]
    return out


def stage_params(
    model: ModelConfig, tp: int, pp: int, ep: int, router: list[int] | None = None
) -> list[StageParams]:
    """One ``StageParams`` per pipeline stage (any rank of the stage holds the same counts).
    ``router``: the elastic budget router's tensors (every chunk holds a replica), or None."""
    h = model.hidden_size
    vocab_shard = model.vocab_size // tp * h
    out = []
    for index, kinds in enumerate(stage_layer_types(model, pp)):
        stage = StageParams()
        if index == 0:
            stage.dense.append(vocab_shard)  # word embeddings (vocab-parallel)
        for kind in kinds:
            dense, expert = _layer(model, kind, tp, ep)
            stage.dense += dense
            # Megatron's DDP keeps experts apart (reduced over DP / EP) only under EP > 1
            # (expert TP = TP here): with EP = 1 they share the dense buffer
            if ep > 1:
                stage.expert += expert
            else:
                stage.dense += expert
        if index == pp - 1:
            stage.dense.append(h)  # final norm
            if model.untie_embeddings_and_output_weights or pp > 1:
                # untied output layer, or the last stage's copy of tied embeddings
                stage.dense.append(vocab_shard)
        if router:
            stage.dense += router
            stage.router = sum(router)
        out.append(stage)
    return out
