"""Elastic behaviour registered into Megatron-Core's layers.

``elastify(model, state)`` walks a built ``HybridModel`` and gives each Megatron module an
elastic subclass (the instance's class is swapped, so parameters, checkpoint keys and hooks stay
exactly Megatron's). Each elastic module asks the shared ``ElasticState`` what is active for its
layer and then either defers to Megatron's own forward (full model) or computes only the active
block (sliced) / the full width times masks (masked). Two registries make it extensible:
``register_elastic(kind)`` names the elastic behaviour (forward) of one kind of module, and
``register_elastic_layer`` adds a rule that finds a kind of decoder layer and binds its modules;
``elastify`` dispatches every layer through the rules, so a new layer type is one registered
class and no edit here.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from elastic_plugin.checkpoint.layout import STRIDED_ATTR
from elastic_plugin.elastic.layers import fp8
from elastic_plugin.elastic.layers.linear import column_parallel_forward, row_parallel_forward
from elastic_plugin.elastic.layers.state import ElasticState
from elastic_plugin.models.config import ConfigError
from elastic_plugin.models.layers import ELASTIC_STATE_ATTR, hybrid_layer_kind
from elastic_plugin.models.prefix import Index, ffn_rows, proj_cols, qkv_rows

if TYPE_CHECKING:  # Megatron ships no types: this annotates the model inside a wrapper
    from megatron.core.models.hybrid.hybrid_model import HybridModel


@dataclass(frozen=True)
class LinearActive:
    """What an elastic linear computes: rows/columns and masks on its input / output."""

    out_index: Index = None
    in_index: Index = None
    in_mask: torch.Tensor | None = None  # over the active input columns (local)
    out_mask: torch.Tensor | None = None  # over the active output rows

    @property
    def is_full(self) -> bool:
        return (
            self.out_index is None
            and self.in_index is None
            and self.in_mask is None
            and self.out_mask is None
        )


# --------------------------------------------------------------------------- registry
_ELASTIC_CLASSES: dict[tuple[type, str], type] = {}  # (Megatron class, kind) -> elastic class
_MIXINS: dict[str, type] = {}


def register_elastic(kind: str):
    """Register a mixin class as the elastic behaviour of module kind ``kind``."""

    def wrap(mixin: type) -> type:
        _MIXINS[kind] = mixin
        return mixin

    return wrap


def _swap(module: torch.nn.Module, kind: str, **attrs) -> None:
    """Give ``module`` the elastic subclass of its own class (created once per class)."""
    base = getattr(type(module), "_elastic_base", type(module))
    key = (base, kind)
    cls = _ELASTIC_CLASSES.get(key)
    if cls is None:
        # a direct subclass of the Megatron class (a mixin base would change the object
        # layout of ABC-derived modules); the mixin's methods call ``_elastic_base`` explicitly
        methods = {
            k: v for k, v in vars(_MIXINS[kind]).items() if not k.startswith("__") or k == "__doc__"
        }
        cls = type(
            f"Elastic{base.__name__}",
            (base,),
            {**methods, "_elastic_kind": kind, "_elastic_base": base},
        )
        _ELASTIC_CLASSES[key] = cls
    module.__class__ = cls
    for name, value in attrs.items():
        object.__setattr__(module, name, value)


def _mul(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return x if mask is None else x * mask.to(x.dtype)


# ----------------------------------------------------------------------- linears
@register_elastic("column")
class _ElasticColumn:
    """Column-parallel linear: active output rows (local) x active input columns."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        act: LinearActive | None = self._elastic_io()
        if (act is None or act.is_full) and not fp8.runs_fp8(self):
            return self._elastic_base.forward(
                self, input_, weight=weight, runtime_gather_output=runtime_gather_output
            )
        act = act or LinearActive()
        # a tied output layer gets the word embeddings from Megatron (``weight``): the same
        # [vocab, hidden] layout, so the active hidden columns are cut from it alike
        out, bias = column_parallel_forward(
            self, _mul(input_, act.in_mask), act.out_index, act.in_index, weight
        )
        return _mul(out, act.out_mask), bias


