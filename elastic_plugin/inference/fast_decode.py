"""A decode step whose cost tracks the active parameters: one token per row, few kernels per layer.

Why: the reference step (:func:`steps.extend` with one token) calls Megatron's modules, so a
decode step pays their per-call machinery (autograd functions around each linear, MoE token
permutation, and a loop over *every* local expert whether or not a token was routed to it). On
a CPU at small batch that overhead, not arithmetic, sets the step time, so a nested model with
half the experts and narrower layers decodes barely faster than the full one.

:class:`DecodePlan` reads each layer's weights once (MoE expert weights stacked ``[experts,
out, in]``) and runs the same math with plain tensor ops on ``[batch, hidden]`` activations:

* MoE: Megatron's own gating and top-k routing (``topk_routing_with_score_function``,
  ``dense_output=True``), then only the routed experts: for ``batch * topk <= experts`` their
  weights are gathered and applied with two batched matmuls; otherwise each expert that
  received tokens runs on its tokens (grouped by a sort);
* Mamba: ``in_proj``, the conv as a window product over the cached inputs, the one-step SSM
  recurrence, the gated RMSNorm and ``out_proj``, all in place on the cache rows;
* attention: ``linear_qkv`` split as Megatron splits it, K/V written at each row's position,
  SDPA with grouped K/V (no mask when all rows are at the same position);
* MLP, norms, output layer: ``F.linear`` / ``F.rms_norm`` on the module weights.

A layer the plan does not cover (layer norms other than RMSNorm, q/k layer norm, an MoE
with capacity factor, sinkhorn routing, a shared-expert gate, forward hooks such as the
evaluation's activation quantization, ...) runs through the reference step for that layer, so every model the cached path supports also runs here. Tested for
equality with the reference path (tests/test_budget_control_fast.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from elastic_plugin.inference.cache import InferenceCache, layer_kind

__all__ = ["DecodePlan", "decode_plan"]

# (hidden [b, h], cache, rows (None: all rows in order), positions [b]) -> hidden [b, h]
Step = Callable[[torch.Tensor, InferenceCache, torch.Tensor | None, torch.Tensor], torch.Tensor]


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` without the call when it is a no-op (``Tensor.to`` is patched for CPU
    Megatron and costs microseconds a step even then)."""
    return x if x.dtype == dtype else x.to(dtype)


