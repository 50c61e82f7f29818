"""The budget loss' cost C(choice): parameters or memory of a nested model, differentiable in the
(expected) width of every axis.

``ElasticCost(sizes)`` evaluates the same formulas as ``models/counting.py`` (one Megatron-Core
``HybridModel`` built with the local spec) with the widths as torch tensors, so the router's
expected sizes get gradients. The router draws each axis independently, so for any product of
sizes of different axes ``E[h * f] = E[h] * E[f]``; every term is a product of distinct axes
(hidden x FFN, hidden x heads x head_dim, ...), hence C(E[sizes]) is exactly E[C(sizes)].

Metrics:

* ``total_params`` / ``active_params``: as ``counting.count_parameters`` (embeddings count in both;
  active counts ``moe_router_topk`` routed experts, so the experts axis only shrinks the router).
* ``memory`` (bytes) = weights + KV cache + Mamba state, for ``MemorySpec`` (batch B, sequence S):

  - weights: **total** parameters (every expert must be resident) x bytes per parameter of the
    precision, applied to every parameter: bf16 2, fp8 1, nvfp4 0.5 + one E4M3 scale byte per 16
    values = 0.5625;
  - KV cache per attention layer: ``2 (K, V) * num_query_groups * head_dim * S * B * 2`` bytes
    (bf16 cache; query heads are elastic, KV heads are not, so this does not shrink);
  - Mamba state per Mamba layer: ``nheads * head_dim * d_state * B * 4`` (fp32 SSM state) +
    ``(conv_kernel - 1) * (d_inner + 2 * ngroups * d_state) * B * 2`` (bf16 conv state).

Everything is computed in float64: integer counts stay exact (< 2**53), so ``of_choice`` equals
``counting`` exactly. Cast the result if the loss runs in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from elastic_plugin.elastic.config import BUDGET_METRICS, MemorySpec, ResolvedElastic
from elastic_plugin.models.axes import MODEL_FIELD
from elastic_plugin.models.config import ConfigError, ModelConfig

BYTES_PER_PARAM: dict[str, float] = {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1.0 / 16}
KV_CACHE_BYTES = 2  # bf16 K/V cache
SSM_STATE_BYTES = 4  # fp32 SSM state
CONV_STATE_BYTES = 2  # bf16 conv state

Number = torch.Tensor | float


class ElasticCost:
    """C(sizes) for one resolved config; ``full`` is the cost of the original model."""

    def __init__(
        self,
        model: ModelConfig,
        resolved: ResolvedElastic,
        metric: str | None = None,
        memory: MemorySpec | None = None,
    ):
        self.model = model
        self.resolved = resolved
        self.metric = metric or resolved.config.budget_metric
        self.memory = memory or resolved.config.memory
        if self.metric not in BUDGET_METRICS:
            raise ConfigError(
                f"elastic.budget_metric={self.metric!r}; allowed: {', '.join(BUDGET_METRICS)}"
            )
        kinds = model.layer_types
        self._count = {kind: kinds.count(kind) for kind in ("mamba", "attention", "mlp", "moe")}
        self.full: float = self.of_choice(resolved.full_choice())

    # ------------------------------------------------------------------------------ public
    def __call__(self, sizes: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Cost (0-d float64) of ``sizes``: per axis a 0-d tensor (one size for every layer) or a
        1-d tensor with one entry per layer of ``AxisSpec.layers``; axes left out are full."""
        unknown = sorted(set(sizes) - set(self.resolved.axes))
        if unknown:
            raise ConfigError(
                f"cost sizes: unknown axis {', '.join(unknown)}; axes of this model: "
                f"{', '.join(self.resolved.axes)}"
            )
        device = next((t.device for t in sizes.values() if isinstance(t, torch.Tensor)), None)
        cost = self._cost(
            lambda axis: self._size(sizes, axis, device),
            torch.zeros((), dtype=torch.float64, device=device),
        )
        assert isinstance(cost, torch.Tensor)  # tensors in, a tensor out
        return cost

    def _cost(self, get: Callable[[str], Number], state: Number) -> Number:
        """The cost arithmetic, on 0-d / 1-d tensors (the router's soft sizes) or on floats
        (integer choices: the same formulas without a tensor per size)."""
        m, c = self.model, self._count
        h = get("embedding")
        total = m.vocab_size * h * (2 if m.untie_embeddings_and_output_weights else 1) + h
        active = total
        if c["mamba"]:
            nh, p = get("mamba_heads"), get("mamba_head_dim")
            layer, layer_state = self._mamba(h, nh, p)
            total = total + _layers(layer, c["mamba"])
            active = active + _layers(layer, c["mamba"])
            state = state + _layers(layer_state, c["mamba"])
        if c["attention"]:
            layer = self._attention(h, get("attention_heads"))
            total = total + _layers(layer, c["attention"])
            active = active + _layers(layer, c["attention"])
            kv = 2 * m.query_groups * m.head_dim * self.memory.seq_length * self.memory.batch_size
            state = state + c["attention"] * kv * KV_CACHE_BYTES
        if c["mlp"]:
            layer = h + self._mlp(h, get("ffn"), m.add_bias_linear)
            total = total + _layers(layer, c["mlp"])
            active = active + _layers(layer, c["mlp"])
        if c["moe"]:
            layer_total, layer_active = self._moe(h, get("experts"), get("shared_ffn"))
            total = total + _layers(layer_total, c["moe"])
            active = active + _layers(layer_active, c["moe"])
        if self.metric == "total_params":
            return total
        if self.metric == "active_params":
            return active
        return total * BYTES_PER_PARAM[self.memory.precision] + state

    def fraction(self, sizes: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """C(sizes) / C_full: the quantity the budget loss compares with the budget."""
        return self(sizes) / self.full

    def of_choice(self, choice: Mapping[str, int | Sequence[int]]) -> float:
        """Exact cost of integer sizes (an int per axis, or one int per layer of the axis)."""
        tensors = {}
        for axis, value in choice.items():
            items = list(value) if isinstance(value, Sequence) else [value]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
                raise ConfigError(f"choice[{axis!r}]={value!r}: sizes must be integers")
            tensors[axis] = torch.tensor(value, dtype=torch.float64)
        if all(isinstance(v, int) for v in choice.values()):
            # one size per axis: float arithmetic, ~20x faster than a tensor per size (the
            # planner and the router's freeze cost every choice of the grid: tens of thousands)
            unknown = sorted(set(choice) - set(self.resolved.axes))
            if not unknown:
                return float(self._cost(lambda axis: float(self._int_size(choice, axis)), 0.0))
        with torch.no_grad():
            return float(self(tensors))

    # ------------------------------------------------------------------------------ pieces
    def _int_size(self, choice: Mapping[str, int | Sequence[int]], axis: str) -> int:
        spec = self.resolved.axes.get(axis)
        if axis in choice and spec is not None:
            return choice[axis]  # type: ignore[return-value]  # of_choice passes ints only
        return spec.full if spec is not None else _full_size(self.model, axis)

    def _size(self, sizes: Mapping[str, torch.Tensor], axis: str, device) -> torch.Tensor:
        spec = self.resolved.axes.get(axis)
        if axis not in sizes or spec is None:
            full = spec.full if spec is not None else _full_size(self.model, axis)
            return torch.tensor(float(full), dtype=torch.float64, device=device)
        value = torch.as_tensor(sizes[axis], device=device).to(torch.float64)
        if not spec.layers and value.dim() != 0:
            raise ConfigError(
                f"cost sizes[{axis!r}] has shape {tuple(value.shape)}; allowed: () "
                "(a 0-d tensor: one global choice)"
            )
        if value.dim() == 1 and value.shape[0] != len(spec.layers) or value.dim() > 1:
            raise ConfigError(
                f"cost sizes[{axis!r}] has shape {tuple(value.shape)}; allowed: () or "
                f"({len(spec.layers)},), one entry per layer {spec.layers}"
            )
        return value

    def _mlp(self, h: Number, ffn: Number | int, bias: bool) -> Number:
        """counting.mlp_params: fc1 (2x rows when gated) + fc2, optional biases (``ffn``: an int
        for the experts' width, which is not elastic)."""
        rows = ffn * (2 if self.model.gated_mlp else 1)
        out = h * rows + ffn * h
        return out + rows + h if bias else out

    def _mamba(self, h: Number, nh: Number, p: Number) -> tuple[Number, Number]:
        """One Mamba layer (pre-norm + counting.mamba_mixer_params) and its inference state bytes."""
        m = self.model
        d_inner = nh * p
        bc = 2 * m.mamba_num_groups * m.mamba_state_dim
        conv_dim = d_inner + bc
        params = (
            h  # pre-norm
            + h * (2 * d_inner + bc + nh)  # in_proj: z, x, B, C, dt
            + conv_dim * (m.mamba_conv_kernel + 1)  # conv1d weight + bias
            + 3 * nh  # A_log, D, dt_bias
            + d_inner  # gated RMSNorm
            + d_inner * h
        )  # out_proj
        batch = self.memory.batch_size
        state = (
            d_inner * m.mamba_state_dim * batch * SSM_STATE_BYTES
            + (m.mamba_conv_kernel - 1) * conv_dim * batch * CONV_STATE_BYTES
        )
        return params, state

    def _attention(self, h: Number, heads: Number) -> Number:
        """One attention layer: pre-norm + linear_qkv ((heads + 2 groups) * d rows) + linear_proj
        (counting.attention_params: qkv bias with add_bias_linear or add_qkv_bias, the q/k norms'
        2 d weights with qk_layernorm, which no width axis changes)."""
        m = self.model
        d, kv = m.head_dim, 2 * m.query_groups * m.head_dim
        rows = heads * d + kv
        out = h + h * rows + heads * d * h
        if m.add_bias_linear or m.add_qkv_bias:
            out = out + rows
        if m.qk_layernorm:
            out = out + 2 * d
        return out + h if m.add_bias_linear else out

    def _moe(self, h: Number, experts: Number, shared: Number) -> tuple[Number, Number]:
        """One MoE layer: pre-norm, router, routed experts (top-k of them active), shared expert."""
        m = self.model
        router = experts * h + (experts if m.add_bias_linear else 0)
        one_expert = self._mlp(h, m.moe_ffn_hidden_size, m.add_bias_linear)
        common = h + router + self._mlp(h, shared, False)
        return common + experts * one_expert, common + m.moe_router_topk * one_expert


def _layers(per_layer: Number, count: int) -> Number:
    """Sum a per-layer cost: a 0-d value is the same for all ``count`` layers."""
    if isinstance(per_layer, torch.Tensor) and per_layer.dim() == 1:
        return per_layer.sum()
    return per_layer * count


def _full_size(model: ModelConfig, axis: str) -> int:
    return getattr(model, MODEL_FIELD[axis])
