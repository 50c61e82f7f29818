"""Forward hooks on Megatron-Core modules that accumulate per-unit activation statistics.

One accumulator per (axis, global layer number), holding this rank's *local* units (its TP shard
of heads/neurons, its EP share of experts) summed over the tokens it saw. ``reduce.py`` turns
them into global scores. What each hook measures (docs/design.md, "Importance"):

- embedding channels: ``sum |norm(x)|`` at every norm that reads the residual stream;
- FFN neurons (dense MLP, shared expert): ``sum |input of fc2|``;
- attention query heads: ``sum ||input of linear_proj, head h||_2`` over tokens;
- Mamba: ``sum s^2`` per (head, head-channel), ``s`` the x part of ``in_proj``'s output (the
  published definition), and the same statistic of ``out_proj``'s input (``mamba_out``: the
  gated, normalized SSM output each channel actually contributes);
- MoE experts (REAP): ``sum_tokens g_j(x) ||f_j(x)||_2`` and the routed-token count. Megatron
  scales the activation by the router weight before ``fc2`` (no bias here), so a local expert's
  output row *is* ``g_j(x) f_j(x)``; under expert-TP the partial output is summed over TP first.

Alternative statistics, kept in ``sums`` under ``VARIANT_KEYS`` (selectable per axis by
``importance.methods``; the ablation benchmark compares them): the same activations reduced by
``sum x^2`` instead of ``sum |x|`` (``*_sq``), the residual stream each norm reads
(``embedding_in``: ``sum x^2`` of the norm's input), and for heads the ``sum ||W_o[:, h] y_h||_2``
of what a head writes into the residual stream (``*_out``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from elastic_plugin.models.axes import IMPORTANCE_AXES

if TYPE_CHECKING:  # Megatron ships no types: these annotate what a method takes
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.moe.moe_layer import MoELayer

AXES = IMPORTANCE_AXES
MAMBA_SOURCES = {"x_proj": "mamba", "out_proj_input": "mamba_out"}
# alternative statistics: replicated over TP like the embedding / sharded over TP like their axis
EMBEDDING_VARIANTS = ("embedding_sq", "embedding_in")
SHARDED_VARIANTS = ("ffn_sq", "shared_ffn_sq", "attention_heads_out", "mamba_heads_out")
VARIANT_KEYS = EMBEDDING_VARIANTS + SHARDED_VARIANTS


@dataclass
class LocalStats:
    """This rank's accumulators: ``sums[axis][layer] -> tensor``; counts for experts."""

    sums: dict[str, dict[int, torch.Tensor]] = field(default_factory=lambda: defaultdict(dict))
    expert_tokens: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens_seen: int = 0

    def add(self, axis: str, layer: int, value: torch.Tensor) -> None:
        value = value.detach().double()
        slot = self.sums[axis]
        slot[layer] = slot[layer] + value if layer in slot else value

    def state_dict(self) -> dict[str, Any]:
        return {
            "sums": {a: dict(v) for a, v in self.sums.items()},
            "expert_tokens": dict(self.expert_tokens),
            "tokens_seen": self.tokens_seen,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> LocalStats:
        stats = cls()
        for axis, layers in state["sums"].items():
            stats.sums[axis].update(layers)
        stats.expert_tokens.update(state["expert_tokens"])
        stats.tokens_seen = int(state["tokens_seen"])
        return stats


def _flat_tokens(t: torch.Tensor) -> torch.Tensor:
    """[s, b, d] or [tokens, d] activations as [tokens, d]."""
    return t.reshape(-1, t.shape[-1])


class ImportanceHooks:
    """Registers the hooks on one model chunk; ``remove()`` takes every one of them off again."""

    def __init__(self, model: torch.nn.Module, stats: LocalStats | None = None) -> None:
        self.model: HybridModel = getattr(model, "module", model)
        self.stats = stats or LocalStats()
        self._handles: list[Any] = []
        self.axes_present: set[str] = set()
        self._register()

    # ----------------------------------------------------------------- registration
    def _hook(self, module: torch.nn.Module, fn: Callable, pre: bool = False) -> None:
        if pre:
            self._handles.append(module.register_forward_pre_hook(fn))
        else:
            self._handles.append(module.register_forward_hook(fn))

    def _register(self) -> None:
        from megatron.core.ssm.mamba_layer import MambaLayer
        from megatron.core.transformer.attention import SelfAttention
        from megatron.core.transformer.moe.moe_layer import MoELayer

        decoder = self.model.decoder
        for layer in decoder.layers:
            number = int(layer.layer_number)
            if isinstance(layer, MambaLayer):
                self._embedding_norm(layer.norm, number)
                self._mamba(layer.mixer, number)
                continue
            attention = getattr(layer, "self_attention", None)
            if isinstance(attention, SelfAttention):
                self._embedding_norm(layer.input_layernorm, number)
                self._attention(attention, number)
            mlp = getattr(layer, "mlp", None)
            if mlp is None or _is_identity(mlp):
                continue
            self._embedding_norm(layer.pre_mlp_layernorm, number)
            if isinstance(mlp, MoELayer):
                self._experts(mlp, number)
                if getattr(mlp, "shared_experts", None) is not None:
                    self._ffn(mlp.shared_experts.linear_fc2, number, axis="shared_ffn")
            else:
                self._ffn(mlp.linear_fc2, number)
        final_norm = getattr(decoder, "final_norm", None)
        if final_norm is not None:
            self._embedding_norm(final_norm, 0)

    def _embedding_norm(self, norm: torch.nn.Module, layer: int) -> None:
        """Every residual-stream norm adds into one vector (key 0): one ranking for the model."""
        if norm is None or _is_identity(norm):
            return
        self.axes_present.add("embedding")

        def hook(_m, inp, out):
            out = _flat_tokens(out[0] if isinstance(out, tuple) else out)
            self.stats.add("embedding", 0, out.abs().sum(0))
            self.stats.add("embedding_sq", 0, _sum_of_squares(out))
            self.stats.add("embedding_in", 0, _sum_of_squares(_flat_tokens(inp[0])))

        self._hook(norm, hook)

    def _ffn(self, fc2: torch.nn.Module, layer: int, axis: str = "ffn") -> None:
        self.axes_present.add(axis)

        def hook(_m, args):
            x = _flat_tokens(args[0])
            self.stats.add(axis, layer, x.abs().sum(0))
            self.stats.add(f"{axis}_sq", layer, _sum_of_squares(x))

        self._hook(fc2, hook, pre=True)

    def _attention(self, attention: SelfAttention, layer: int) -> None:
        self.axes_present.add("attention_heads")
        heads = attention.num_attention_heads_per_partition
        head_dim = attention.hidden_size_per_attention_head

        def hook(m, args):
            x = _flat_tokens(args[0]).reshape(-1, heads, head_dim)
            self.stats.add("attention_heads", layer, x.norm(dim=-1).sum(0))
            self.stats.add("attention_heads_out", layer, _head_outputs(x, m.weight))

        self._hook(attention.linear_proj, hook, pre=True)

    def _mamba(self, mixer: MambaMixer, layer: int) -> None:
        self.axes_present.add("mamba")
        d_inner = mixer.d_inner_local_tp
        heads, head_dim = mixer.nheads_local_tp, mixer.headdim

        def hook(_m, _inp, out):
            zxbcdt = out[0] if isinstance(out, tuple) else out
            x = _flat_tokens(zxbcdt)[:, d_inner : 2 * d_inner].reshape(-1, heads, head_dim)
            self.stats.add("mamba", layer, _sum_of_squares(x))

        self._hook(mixer.in_proj, hook)

        def out_hook(m, args):
            y = _flat_tokens(args[0]).reshape(-1, heads, head_dim)
            self.stats.add("mamba_out", layer, _sum_of_squares(y))
            self.stats.add("mamba_heads_out", layer, _head_outputs(y, m.weight))

        self._hook(mixer.out_proj, out_hook, pre=True)

    def _experts(self, moe: MoELayer, layer: int) -> None:
        from megatron.core import parallel_state

        local = getattr(moe.experts, "local_experts", None)
        if local is None:
            raise NotImplementedError(
                f"REAP needs per-expert modules (SequentialMLP); {type(moe.experts).__name__} "
                "(grouped GEMM) is not supported yet — build with moe_grouped_gemm=false"
            )
        self.axes_present.add("experts")
        tp_group = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
        n_local = len(local)

        for index, expert in enumerate(local):

            def hook(_m, _inp, out, index=index):
                rows = out[0] if isinstance(out, tuple) else out
                rows = _flat_tokens(rows).double()
                if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
                    rows = rows.clone()
                    torch.distributed.all_reduce(rows, group=tp_group)
                sums = self.stats.sums["experts"].setdefault(
                    layer, torch.zeros(n_local, dtype=torch.float64)
                )
                sums[index] += rows.norm(dim=-1).sum()
                counts = self.stats.expert_tokens.setdefault(
                    layer, torch.zeros(n_local, dtype=torch.float64)
                )
                counts[index] += rows.shape[0]

            self._hook(expert, hook)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """``sum_tokens x^2`` per unit (dim 0 summed), accumulated in FP64: the squares are rounded
    to the activations' precision (relative error ~1e-8 against squaring in FP64), and no FP64
    copy of the activations is made (twice as fast on a [2048, 1536] activation)."""
    return x.detach().square().sum(0, dtype=torch.float64)


def _head_outputs(x: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """``sum_tokens ||W[:, h] x_h||_2`` per head: what each head writes into the residual stream.

    ``x``: [tokens, heads, head_dim]; ``proj_weight``: this rank's [hidden, heads * head_dim]
    columns of a row-parallel projection (so the heads are local under TP). Through each head's
    Gram matrix ``W_h^T W_h`` ([head_dim, head_dim], built in FP64): no [tokens, heads, hidden]
    intermediate, and head_dim / hidden of the projection's cost. The per-token quadratic forms
    run in FP32 (an FP64 product of every token took a third of the hooks' time), summed over
    tokens in FP64."""
    heads, head_dim = x.shape[1], x.shape[2]
    w = proj_weight.detach().double().view(-1, heads, head_dim)  # [hidden, heads, head_dim]
    gram = torch.einsum("ohd,ohe->hde", w, w).float()
    x = x.detach().float()
    squared = torch.einsum("thd,hde,the->th", x, gram, x)
    return squared.clamp(min=0).sqrt().sum(0, dtype=torch.float64)


def _is_identity(module: torch.nn.Module) -> bool:
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

    return isinstance(module, (IdentityOp, IdentityFuncOp))
