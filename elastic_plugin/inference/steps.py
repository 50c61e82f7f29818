"""Cached forward of a Megatron-Core ``HybridModel``: prefill, decode steps, and anything between.

Megatron's own inference path (InferenceContext / static Mamba decode) was found broken for
batch > 1 on this version, so the per-layer steps here use the layers' own weights and, where it
works unchanged, their own submodules (norms, linears, ``get_query_key_value_tensors``, MLP and
MoE layers, embedding, output layer), and our pure-PyTorch Mamba-2 ops for the stateful parts:

* attention: new K/V are written at each row's own positions; queries attend to the cached
  prefix plus the causal part of the new chunk (a per-row mask, so rows of different lengths
  share one batch);
* Mamba: ``in_proj`` -> causal conv continuing from the cached inputs -> SSD scan from the
  cached state (a chunk of tokens) or the single-step recurrence (one token) -> gate -> the
  mixer's gated RMSNorm -> ``out_proj``; the math of ``MambaMixer._ssm_training``;
* MLP / MoE layers are position-wise: the layer module itself runs on the new tokens.

:func:`extend` is the one primitive: ``s`` new tokens for some rows of the cache. ``prefill``
is ``extend`` from an empty cache and ``decode_step`` is ``extend`` with one token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from elastic_plugin.inference.cache import InferenceCache, layer_kind
from elastic_plugin.inference.fast_decode import decode_plan
from elastic_plugin.models.config import ConfigError
from elastic_plugin.models.layers import ELASTIC_STATE_ATTR

if TYPE_CHECKING:  # Megatron ships no types: this annotates what check_model returns
    from megatron.core.models.hybrid.hybrid_model import HybridModel

__all__ = ["check_model", "decode_step", "extend", "extend_ragged", "prefill"]


# ------------------------------------------------------------------------------ model checks
def _inner(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def check_model(model: torch.nn.Module) -> HybridModel:
    """The plain ``HybridModel`` inside ``model``; a clear error for what the steps cannot run."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    inner = _inner(model)
    if not isinstance(inner, HybridModel):
        raise ConfigError(
            f"model: expected a Megatron-Core HybridModel, got {type(inner).__name__}"
        )
    state = getattr(inner, ELASTIC_STATE_ATTR, None)
    if state is not None and state.is_active:
        raise ConfigError(
            "model: an elastic model with an active choice; cached generation runs plain models: "
            "cut the nested model out first (elastic_plugin.nested.model.nested_model(model, "
            "model_cfg, choice)), or clear the elastic state for the full model"
        )
    if not (inner.pre_process and inner.post_process):
        raise ConfigError(
            "model: generation needs the whole model on one rank (--pipeline-model-parallel-size 1)"
        )
    config = inner.config
    for flag, size in (
        ("--tensor-model-parallel-size", config.tensor_model_parallel_size),
        ("--expert-model-parallel-size", config.expert_model_parallel_size),
        ("--context-parallel-size", config.context_parallel_size),
    ):
        if size != 1:
            raise ConfigError(
                f"model: {flag} {size}; cached generation runs at size 1 "
                f"(extract or load the model with a TP=PP=EP=1 layout)"
            )
    if inner.position_embedding_type not in ("none", "rope"):
        raise ConfigError(
            f"model: position_embedding_type={inner.position_embedding_type!r}; "
            "cached generation supports 'none' and 'rope'"
        )
    if getattr(config, "multi_latent_attention", False) or getattr(config, "window_size", None):
        raise ConfigError(
            "model: multi-latent or windowed attention is not supported by cached generation"
        )
    if getattr(config, "attention_output_gate", False):
        raise ConfigError("model: attention_output_gate is not supported by cached generation")
    return inner


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """No autograd and eval behaviour (no MoE load tracking, no dropout); restores the mode."""
    was_training = model.training
    if was_training:
        model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        if was_training:
            model.train(True)