@register_elastic("row")
class _ElasticRow:
    """Row-parallel linear: active input columns (local) x active output rows."""

    def forward(self, input_):
        act: LinearActive | None = self._elastic_io()
        if (act is None or act.is_full) and not fp8.runs_fp8(self):
            return self._elastic_base.forward(self, input_)
        act = act or LinearActive()
        out, bias = row_parallel_forward(
            self, _mul(input_, act.in_mask), act.out_index, act.in_index
        )
        return _mul(out, act.out_mask), bias


# ---------------------------------------------------------------- embedding / norms
@register_elastic("embedding")
class _ElasticEmbedding:
    """The residual stream starts narrow: the first h' channels, times the hidden mask."""

    def forward(self, *args, **kwargs):
        out = self._elastic_base.forward(self, *args, **kwargs)
        size, mask = self._elastic_state.hidden()
        if size is not None:
            out = out[..., :size]
        return _mul(out, mask)


@register_elastic("norm")
class _ElasticRMSNorm:
    """RMSNorm over the active channels only (masked: the mask sum is the channel count)."""

    def forward(self, x):
        size, mask = self._elastic_state.hidden()
        if size is None and mask is None:
            return self._elastic_base.forward(self, x)
        width = x.shape[-1]
        count = mask.sum() if mask is not None else torch.tensor(float(width))
        xf = x.float()
        rms = torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) / count.to(xf.dtype) + self.eps)
        return (xf * rms).to(x.dtype) * self.weight[:width]


# ------------------------------------------------------------------------ attention
@contextmanager
def _heads_active(attn, heads_local: int):
    """Megatron's attention reads head counts from attributes: set them for one forward."""
    core = attn.core_attention
    saved = (
        attn.num_attention_heads_per_partition,
        core.num_attention_heads_per_partition,
        core.hidden_size_per_partition,
    )
    attn.num_attention_heads_per_partition = heads_local
    core.num_attention_heads_per_partition = heads_local
    core.hidden_size_per_partition = heads_local * attn.hidden_size_per_attention_head
    try:
        yield
    finally:
        (
            attn.num_attention_heads_per_partition,
            core.num_attention_heads_per_partition,
            core.hidden_size_per_partition,
        ) = saved


@register_elastic("attention")
class _ElasticSelfAttention:
    """Fewer query heads per group (K/V heads stay): Megatron's forward on the active heads."""

    def forward(self, *args, **kwargs):
        per_group, _ = self._elastic_state.grouped_heads(
            "attention_heads", self.layer_number, self.config.num_query_groups
        )
        if per_group is None:
            return self._elastic_base.forward(self, *args, **kwargs)
        with _heads_active(self, per_group * self.num_query_groups_per_partition):
            return self._elastic_base.forward(self, *args, **kwargs)


def _attention_io(state: ElasticState, attn, role: str) -> LinearActive | None:
    if not state.is_active:
        return None
    layer = attn.layer_number
    h_size, h_mask = state.hidden()
    per_group, head_mask = state.grouped_heads(
        "attention_heads", layer, attn.config.num_query_groups
    )
    key = ("attn_index", layer, role, per_group)
    index = (
        None
        if per_group is None
        else state.cached(key, lambda: (qkv_rows if role == "qkv" else proj_cols)(attn, per_group))
    )
    if role == "qkv":
        return LinearActive(out_index=index, in_index=h_size)
    heads_mask = None
    if head_mask is not None:
        groups = attn.num_query_groups_per_partition
        d = attn.hidden_size_per_attention_head
        heads_mask = head_mask.repeat(groups).repeat_interleave(d)
    return LinearActive(out_index=h_size, in_index=index, in_mask=heads_mask, out_mask=h_mask)


# ------------------------------------------------------------------------------ MLP


def _mlp_io(
    state: ElasticState, mlp, axis: str | None, layer: int, role: str
) -> LinearActive | None:
    if not state.is_active:
        return None
    h_size, h_mask = state.hidden()
    local, ffn_mask = state.tp_neurons(axis, layer) if axis is not None else (None, None)
    if role == "fc1":
        return LinearActive(out_index=ffn_rows(mlp, local), in_index=h_size)
    return LinearActive(out_index=h_size, in_index=local, in_mask=ffn_mask, out_mask=h_mask)