def _rms(norm: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``F.rms_norm`` with the module's weight and eps, or None when ``norm`` is not an RMSNorm."""
    from megatron.core.transformer.identity_op import IdentityOp

    if isinstance(norm, IdentityOp):
        return lambda x: x
    if isinstance(norm, torch.nn.RMSNorm) and norm.weight is not None:
        weight, eps, shape = norm.weight, norm.eps, tuple(norm.normalized_shape)
        return lambda x: F.rms_norm(x, shape, weight, eps)
    return None


def _linear(module: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A Megatron linear's weight and bias (bias None when absent or skipped-and-added later:
    both are added right after the matmul by the layers this plan covers)."""
    return module.weight, getattr(module, "bias", None)


def _plain_squared_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.pow(F.relu(x), 2)


def _activation(config) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP activation; Megatron's ``squared_relu`` is wrapped in ``torch.compile``
    (``jit_fuser``), whose guard check per call costs more than the two ops it fuses at
    decode sizes, so the plain ops run instead (the same math)."""
    from megatron.core.activations import squared_relu

    act = config.activation_func
    if act is squared_relu:
        act = _plain_squared_relu
    if config.gated_linear_unit:

        def glu(x: torch.Tensor) -> torch.Tensor:
            a, b = torch.chunk(x, 2, dim=-1)
            return act(a) * b

        return glu
    return act


def _mlp(mlp: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A plain Megatron MLP (fc1 -> activation -> fc2) as two ``F.linear``; None otherwise."""
    from megatron.core.transformer.mlp import MLP

    if type(mlp) is not MLP and type(mlp).__name__ != "SharedExpertMLP":
        return None
    if getattr(mlp, "use_shared_expert_gate", False):
        return None
    w1, b1 = _linear(mlp.linear_fc1)
    w2, b2 = _linear(mlp.linear_fc2)
    act = _activation(mlp.config)
    return lambda x: F.linear(act(F.linear(x, w1, b1)), w2, b2)


# ------------------------------------------------------------------------------ layer plans
def _positionwise_step(layer) -> Step | None:
    """An MLP or MoE layer: ``hidden + mlp(pre_mlp_layernorm(hidden))``."""
    norm = _rms(layer.pre_mlp_layernorm)
    if norm is None:
        return None
    mlp = _mlp(layer.mlp)
    if mlp is None:
        mlp = _moe(layer.mlp)
    if mlp is None:
        return None
    ff = mlp
    return lambda hidden, cache, rows, positions: hidden + ff(norm(hidden))


def _moe(moe: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """An MoE layer with top-k routing, running only the routed experts; None when the layer
    uses something this does not reproduce (the reference layer call then runs it)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    if not isinstance(moe, MoELayer):
        return None
    config, router = moe.config, moe.router
    experts = getattr(moe.experts, "local_experts", None)
    if (
        experts is None
        or getattr(router, "routing_type", "none") not in ("none", "aux_loss", "seq_aux_loss")
        or config.moe_expert_capacity_factor is not None
        or config.moe_input_jitter_eps is not None
        or config.moe_router_force_load_balancing
        or getattr(config, "moe_router_force_biased", None) is not None
        or config.moe_router_fusion
        or getattr(config, "moe_latent_size", None)
        or getattr(config, "moe_apply_probs_on_input", False)
    ):
        return None
    if any(getattr(e.linear_fc1, "bias", None) is not None for e in experts):
        return None
    if any(getattr(e.linear_fc2, "bias", None) is not None for e in experts):
        return None
    shared = None
    if getattr(moe, "shared_experts", None) is not None:
        shared = _mlp(moe.shared_experts)
        if shared is None:
            return None
    w1 = torch.stack([e.linear_fc1.weight for e in experts])  # [E, ffn(*2), h]
    w2 = torch.stack([e.linear_fc2.weight for e in experts])  # [E, h, ffn]
    num_experts, topk = w1.shape[0], router.topk
    act = _activation(config)
    router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
        str(config.moe_router_dtype), None
    )
    gate_w, gate_b = router.weight, getattr(router, "bias", None)

    def routed(x: torch.Tensor) -> torch.Tensor:
        dtype = router_dtype or x.dtype
        logits = F.linear(
            _cast(x, dtype), _cast(gate_w, dtype), None if gate_b is None else _cast(gate_b, dtype)
        )
        probs, index = topk_routing_with_score_function(
            logits,
            topk,
            use_pre_softmax=config.moe_router_pre_softmax,
            num_groups=config.moe_router_num_groups,
            group_topk=config.moe_router_group_topk,
            scaling_factor=config.moe_router_topk_scaling_factor,
            score_function=router.score_function,
            expert_bias=router.expert_bias,
            dense_output=True,
        )  # [b, k] each
        probs = _cast(probs, x.dtype)
        b = x.shape[0]
        if b == 1:  # one token: its k experts (weights are views, nothing gathered)
            out = None
            for k, expert in enumerate(index[0].tolist()):
                y = F.linear(act(F.linear(x, w1[expert])), w2[expert]) * probs[:, k : k + 1]
                out = y if out is None else out + y
            assert out is not None
        else:  # each expert that received tokens, on its tokens
            flat = index.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=num_experts).tolist()
            token = order // topk
            gathered = x[token]
            pieces, begin = [], 0
            for expert, count in enumerate(counts):
                if count:
                    chunk = gathered[begin : begin + count]
                    pieces.append(F.linear(act(F.linear(chunk, w1[expert])), w2[expert]))
                    begin += count
            y = torch.cat(pieces) * probs.reshape(-1)[order][:, None]
            out = torch.zeros_like(x).index_add_(0, token, y)
        return out if shared is None else out + shared(x)

    return routed