# ------------------------------------------------------------------------------ layer steps
def _attention(
    layer,
    index: int,
    cache: InferenceCache,
    hidden: torch.Tensor,
    rows: torch.Tensor,
    start: torch.Tensor,
) -> torch.Tensor:
    """Self-attention of the new tokens [s, b, h] over each row's cache; writes their K/V."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    attn = layer.self_attention
    s, b = hidden.shape[:2]
    normed = layer.input_layernorm(hidden)
    query, key, value = attn.get_query_key_value_tensors(normed)  # [s, b, heads|groups, d]
    positions = start[None, :] + torch.arange(s, device=hidden.device)[:, None]  # [s, b]
    if cache.rope is not None:
        freqs = cache.rope[positions].unsqueeze(2)  # [s, b, 1, rot_dim]
        query = apply_rotary_pos_emb(query, freqs, config=attn.config)
        key = apply_rotary_pos_emb(key, freqs, config=attn.config)

    keys, values = cache.keys[index], cache.values[index]
    cols = positions.transpose(0, 1)  # [b, s]
    keys[rows[:, None], cols] = key.transpose(0, 1).to(keys.dtype)
    values[rows[:, None], cols] = value.transpose(0, 1).to(values.dtype)
    total = int(start.max()) + s
    k = keys[rows, :total]  # [b, T, groups, d]
    v = values[rows, :total]
    heads, groups = query.shape[2], k.shape[2]
    k = k.repeat_interleave(heads // groups, dim=2).transpose(1, 2)  # [b, heads, T, d]
    v = v.repeat_interleave(heads // groups, dim=2).transpose(1, 2)
    q = query.permute(1, 2, 0, 3)  # [b, heads, s, d]
    allowed = (
        torch.arange(total, device=hidden.device)[None, None, :] <= cols[:, :, None]
    )  # [b, s, T]: key j visible to query at position p iff j <= p
    core = attn.core_attention
    scale = core.softmax_scale
    if attn.config.apply_query_key_layer_scaling:
        scale = scale * core.layer_number  # Megatron's softmax multiplies it back
    out = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=allowed[:, None], scale=scale
    )
    out = out.permute(2, 0, 1, 3).reshape(s, b, -1)
    proj, bias = attn.linear_proj(out)
    hidden = hidden + (proj if bias is None else proj + bias)
    if not _is_identity(layer.mlp):  # a full transformer layer: its MLP is position-wise
        hidden = _positionwise_mlp(layer, hidden)
    return hidden


def _is_identity(module) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    return isinstance(module, IdentityOp)


def _positionwise_mlp(layer, hidden: torch.Tensor) -> torch.Tensor:
    out, bias = layer.mlp(layer.pre_mlp_layernorm(hidden))
    return hidden + (out if bias is None else out + bias)


def _positionwise(layer, hidden: torch.Tensor) -> torch.Tensor:
    """An MLP or MoE layer, called as the hybrid stack calls it (the tokens are independent)."""
    out = layer(hidden_states=hidden, attention_mask=None)
    return out[0] if isinstance(out, tuple) else out


def _mamba(
    layer,
    index: int,
    cache: InferenceCache,
    hidden: torch.Tensor,
    rows: torch.Tensor,
    real: torch.Tensor | None = None,
) -> torch.Tensor:
    """A Mamba layer on the new tokens [s, b, h], continuing each row's conv and SSM state.

    ``real`` [b]: how many of the ``s`` tokens of each row are real; the rest is right padding,
    which leaves the states as the last real token left them (its ``dt`` is 0: no decay, no
    input; the conv state is cut at the last real input)."""
    from elastic_plugin.compat.mamba_ops import (
        causal_conv1d_fn,
        causal_conv1d_update_ref,
        mamba_chunk_scan_combined,
        selective_state_update_ref,
    )

    mixer = layer.mixer
    s, b = hidden.shape[:2]
    heads, groups = mixer.nheads_local_tp, mixer.ngroups_local_tp
    head_dim, state = mixer.headdim, mixer.d_state
    d_inner = heads * head_dim
    bc = groups * state
    zxbcdt, _ = mixer.in_proj(layer.norm(hidden.to(mixer.in_proj.weight.dtype)))
    zxbcdt = zxbcdt.transpose(0, 1)  # [b, s, d]
    z, xbc, dt = torch.split(zxbcdt, [d_inner, d_inner + 2 * bc, heads], dim=-1)
    conv_w = mixer.conv1d_weight.squeeze(1)  # [channels, width]
    conv_b = getattr(mixer, "conv1d_bias", None)
    A = -torch.exp(mixer.A_log.float())
    dt_bias = mixer.dt_bias.float()
    D = mixer.D.float().reshape(heads, head_dim) if mixer.D_has_hdim else mixer.D
    conv_state, ssm_state = cache.conv[index], cache.ssm[index]

    if s == 1:  # the decode recurrence (in place on the cache rows)
        xbc = causal_conv1d_update_ref(
            xbc[:, 0],
            conv_state,
            conv_w,
            conv_b,
            activation=mixer.activation,
            conv_state_indices=rows,
        )
        x, B, C = torch.split(xbc, [d_inner, bc, bc], dim=-1)
        y = selective_state_update_ref(
            ssm_state,
            x.reshape(b, heads, head_dim),
            dt[:, 0],
            A,
            B.reshape(b, groups, state),
            C.reshape(b, groups, state),
            D=D,
            z=z[:, 0].reshape(b, heads, head_dim),
            dt_bias=dt_bias,
            dt_softplus=True,
            state_batch_indices=rows,
        )
        y = y.reshape(1, b, d_inner)
    else:  # a chunk: conv + SSD scan from the cached states
        initial = conv_state[rows]
        inputs = xbc.transpose(1, 2)  # [b, channels, s]
        xbc, conv_final = causal_conv1d_fn(
            inputs,
            conv_w,
            conv_b,
            initial_states=initial,
            return_final_states=True,
            activation=mixer.activation,
        )
        if real is not None:  # the last width - 1 inputs up to each row's last real token
            width = conv_state.shape[-1]
            history = torch.cat([initial.to(inputs.dtype), inputs], dim=-1)
            take = real[:, None, None] + torch.arange(width, device=real.device)[None, None, :]
            conv_final = history.gather(2, take.expand(-1, history.shape[1], -1))
            dt_real = torch.arange(s, device=real.device)[None, :] < real[:, None]  # [b, s]
            dt = F.softplus(dt.float() + dt_bias, threshold=20.0) * dt_real[:, :, None]
        conv_state[rows] = conv_final.to(conv_state.dtype)
        x, B, C = torch.split(xbc.transpose(1, 2), [d_inner, bc, bc], dim=-1)
        y, ssm_final = mamba_chunk_scan_combined(
            x.reshape(b, s, heads, head_dim),
            dt,
            A,
            B.reshape(b, s, groups, state),
            C.reshape(b, s, groups, state),
            mixer.chunk_size,
            D=D,
            z=z.reshape(b, s, heads, head_dim),
            dt_bias=dt_bias if real is None else None,
            initial_states=ssm_state[rows],
            dt_softplus=real is None,
            return_final_states=True,
            state_dtype=ssm_state.dtype,
        )
        ssm_state[rows] = ssm_final
        y = y.reshape(b, s, d_inner).transpose(0, 1)
    if mixer.rmsnorm:  # y is already gated by silu(z): Megatron's training path norms it
        y = mixer.norm(y.contiguous())
    out, bias = mixer.out_proj(y)
    return hidden + (out if bias is None else out + bias)


# ------------------------------------------------------------------------------ the primitive
def _rows(
    cache: InferenceCache, rows: Sequence[int] | torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    if rows is None:
        return torch.arange(cache.batch, device=device)
    index = torch.as_tensor(rows, dtype=torch.long, device=device).reshape(-1)
    if index.numel() == 0 or bool(((index < 0) | (index >= cache.batch)).any()):
        raise ConfigError(
            f"rows={list(index.tolist())}: must be non-empty indices in [0, {cache.batch})"
        )
    if index.unique().numel() != index.numel():
        raise ConfigError(f"rows={index.tolist()}: repeated rows")
    return index


def extend(
    model: torch.nn.Module,
    cache: InferenceCache,
    tokens: torch.Tensor,
    rows: Sequence[int] | torch.Tensor | None = None,
    last_only: bool = False,
    real_tokens: Sequence[int] | torch.Tensor | None = None,
    fast: bool = False,
) -> torch.Tensor:
    """Feed ``tokens`` [b, s] (the same ``s`` new tokens for each of ``rows``, all rows when
    None) after what each row already holds; returns the logits [b, s, vocab] (``[b, 1,
    vocab]`` of the last token with ``last_only``) and advances the rows' lengths by ``s``.

    ``real_tokens`` [b]: only the first ``real_tokens[i]`` tokens of row ``i`` are real, the
    rest right padding: the row advances by its real count, its states are those after its
    last real token, and ``last_only`` returns the logits of that token (the logits of padding
    are meaningless). One forward then feeds sequences of different lengths.

    ``fast``: MLP and MoE layers run as the fast decode step runs them
    (:class:`~elastic_plugin.inference.fast_decode.DecodePlan`: plain linears, only the routed
    experts) on all ``b * s`` tokens at once; the default is the layer modules themselves."""
    inner = check_model(model)
    if tokens.dim() != 2 or tokens.shape[1] < 1:
        raise ConfigError(f"tokens must be [batch, seq >= 1], got {tuple(tokens.shape)}")
    device = cache.lengths.device
    index = _rows(cache, rows, device)
    if tokens.shape[0] != index.numel():
        raise ConfigError(f"tokens has {tokens.shape[0]} rows, rows selects {index.numel()}")
    s = tokens.shape[1]
    start = cache.lengths[index]
    if int(start.max()) + s > cache.max_length:
        raise ConfigError(
            f"the cache holds {cache.max_length} tokens per row (max_length); row "
            f"{int(index[start.argmax()])} has {int(start.max())} and {s} more "
            "do not fit"
        )
    real = None
    if real_tokens is not None:
        real = torch.as_tensor(real_tokens, dtype=torch.long, device=device).reshape(-1)
        if real.numel() != index.numel() or bool(((real < 1) | (real > s)).any()):
            raise ConfigError(
                f"real_tokens={real.tolist()}: one count in [1, {s}] per row ({index.numel()} rows)"
            )
        if bool((real == s).all()):
            real = None  # nothing padded
    tokens = tokens.to(device)
    plan = decode_plan(inner) if fast else None
    with eval_mode(inner):
        positions = start[:, None] + torch.arange(s, device=device)[None, :]
        hidden = inner.embedding(input_ids=tokens, position_ids=positions)  # [s, b, h]
        for number, layer in enumerate(inner.decoder.layers):
            kind = layer_kind(layer)
            if kind == "attention":
                hidden = _attention(layer, number, cache, hidden, index, start)
            elif kind == "mamba":
                hidden = _mamba(layer, number, cache, hidden, index, real)
            elif plan is not None and number in plan.fast_layers:  # tokens are independent
                flat = hidden.reshape(-1, hidden.shape[-1])
                hidden = plan.steps[number](flat, cache, None, start).reshape(hidden.shape)
            else:
                hidden = _positionwise(layer, hidden)
        if last_only:
            if real is None:
                hidden = hidden[-1:]
            else:  # each row's last real token
                hidden = hidden[real - 1, torch.arange(index.numel(), device=device)][None]
        if inner.decoder.post_layer_norm:
            hidden = inner.decoder.final_norm(hidden)
        weight = (
            inner.shared_embedding_or_output_weight()
            if inner.share_embeddings_and_output_weights
            else None
        )
        logits, _ = inner.output_layer(hidden, weight=weight, runtime_gather_output=True)
        logits = inner._scale_logits(logits)
    cache.lengths[index] = start + (s if real is None else real)
    return logits.transpose(0, 1).contiguous()


def extend_ragged(
    model: torch.nn.Module,
    cache: InferenceCache,
    sequences: Sequence[Sequence[int]],
    rows: Sequence[int],
    padded: bool = True,
    fast: bool = False,
) -> torch.Tensor:
    """Feed ``sequences[i]`` (lengths may differ) after what row ``rows[i]`` holds; returns
    each row's logits after its last token ``[len(rows), vocab]``.

    Why not one ``extend`` per row: that is one forward per sequence. ``padded`` (default):
    one forward for the whole batch, the shorter sequences right-padded (``extend``'s
    ``real_tokens``: padding leaves the attention cache beyond each row's length, where the
    next tokens overwrite it, and passes the Mamba states through unchanged). This is what
    makes budget control's switch to the answering model, which re-prefills prompt + thinking
    of every row, one forward. ``padded=False``: rows advance together up to each distinct
    length (one forward per distinct length; padding never fed). ``fast``: as ``extend``'s."""
    if len(sequences) != len(rows) or not rows:
        raise ConfigError(f"extend_ragged: {len(sequences)} sequences for {len(rows)} rows")
    device = cache.lengths.device
    rows_t = torch.as_tensor(list(rows), dtype=torch.long, device=device)
    held = cache.lengths[rows_t]
    if bool((held != held[0]).any()):
        raise ConfigError(
            f"extend_ragged: rows {list(rows)} hold different numbers of tokens "
            f"({held.tolist()}); feed rows that are level"
        )
    lengths = [len(s) for s in sequences]
    if min(lengths) < 1:
        raise ConfigError("extend_ragged: every sequence needs at least one token")
    if padded:
        width = max(lengths)
        feed = torch.tensor(
            [list(seq) + [0] * (width - len(seq)) for seq in sequences], device=device
        )
        logits = extend(
            model, cache, feed, rows=list(rows), last_only=True, real_tokens=lengths, fast=fast
        )
        return logits[:, -1]
    last: dict[int, torch.Tensor] = {}  # sequence -> logits after its last token
    done = 0
    for end in sorted(set(lengths)):
        members = [i for i, n in enumerate(lengths) if n >= end]
        feed = torch.tensor([list(sequences[i][done:end]) for i in members], device=device)
        logits = extend(
            model, cache, feed, rows=[rows[i] for i in members], last_only=True, fast=fast
        )
        for position, i in enumerate(members):
            if lengths[i] == end:
                last[i] = logits[position, -1]
        done = end
    return torch.stack([last[i] for i in range(len(rows))])