# -------------------------------------------------------------------------- MoE router
@register_elastic("router")
class _ElasticTopKRouter:
    """Router on the active hidden channels; inactive experts never win the top-k, and the
    active experts' routing weights are scaled by the experts mask (router gradient)."""

    def gating(self, input):
        size, _ = self._elastic_state.hidden()
        if size is None:
            return self._elastic_base.gating(self, input)
        from megatron.core.transformer.moe.moe_utils import router_gating_linear

        dtype = torch.float32 if self.config.moe_router_dtype == "fp32" else input.dtype
        bias = self.bias
        return router_gating_linear(input, self.weight[:, :size], bias, dtype)

    def routing(self, logits, *args, **kwargs):
        mask = self._elastic_state.experts(self.layer_number, self.config.num_moe_experts)
        if mask is None:
            return self._elastic_base.routing(self, logits, *args, **kwargs)
        inactive = (mask.detach() == 0).to(logits.device)
        logits = logits.masked_fill(inactive, -1e9)
        saved_bias = self.expert_bias
        counts_before = (
            self.local_tokens_per_expert.clone()
            if self.local_tokens_per_expert is not None
            else None
        )
        if saved_bias is not None:
            self.expert_bias = saved_bias.masked_fill(inactive, -1e9)
        try:
            probs, routing_map = self._elastic_base.routing(self, logits, *args, **kwargs)
        finally:
            if saved_bias is not None:
                self.expert_bias = saved_bias
        if counts_before is not None:
            # inactive experts got no tokens by design: count them as average so the
            # aux-loss-free bias update does not push them up while they are switched off
            added = self.local_tokens_per_expert - counts_before
            active_mean = added[~inactive].mean() if (~inactive).any() else added.new_zeros(())
            self.local_tokens_per_expert.copy_(
                counts_before + torch.where(inactive, active_mean, added)
            )
        return probs * mask.to(probs.dtype), routing_map