def _attention_step(layer, index: int) -> Step | None:
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    attn = layer.self_attention
    norm = _rms(layer.input_layernorm)
    if (
        norm is None
        or getattr(attn, "q_layernorm", None) is not None
        or getattr(attn, "k_layernorm", None) is not None
    ):
        return None
    after = None
    if not _is_identity(layer.mlp):  # a full transformer layer
        after = _positionwise_step(layer)
        if after is None:
            return None
    wqkv, bqkv = _linear(attn.linear_qkv)
    wproj, bproj = _linear(attn.linear_proj)
    heads = attn.num_attention_heads_per_partition
    groups = attn.num_query_groups_per_partition
    dim = attn.hidden_size_per_attention_head
    per_group = heads // groups
    core = attn.core_attention
    scale = core.softmax_scale
    if attn.config.apply_query_key_layer_scaling:
        scale = scale * core.layer_number  # Megatron's softmax multiplies it back
    config = attn.config
    # Megatron's unfused RoPE (rotate-half, no MLA interleaving): the step's shared cos / sin
    plain_rope = not config.apply_rope_fusion and not config.multi_latent_attention

    def step(hidden, cache, rows, positions):
        b = hidden.shape[0]
        qkv = F.linear(norm(hidden), wqkv, bqkv).view(b, groups, (per_group + 2) * dim)
        query, key, value = torch.split(qkv, [per_group * dim, dim, dim], dim=-1)
        query = query.reshape(b, heads, dim)
        if cache.step_rope is not None and plain_rope:
            query, key = _rotate(query, cache.step_rope), _rotate(key, cache.step_rope)
        elif cache.rope is not None:
            freqs = cache.rope[positions][None, :, None]  # [1, b, 1, rot_dim]
            query = apply_rotary_pos_emb(query[None], freqs, config=config)[0]
            key = apply_rotary_pos_emb(key[None], freqs, config=config)[0]
        keys, values = cache.keys[index], cache.values[index]
        total = int(positions.max()) + 1
        where = torch.arange(b, device=hidden.device) if rows is None else rows
        keys[where, positions] = _cast(key, keys.dtype)
        values[where, positions] = _cast(value, values.dtype)
        if rows is None:  # all rows of the cache, in order: a view, no copy
            k, v = keys[:, :total], values[:, :total]
        else:
            k, v = keys[rows, :total], values[rows, :total]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [b, groups, T, d]
        mask = None
        if int(positions.min()) + 1 != total:  # rows at different positions
            mask = (torch.arange(total, device=hidden.device) <= positions[:, None])[:, None, None]
        out = F.scaled_dot_product_attention(
            query[:, :, None],
            _cast(k, query.dtype),
            _cast(v, query.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=groups != heads,
        )
        hidden = hidden + F.linear(out.reshape(b, heads * dim), wproj, bproj)
        return hidden if after is None else after(hidden, cache, rows, positions)

    return step


def _step_rope(rope: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin of the rows' positions, ``[b, 1, rot_dim]`` in the activations' dtype, as
    Megatron's ``_apply_rotary_pos_emb_bshd`` makes them in every call (``mscale`` 1): made once
    per decode step instead of twice per attention layer (their cos, sin and casts were a sixth
    of a 30-layer model's decode ops)."""
    freqs = rope[positions][:, None]
    return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


def _rotate(t: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Megatron's rotate-half RoPE of ``t`` ``[b, heads, dim]`` with given cos / sin: the same
    operations, so the same values."""
    cos, sin = cos_sin
    rot = cos.shape[-1]
    head, rest = t[..., :rot], t[..., rot:]
    first, second = torch.chunk(head, 2, dim=-1)
    out = head * cos + torch.cat((-second, first), dim=-1) * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


def _is_identity(module) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    return isinstance(module, IdentityOp)


def _mamba_step(layer, index: int) -> Step | None:
    mixer = layer.mixer
    norm = _rms(layer.norm)
    if norm is None or not mixer.rmsnorm:  # the norm runs without z: the gate is applied before
        return None
    if getattr(mixer.norm, "bias", None) is not None:
        return None
    heads, groups = mixer.nheads_local_tp, mixer.ngroups_local_tp
    head_dim, state = mixer.headdim, mixer.d_state
    d_inner = heads * head_dim
    bc = groups * state
    w_in, b_in = _linear(mixer.in_proj)
    w_out, b_out = _linear(mixer.out_proj)
    conv_w = mixer.conv1d_weight.squeeze(1).float()  # [channels, width]
    conv_b = getattr(mixer, "conv1d_bias", None)
    conv_b = None if conv_b is None else conv_b.float()
    silu_conv = mixer.activation in ("silu", "swish")
    per_group = heads // groups
    A = -torch.exp(mixer.A_log.float()).reshape(groups, per_group, 1, 1)
    dt_bias = mixer.dt_bias.float()
    D = mixer.D.float()
    D = D.reshape(groups, per_group, head_dim) if mixer.D_has_hdim else D.reshape(-1, per_group, 1)
    norm_w, eps = mixer.norm.weight.float(), mixer.norm.eps
    model_dtype = w_in.dtype
    low = model_dtype != torch.float32
    group_size = mixer.norm.group_size or d_inner

    def step(hidden, cache, rows, positions):
        b = hidden.shape[0]
        zxbcdt = F.linear(norm(_cast(hidden, w_in.dtype)), w_in, b_in)
        z, xbc, dt = torch.split(zxbcdt.float(), [d_inner, d_inner + 2 * bc, heads], dim=-1)
        conv_state, ssm_state = cache.conv[index], cache.ssm[index]
        past = conv_state if rows is None else conv_state[rows]
        window = torch.cat([past.float(), xbc[:, :, None]], dim=-1)  # [b, channels, width]
        xbc = (window * conv_w).sum(-1)
        if conv_b is not None:
            xbc = xbc + conv_b
        if silu_conv:
            xbc = F.silu(xbc)
        if low:  # the reference rounds the conv output and the SSM output to the model dtype
            xbc = xbc.to(model_dtype).float()
        if rows is None:
            conv_state.copy_(window[:, :, 1:])
        else:
            conv_state[rows] = _cast(window[:, :, 1:], conv_state.dtype)
        x, B, C = torch.split(xbc, [d_inner, bc, bc], dim=-1)
        # heads grouped [b, G, H/G, ...] so B and C broadcast over the heads of their group
        x = x.reshape(b, groups, per_group, head_dim)
        B = B.reshape(b, groups, 1, 1, state)
        C = C.reshape(b, groups, 1, state, 1)
        dt = F.softplus(dt + dt_bias, threshold=20.0).reshape(b, groups, per_group, 1, 1)
        h = ssm_state if rows is None else ssm_state[rows]
        h = h.view(b, groups, per_group, head_dim, state)
        h = torch.exp(dt * A) * h + (dt * x[..., None]) * B  # [b, G, H/G, P, N]
        if rows is None:
            ssm_state.copy_(h.view(ssm_state.shape))
        else:
            ssm_state[rows] = h.reshape(b, heads, head_dim, state)
        y = (h @ C).squeeze(-1) + x * D  # [b, G, H/G, P]
        y = y.reshape(b, d_inner) * F.silu(z)
        if low:
            y = y.to(model_dtype).float()
        y = y.reshape(b, d_inner // group_size, group_size)
        y = (y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps)).reshape(b, d_inner)
        y = _cast(y * norm_w, w_out.dtype)
        return hidden + F.linear(y, w_out, b_out)

    return step


def _hooked(module: torch.nn.Module) -> bool:
    """Whether a forward hook is attached to ``module`` or below (or globally): the plan calls
    no module, so such a layer must run through the reference step."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def _reference_step(layer, index: int, kind: str) -> Step:
    """The reference per-layer step (steps.py) on ``[1, b, h]``: what the plan does not cover."""
    from elastic_plugin.inference import steps

    def step(hidden, cache, rows, positions):
        index_rows = torch.arange(hidden.shape[0]) if rows is None else rows
        if kind == "attention":
            out = steps._attention(layer, index, cache, hidden[None], index_rows, positions)
        elif kind == "mamba":
            out = steps._mamba(layer, index, cache, hidden[None], index_rows)
        else:
            out = steps._positionwise(layer, hidden[None])
        return out[0]

    return step


# ------------------------------------------------------------------------------ the plan
class DecodePlan:
    """Per-layer decode steps of one plain ``HybridModel`` (see the module docstring).

    ``fast_layers`` / ``reference_layers`` say which layers run which path (the equality
    tests and the benchmark read them)."""

    def __init__(self, model: Any) -> None:  # a HybridModel (Megatron ships no types)
        # weakly: the plan is the value of a WeakKeyDictionary keyed by this model
        self._model = weakref.ref(model)
        self.steps: list[Step] = []
        self.fast_layers: list[int] = []
        self.reference_layers: list[int] = []
        for index, layer in enumerate(model.decoder.layers):
            kind = layer_kind(layer)
            if _hooked(layer):  # e.g. activation quantization: only the module calls run it
                step = None
            elif kind == "attention":
                step = _attention_step(layer, index)
            elif kind == "mamba":
                step = _mamba_step(layer, index)
            else:
                step = _positionwise_step(layer)
            (self.fast_layers if step is not None else self.reference_layers).append(index)
            self.steps.append(step if step is not None else _reference_step(layer, index, kind))
        self.final_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
        if model.decoder.post_layer_norm:
            final = model.decoder.final_norm
            self.final_norm = final if _hooked(final) else (_rms(final) or final)
        self.output_hooked = _hooked(model.output_layer)
        self.fingerprint = _fingerprint(model)

    def __call__(
        self, cache: InferenceCache, tokens: torch.Tensor, rows: torch.Tensor | None
    ) -> torch.Tensor:
        """Logits ``[b, vocab]`` after feeding ``tokens`` ``[b]`` to ``rows`` (all rows of the
        cache, in order, when None); advances their lengths by one. No input checks: the
        caller (``generate``) validated the request."""
        model = self._model()
        if model is None:
            raise RuntimeError("DecodePlan: its model no longer exists")
        positions = cache.lengths if rows is None else cache.lengths[rows]
        hidden = model.embedding(input_ids=tokens[:, None], position_ids=positions[:, None])[0]
        if cache.rope is not None:
            cache.step_rope = _step_rope(cache.rope, positions, hidden.dtype)
        try:
            for step in self.steps:
                hidden = step(hidden, cache, rows, positions)
        finally:
            cache.step_rope = None
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        shared = model.share_embeddings_and_output_weights
        if self.output_hooked:
            weight = model.shared_embedding_or_output_weight() if shared else None
            logits, _ = model.output_layer(hidden, weight=weight, runtime_gather_output=True)
        else:
            weight = (
                model.shared_embedding_or_output_weight() if shared else model.output_layer.weight
            )
            logits = F.linear(hidden, weight, getattr(model.output_layer, "bias", None))
        logits = model._scale_logits(logits)
        if rows is None:
            cache.lengths += 1
        else:
            cache.lengths[rows] = positions + 1
        return logits


def _fingerprint(model: torch.nn.Module) -> tuple[Any, ...]:
    """Changes when any parameter is replaced or written in place (the plan holds stacked
    copies of the expert weights, so it must be rebuilt then)."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


_PLANS: weakref.WeakKeyDictionary[torch.nn.Module, DecodePlan] = weakref.WeakKeyDictionary()


def decode_plan(model: torch.nn.Module) -> DecodePlan:
    """The :class:`DecodePlan` of ``model`` (a checked plain ``HybridModel``), built once and
    kept while its parameters are unchanged."""
    plan = _PLANS.get(model)
    if plan is None or plan.fingerprint != _fingerprint(model):
        with torch.no_grad():
            plan = DecodePlan(model)
        _PLANS[model] = plan
    return plan
