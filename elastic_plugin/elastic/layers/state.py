"""The active nested model of the current micro-batch, as every elastic layer needs to see it.

The router turns a budget into a choice per axis (and per layer when heterogeneous): a size
and, when the router is being trained, a mask over that axis' units that carries the router's
gradient. ``ElasticState`` holds that choice for one micro-batch and answers each layer's question
"which of *my local* units are active, with which mask?", translating the canonical nested order
(position = global importance rank) into this rank's physical units:

* hidden channels are replicated: a prefix on every rank;
* query heads / Mamba heads are nested within their group and a rank holds whole groups: the
  first k heads of every local group;
* FFN neurons (TP) and experts (EP) are ranked globally and stored strided after reordering
  (rank r holds canonical r, r+t, ...), so the local prefix of size/t is the global top-size.

Masks of a TP-sharded axis reach each rank only in part; their gradient is completed with an
all-reduce over TP (``copy_to_tensor_model_parallel_region``: identity forward, all-reduce
backward) so every TP rank holds the router's full gradient. Replicated hidden channels need that
only under sequence parallelism, where each rank sees a slice of the tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, overload

import torch

SLICED, MASKED = "sliced", "masked"


@dataclass(frozen=True)
class AxisActive:
    """One axis of one layer: ``size`` units computed (global count), ``mask`` over them
    (canonical order; for grouped heads over the per-group positions, length size/groups)."""

    size: int
    full: int
    mask: torch.Tensor | None = None

    @property
    def is_full(self) -> bool:
        return self.size == self.full and self.mask is None


@dataclass(frozen=True)
class RankInfo:
    """This rank's coordinates in the groups the elastic axes are sharded over."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    sequence_parallel: bool = False
    strided: bool = False  # FFN/experts reordered into the strided layout (importance.reorder)

    @classmethod
    def current(cls, strided: bool, sequence_parallel: bool) -> RankInfo:
        from megatron.core import parallel_state as ps

        return cls(
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
            ps.get_expert_model_parallel_rank(),
            ps.get_expert_model_parallel_world_size(),
            sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1,
            strided,
        )


@overload
def _tp_grad_sum(mask: torch.Tensor) -> torch.Tensor: ...


@overload
def _tp_grad_sum(mask: None) -> None: ...


@overload
def _tp_grad_sum(mask: torch.Tensor | None) -> torch.Tensor | None: ...