def prefill(
    model: torch.nn.Module, tokens: torch.Tensor, max_length: int | None = None
) -> tuple[torch.Tensor, InferenceCache]:
    """Run ``tokens`` [b, s] (equal-length prompts) through a fresh cache of ``max_length``
    tokens per row (the model's max_sequence_length when None); returns ``(logits [b, s,
    vocab], cache)``. Prompts of different lengths: ``InferenceCache.allocate`` once, then
    :func:`extend_ragged` (what ``generate`` does)."""
    inner = check_model(model)
    if tokens.dim() != 2:
        raise ConfigError(f"tokens must be [batch, seq], got {tuple(tokens.shape)}")
    max_length = int(inner.max_sequence_length) if max_length is None else max_length
    if tokens.shape[1] > max_length:
        raise ConfigError(
            f"prompt of {tokens.shape[1]} tokens is longer than max_length {max_length}"
        )
    cache = InferenceCache.allocate(inner, tokens.shape[0], max_length)
    return extend(inner, cache, tokens), cache


def decode_step(
    model: torch.nn.Module,
    cache: InferenceCache,
    next_tokens: torch.Tensor,
    rows: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row (``next_tokens`` [b] or [b, 1]) for ``rows`` (all when None);
    returns the logits [b, vocab]."""
    tokens = next_tokens.reshape(-1, 1)
    return extend(model, cache, tokens, rows)[:, 0]