@register_elastic("experts")
class _ElasticSequentialMLP:
    """Switched-off experts receive no tokens: skip them instead of running empty GEMMs."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        state = self._elastic_state
        if (
            not state.is_active
            or self.num_local_experts == 1
            or self.config.fp8
            or self.config.fp4
            or self.config.moe_apply_probs_on_input
        ):
            return self._elastic_base.forward(
                self, permuted_local_hidden_states, tokens_per_expert, permuted_probs
            )
        counts = tokens_per_expert.tolist()
        tokens_list = torch.split(permuted_local_hidden_states, counts)
        probs_list = torch.split(permuted_probs, counts)
        outputs = []
        for expert, tokens, probs, count in zip(
            self.local_experts, tokens_list, probs_list, counts
        ):
            if count == 0:
                outputs.append(tokens)  # [0, h]: nothing to compute
                continue
            outputs.append(expert(tokens, probs)[0])
        return torch.cat(outputs, dim=0), None


# ---------------------------------------------------------------------------- Mamba
@register_elastic("mamba")
class _ElasticMambaMixer:
    """Fewer Mamba heads per group and channels per head (``elastic.layers.mamba``)."""

    def forward(self, hidden_states, *args, **kwargs):
        state = self._elastic_state
        # in FP8 the full width also runs the elastic forward: its in/out projections are
        # Megatron linears that are not swapped, so only this path reaches the FP8 GEMM
        in_fp8 = fp8.runs_fp8(self)
        if not state.is_active and not in_fp8:
            return self._elastic_base.forward(self, hidden_states, *args, **kwargs)
        from elastic_plugin.elastic.layers.mamba import elastic_mamba_forward

        if not state.is_active:  # the full model (teacher / no budget) in FP8
            return elastic_mamba_forward(self, hidden_states)
        layer = self._elastic_layer
        h_size, h_mask = state.hidden()
        per_group, head_mask = state.grouped_heads(
            "mamba_heads", layer, self.config.mamba_num_groups
        )
        head_dim, channel_mask = state.plain("mamba_head_dim", layer)
        if (
            h_size is None
            and h_mask is None
            and per_group is None
            and head_mask is None
            and head_dim is None
            and channel_mask is None
            and not in_fp8
        ):
            return self._elastic_base.forward(self, hidden_states, *args, **kwargs)
        return elastic_mamba_forward(
            self,
            hidden_states,
            hidden_active=h_size,
            heads_per_group=per_group,
            head_dim=head_dim,
            head_mask=head_mask,
            channel_mask=channel_mask,
            hidden_mask=h_mask,
        )


# ----------------------------------------------------------------------- binding helpers
def _bind_linear(module, kind: str, io: Callable[[], LinearActive | None], state) -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    base = ColumnParallelLinear if kind == "column" else RowParallelLinear
    if not isinstance(module, base):
        raise ConfigError(
            f"elastic widths support Megatron-Core's {base.__name__} (local spec); got "
            f"{type(module).__name__} (Transformer Engine linears are not elastic yet: build "
            "the student with the local spec: use_te=False, or a builder's default role "
            "'sliced' / 'student', models/spec_choice.py)"
        )
    _swap(module, kind, _elastic_io=io, _elastic_state=state)


def _norm(module, state) -> None:
    from elastic_plugin.models.norms import LocalRMSNorm

    if not isinstance(module, LocalRMSNorm):
        raise ConfigError(
            f"elastic hidden widths need LocalRMSNorm norms; got {type(module).__name__}"
        )
    _swap(module, "norm", _elastic_state=state)


def _elastify_mlp(mlp, axis: str | None, layer: int, state) -> None:
    _bind_linear(mlp.linear_fc1, "column", lambda: _mlp_io(state, mlp, axis, layer, "fc1"), state)
    _bind_linear(mlp.linear_fc2, "row", lambda: _mlp_io(state, mlp, axis, layer, "fc2"), state)


# ------------------------------------------------------------------------- layer rules
class _LayerRule(Protocol):
    """What ``register_elastic_layer`` takes: a class with these static methods."""

    def matches(self, layer: Any) -> bool: ...

    def elastify(self, layer: Any, state: ElasticState) -> None: ...


_LAYER_RULES: list[_LayerRule] = []


def register_elastic_layer(rule: type) -> type:
    """Register how a kind of decoder layer becomes elastic: a class with static methods
    ``matches(layer) -> bool`` and ``elastify(layer, state)``. ``elastify`` tries the rules
    newest first, so a rule registered later (a user's) takes precedence over a built-in one for
    the same layer; a layer no rule matches is refused. Adding a layer type is one such class."""
    for name in ("matches", "elastify"):
        if not callable(getattr(rule, name, None)):
            raise TypeError(
                f"register_elastic_layer({rule.__name__}): needs a static method {name}(layer, ...)"
            )
    _LAYER_RULES.insert(0, cast(_LayerRule, rule))  # its methods are checked above
    return rule


@register_elastic_layer
class _DenseMLPLayer:
    """A dense MLP layer: pre-MLP norm and the ``ffn`` axis."""

    @staticmethod
    def matches(layer) -> bool:
        return hybrid_layer_kind(layer) == "mlp"

    @staticmethod
    def elastify(layer, state) -> None:
        _norm(layer.pre_mlp_layernorm, state)
        _elastify_mlp(layer.mlp, "ffn", layer.layer_number, state)


@register_elastic_layer
class _MoELayer:
    """An MoE layer: router, routed experts (expert FFN widths are not elastic), shared expert."""

    @staticmethod
    def matches(layer) -> bool:
        return hybrid_layer_kind(layer) == "moe"

    @staticmethod
    def elastify(layer, state) -> None:
        from megatron.core.transformer.moe.experts import SequentialMLP

        number = layer.layer_number
        _norm(layer.pre_mlp_layernorm, state)
        moe = layer.mlp
        _swap(moe.router, "router", _elastic_state=state)
        if not isinstance(moe.experts, SequentialMLP):
            raise ConfigError(
                f"elastic experts need SequentialMLP experts (moe_grouped_gemm="
                f"false); got {type(moe.experts).__name__}"
            )
        for expert in moe.experts.local_experts:
            _elastify_mlp(expert, None, number, state)
        _swap(moe.experts, "experts", _elastic_state=state)
        if getattr(moe, "shared_experts", None) is not None:
            _elastify_mlp(moe.shared_experts, "shared_ffn", number, state)


@register_elastic_layer
class _AttentionLayer:
    """A self-attention layer: input norm, qkv / proj linears and the query-head axis."""

    @staticmethod
    def matches(layer) -> bool:
        return hybrid_layer_kind(layer) == "attention" and hasattr(
            layer.self_attention, "linear_qkv"
        )

    @staticmethod
    def elastify(layer, state) -> None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        attn = layer.self_attention
        config = attn.config
        if (
            config.recompute_granularity == "selective"
            and "core_attn" in (config.recompute_modules or [])
            and isinstance(attn.core_attention, DotProductAttention)
            and "attention_heads" in state.resolved.axes
        ):
            raise ConfigError(
                "--recompute-granularity selective re-runs core attention in the backward pass, "
                "after the elastic layer has restored the head count that Megatron's "
                "DotProductAttention reads from its attributes; use the local spec's SDPA core "
                "attention (the default), or --recompute-granularity full"
            )
        _norm(layer.input_layernorm, state)
        _bind_linear(attn.linear_qkv, "column", lambda: _attention_io(state, attn, "qkv"), state)
        _bind_linear(attn.linear_proj, "row", lambda: _attention_io(state, attn, "proj"), state)
        _swap(attn, "attention", _elastic_state=state)


@register_elastic_layer
class _MambaLayer:
    """A Mamba layer: its norm and the mixer (heads, head channels, hidden)."""

    @staticmethod
    def matches(layer) -> bool:
        return hybrid_layer_kind(layer) == "mamba"

    @staticmethod
    def elastify(layer, state) -> None:
        _norm(layer.norm, state)
        _swap(layer.mixer, "mamba", _elastic_state=state, _elastic_layer=layer.layer_number)


def _layer_rule(layer) -> _LayerRule:
    for rule in _LAYER_RULES:
        if rule.matches(layer):
            return rule
    raise ConfigError(
        f"no elastic behaviour registered for layer type {type(layer).__name__} "
        f"(layer {layer.layer_number}); register one with register_elastic_layer"
    )


# --------------------------------------------------------------------------- elastify
def elastify(model: torch.nn.Module, state: ElasticState) -> torch.nn.Module:
    """Make every layer of a (local-spec) ``HybridModel`` chunk follow ``state``; returns model.

    Each decoder layer is made elastic by the registered rule that matches it
    (``register_elastic_layer``). Function-preserving: with ``state`` cleared the model runs
    Megatron's own forwards. Under TP or EP > 1 the model must be importance-reordered (strided
    FFN/expert layout) so every rank's local prefix is the global nested prefix."""
    inner: HybridModel = getattr(model, "module", model)
    if (state.rank.tp_size > 1 or state.rank.ep_size > 1) and not getattr(
        inner, STRIDED_ATTR, False
    ):
        raise ConfigError(
            "elastic training under tensor/expert parallelism needs an importance-reordered "
            "checkpoint (run `elastic-plugin reorder` first)"
        )
    rules = [_layer_rule(layer) for layer in inner.decoder.layers]  # refuse before changing any
    object.__setattr__(inner, ELASTIC_STATE_ATTR, state)
    if getattr(inner, "pre_process", False):
        _swap(inner.embedding, "embedding", _elastic_state=state)
    for layer, rule in zip(inner.decoder.layers, rules):
        rule.elastify(layer, state)
    if getattr(inner, "post_process", False):
        _norm(inner.decoder.final_norm, state)
        _bind_linear(
            inner.output_layer,
            "column",
            lambda: LinearActive(in_index=state.hidden()[0]) if state.is_active else None,
            state,
        )
        object.__setattr__(
            inner.output_layer, fp8.EXEMPT_ATTR, True
        )  # logits stay in the model dtype
    return model


def elastic_state_of(model: torch.nn.Module) -> ElasticState:
    inner = getattr(model, "module", model)
    state = getattr(inner, ELASTIC_STATE_ATTR, None)
    if state is None:
        raise ValueError("model is not elastic: call elastify(model, state) first")
    return state