def _tp_grad_sum(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Identity forward; backward sums the mask gradient over the TP group."""
    if mask is None or not mask.requires_grad:
        return mask
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    if ps.get_tensor_model_parallel_world_size() == 1:
        return mask
    return copy_to_tensor_model_parallel_region(mask)


class _MaskGate(torch.autograd.Function):
    """Identity on ``x``; backward returns the gradient the masks' leaf copies gathered."""

    @staticmethod
    def forward(ctx, x, leaves, *masks):
        ctx.leaves = leaves
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grads = [
            leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in ctx.leaves
        ]
        ctx.leaves = None
        return (grad, None, *grads)


class _RestoreChoice(torch.autograd.Function):
    """Identity on the chunk's output; its backward re-activates the micro-batch's choice."""

    @staticmethod
    def forward(ctx, output, state, snapshot):
        ctx.state, ctx.snapshot = state, snapshot
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        ctx.state._restore(ctx.snapshot)
        ctx.state = ctx.snapshot = None
        return grad, None, None


class ElasticState:
    """Choice of the current micro-batch; ``None`` choice = the full model (no elastic code runs)."""

    def __init__(
        self, resolved, rank: RankInfo | None = None, groups: dict[str, int] | None = None
    ) -> None:
        self.resolved = resolved
        self.rank = rank or RankInfo()
        # heads are nested per group: masks of these axes run over per-group positions
        self.groups = dict(groups or {})
        self.mode = SLICED
        self._active: dict[tuple[str, int | None], AxisActive] | None = None
        # derived values per choice, apart for grad mode: a value made under no_grad (inside a
        # recomputed layer's first forward) carries no graph and must not serve a grad forward
        self._caches: dict[bool, dict[Any, Any]] = {True: {}, False: {}}
        # full activation recomputation re-runs layers in the backward pass (``recompute``)
        self.recompute = False

    # ------------------------------------------------------------------ setting the choice
    @property
    def is_active(self) -> bool:
        return self._active is not None

    @property
    def _cache(self) -> dict[Any, Any]:
        return self._caches[torch.is_grad_enabled()]

    def _reset_cache(self) -> None:
        self._caches = {True: {}, False: {}}

    def clear(self) -> None:
        """Run the full model through Megatron's own code paths."""
        self._active = None

    def set_choice(
        self, probs: dict[str, torch.Tensor], mode: str = SLICED, with_masks: bool = True
    ) -> None:
        """Activate the router's output: ``probs[axis]`` is [rows, candidates] (1 row, or one per
        layer of the axis). ``sliced``: hard choice (one-hot rows), compute only the chosen
        prefix; ``masked``: compute the full width, multiply by the prefix masks."""
        from elastic_plugin.elastic.router import prefix_masks

        if mode not in (SLICED, MASKED):
            raise ValueError(f"elastic mode {mode!r}; allowed: {SLICED}, {MASKED}")
        self.mode = mode
        active: dict[tuple[str, int | None], AxisActive] = {}
        for name, spec in self.resolved.axes.items():
            rows = probs[name]
            cands = list(spec.candidates)
            g = self.groups.get(name, 1)
            masks = (
                prefix_masks(rows, [c // g for c in cands], spec.full // g)
                if with_masks or mode == MASKED
                else None
            )
            layers = list(spec.layers) if self.resolved.per_layer(name) else [None]
            for row, layer in enumerate(layers):
                if mode == SLICED:
                    size = cands[int(rows[row].argmax())]
                else:
                    size = spec.full
                mask = masks[row, : size // g] if masks is not None else None
                if name == "embedding" or not spec.layers:
                    active[(name, None)] = AxisActive(size, spec.full, mask)
                elif layer is None:
                    for lay in spec.layers:
                        active[(name, lay)] = AxisActive(size, spec.full, mask)
                else:
                    active[(name, layer)] = AxisActive(size, spec.full, mask)
        self._active = active
        self._reset_cache()

    def set_sizes(self, sizes: dict[str, int | list[int]]) -> None:
        """A fixed hard choice without masks (evaluation, extraction): sizes per axis (per layer)."""
        active: dict[tuple[str, int | None], AxisActive] = {}
        for name, spec in self.resolved.axes.items():
            value = sizes.get(name, spec.full)
            if name == "embedding" or not spec.layers:
                active[(name, None)] = AxisActive(int(value), spec.full)
                continue
            per_layer = value if isinstance(value, (list, tuple)) else [value] * len(spec.layers)
            for lay, size in zip(spec.layers, per_layer):
                active[(name, lay)] = AxisActive(int(size), spec.full)
        self.mode = SLICED
        self._active = active
        self._reset_cache()

    # ------------------------------------------------------- activation recomputation
    def gate_masks(self, x: torch.Tensor) -> torch.Tensor:
        """At a model chunk's input, under full recomputation: layers from here on read
        detached leaf copies of the router's masks, and the returned ``x`` (identity) hands the
        gradient those leaves gathered to the real masks when the backward pass reaches it,
        i.e. after every recomputed layer of this micro-batch has run. (A recomputed layer
        backpropagates inside its own backward call; reaching the router's graph from there
        would run it early and free it.)"""
        if not (self.recompute and self._active is not None and torch.is_grad_enabled()):
            return x
        masks: dict[int, torch.Tensor] = {}
        for act in self._active.values():
            if act.mask is not None and act.mask.requires_grad and act.mask.grad_fn is not None:
                masks.setdefault(id(act.mask), act.mask)
        if not masks:
            return x
        leaves = {key: m.detach().requires_grad_(True) for key, m in masks.items()}
        self._active = {
            key: AxisActive(act.size, act.full, leaves[id(act.mask)])
            if act.mask is not None and id(act.mask) in leaves
            else act
            for key, act in self._active.items()
        }
        self._reset_cache()
        keys = list(masks)
        return _MaskGate.apply(x, [leaves[k] for k in keys], *(masks[k] for k in keys))

    def restore_on_backward(self, output: torch.Tensor) -> torch.Tensor:
        """At a model chunk's output, under full recomputation: when the backward pass reaches
        this micro-batch (1F1B runs later micro-batches' forwards in between), make its choice
        the active one again, so its recomputed layers compute the model they computed."""
        if not (self.recompute and self._active is not None and torch.is_grad_enabled()):
            return output
        if not torch.is_tensor(output) or not output.requires_grad:
            return output
        return _RestoreChoice.apply(output, self, (self.mode, self._active))

    def _restore(self, snapshot: tuple[str, dict]) -> None:
        self.mode, self._active = snapshot
        self._reset_cache()

    def cached(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per choice: index sets and masks the layers derive from the
        current choice (cleared whenever the choice changes)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def axis(self, name: str, layer: int | None = None) -> AxisActive | None:
        if self._active is None:
            return None
        return self._active.get((name, None if name == "embedding" else layer))

    # ----------------------------------------------------------------- per-rank answers
    def hidden(self) -> tuple[int | None, torch.Tensor | None]:
        """(active hidden channels or None for all, mask over them)."""
        act = self.axis("embedding")
        if act is None:
            return None, None
        key = ("hidden",)
        if key not in self._cache:
            mask = _tp_grad_sum(act.mask) if self.rank.sequence_parallel else act.mask
            self._cache[key] = (None if act.size == act.full else act.size, mask)
        return self._cache[key]

    def tp_neurons(self, axis: str, layer: int) -> tuple[int | None, torch.Tensor | None]:
        """FFN-like axis sharded over TP: (local prefix length, local mask)."""
        act = self.axis(axis, layer)
        if act is None:
            return None, None
        key = (axis, layer)
        if key not in self._cache:
            t, r = self.rank.tp_size, self.rank.tp_rank
            local = act.size // t
            mask = None
            if act.mask is not None:
                # strided layout (checked by elastify when t > 1): local j = canonical r + j*t
                canon = r + torch.arange(local) * t
                mask = _tp_grad_sum(act.mask).index_select(0, canon.to(act.mask.device))
            self._cache[key] = (None if act.size == act.full else local, mask)
        return self._cache[key]

    def grouped_heads(
        self, axis: str, layer: int, groups: int
    ) -> tuple[int | None, torch.Tensor | None]:
        """Heads nested per group: (active heads per group or None, mask over the per-group
        positions [per_group_active], the same for every group)."""
        act = self.axis(axis, layer)
        if act is None:
            return None, None
        key = (axis, layer)
        if key not in self._cache:
            per_group = act.size // groups
            self._cache[key] = (None if act.size == act.full else per_group, _tp_grad_sum(act.mask))
        return self._cache[key]

    def plain(self, axis: str, layer: int) -> tuple[int | None, torch.Tensor | None]:
        """An unsharded per-layer axis (Mamba head dim): (active size or None, mask)."""
        act = self.axis(axis, layer)
        if act is None:
            return None, None
        key = (axis, layer)
        if key not in self._cache:
            self._cache[key] = (None if act.size == act.full else act.size, _tp_grad_sum(act.mask))
        return self._cache[key]

    def experts(self, layer: int, num_experts: int) -> torch.Tensor | None:
        """Mask over the router's (physical) experts: 0 = inactive, else the router's weight."""
        act = self.axis("experts", layer)
        if act is None or (act.size == act.full and act.mask is None):
            return None
        key = ("experts", layer)
        if key not in self._cache:
            e = self.rank.ep_size
            canon = torch.arange(act.size)
            if self.rank.strided:
                per_rank = num_experts // e
                physical = (canon % e) * per_rank + canon // e
            else:
                physical = canon
            values = _tp_grad_sum(act.mask) if act.mask is not None else torch.ones(act.size)
            mask = torch.zeros(num_experts, dtype=values.dtype, device=values.device)
            mask = mask.index_put((physical.to(values.device),), values)
            self._cache[key] = mask
        return self._cache[key]
