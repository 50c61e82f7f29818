"""Budget routers: map a target budget to a (differentiable) choice of nested size per axis.

One small MLP per width axis (docs/design.md, "Router"): the one-hot encoding of the target
budget goes through
``Linear(num_budgets, hidden) -> LeakyReLU -> Linear(hidden, num_layers * num_candidates)`` and gives
logits over that axis' candidate sizes, one row per layer when the axis is heterogeneous (one row for
all layers when homogeneous). Training samples a choice with Gumbel-Softmax (hard = straight-through);
inference and extraction take the argmax without noise.

Determinism matters: every rank of a model replica holds identical router weights (built from the
same ``seed``, independent of each rank's global RNG) and draws the Gumbel noise on the CPU from a
generator seeded identically, so all ranks compute the same choice without communicating.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F

from elastic_plugin.checkpoint.meta import is_full_budget
from elastic_plugin.models.config import ConfigError

BUDGET_MATCH_TOL = 1e-6
LEAKY_SLOPE = 0.01
ANNEAL_KINDS = ("exponential", "linear")


# ----------------------------------------------------------------------------- budget encoding
def _check_budgets(budgets: Sequence[float]) -> tuple[float, ...]:
    """Budgets must be positive, finite and distinct (the one-hot position identifies a budget)."""
    out = tuple(float(b) for b in budgets)
    if not out:
        raise ConfigError("budgets: at least one trained budget is required, got []")
    for b in out:
        if not math.isfinite(b) or b <= 0:
            raise ConfigError(f"budgets: every budget must be a finite number > 0, got {list(out)}")
    ordered = sorted(out)
    for lo, hi in zip(ordered, ordered[1:]):
        if hi - lo <= BUDGET_MATCH_TOL:
            raise ConfigError(f"budgets: budgets must be distinct, got {list(out)}")
    return out


def budget_encoding(
    budget: float, budgets: Sequence[float], interpolate: bool = False
) -> torch.Tensor:
    """Router input for ``budget``: the one-hot of a trained budget (float32, CPU, length len(budgets)).

    A budget strictly between two trained ones is accepted only with ``interpolate=True`` and gives the
    linear interpolation of the two neighbours' one-hots (an untrained point: the router was never
    optimised there, so the caller has to ask for it explicitly).
    """
    trained = _check_budgets(budgets)
    b = float(budget)
    enc = torch.zeros(len(trained), dtype=torch.float32)
    for i, t in enumerate(trained):
        if abs(b - t) <= BUDGET_MATCH_TOL:
            enc[i] = 1.0
            return enc
    lo_b, hi_b = min(trained), max(trained)
    if not lo_b < b < hi_b:
        raise ConfigError(
            f"budget {b:g} is outside the trained range [{lo_b:g}, {hi_b:g}]; trained budgets: {list(trained)}"
        )
    if not interpolate:
        raise ConfigError(
            f"budget {b:g} is not a trained budget (trained: {list(trained)}); "
            "pass interpolate=True to blend the two nearest trained budgets"
        )
    below = max((t, i) for i, t in enumerate(trained) if t < b)
    above = min((t, i) for i, t in enumerate(trained) if t > b)
    w_above = (b - below[0]) / (above[0] - below[0])
    enc[below[1]] = 1.0 - w_above
    enc[above[1]] = w_above
    return enc


# ----------------------------------------------------------------------------- sampling ops
def gumbel_softmax(
    logits: torch.Tensor,
    temperature: float,
    logit_scale: float,
    hard: bool,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """``softmax((logit_scale * logits + g) / temperature)`` over the last dim, g ~ Gumbel(0, 1).

    The noise is drawn on the CPU from ``generator`` (float64, then cast), so ranks that seed the
    generator the same draw the same noise whatever device ``logits`` live on. ``generator=None``
    means no noise: the deterministic softmax (and, with ``hard``, the argmax) used at inference.
    ``hard`` returns the one-hot of the sample's argmax in value and the soft sample's gradient
    (straight-through); ``hard + (soft - soft.detach())`` keeps the value exactly one-hot.
    """
    if not temperature > 0:
        raise ConfigError(f"router temperature must be > 0, got {temperature}")
    if not logit_scale > 0:
        raise ConfigError(f"router logit_scale must be > 0, got {logit_scale}")
    scores = logits * logit_scale
    if generator is not None:
        u = torch.rand(logits.shape, generator=generator, dtype=torch.float64, device="cpu")
        tiny = torch.finfo(torch.float64).tiny
        g = -torch.log(-torch.log(u.clamp_(min=tiny, max=1.0 - 1e-16)))
        scores = scores + g.to(device=logits.device, dtype=logits.dtype)
    soft = torch.softmax(scores / temperature, dim=-1)
    if not hard:
        return soft
    index = soft.argmax(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(soft).scatter_(-1, index, 1.0)
    return one_hot + (soft - soft.detach())


def _candidate_tensor(probs: torch.Tensor, candidates: Sequence[int]) -> torch.Tensor:
    if probs.shape[-1] != len(candidates):
        raise ConfigError(
            f"router output has {probs.shape[-1]} candidates but {len(candidates)} candidate sizes were given"
        )
    return torch.tensor([float(c) for c in candidates], dtype=probs.dtype, device=probs.device)


def prefix_masks(probs: torch.Tensor, candidates: Sequence[int], full: int) -> torch.Tensor:
    """Soft nested masks ``m_j = Σ_c probs_c · 1[j < candidates_c]``: [L, C] -> [L, full] (differentiable).

    With one-hot ``probs`` this is exactly the prefix mask of the chosen size; with soft probs it is
    the expected mask, so the budget choice gets gradients from the task loss.
    """
    cand = _candidate_tensor(probs, candidates)
    if any(c < 0 or c > full for c in candidates):
        raise ConfigError(f"candidate sizes must lie in [0, full={full}], got {list(candidates)}")
    positions = torch.arange(full, device=probs.device, dtype=probs.dtype)
    indicator = (positions[None, :] < cand[:, None]).to(probs.dtype)  # [C, full]
    return probs @ indicator


def expected_sizes(probs: torch.Tensor, candidates: Sequence[int]) -> torch.Tensor:
    """Expected size per layer, ``probs @ candidates`` ([L]); exact size for one-hot probs."""
    return probs @ _candidate_tensor(probs, candidates)


def hard_sizes(probs: torch.Tensor, candidates: Sequence[int]) -> list[int]:
    """The chosen candidate size per layer (argmax of each row)."""
    _candidate_tensor(probs, candidates)
    return [
        int(candidates[i])
        for i in probs.detach().reshape(-1, len(candidates)).argmax(dim=-1).tolist()
    ]


# ----------------------------------------------------------------------------- router
def _prior_targets(
    budgets: Sequence[float], num_candidates: int, fractions: Sequence[float] | None
) -> list[int]:
    """Candidate index each budget should prefer before training.

    With ``fractions`` (size/full per candidate): the candidate whose fraction is closest to the budget.
    Without: budgets are placed linearly on the candidate list by rank of value, the largest budget on
    candidate 0 (the largest size, candidates being descending) and the smallest on the last one.
    """
    if fractions is not None:
        return [
            min(range(num_candidates), key=lambda c: (abs(fractions[c] - b), c)) for b in budgets
        ]
    lo, hi = min(budgets), max(budgets)
    if num_candidates == 1 or hi == lo:
        return [0 for _ in budgets]
    return [int(round((hi - b) / (hi - lo) * (num_candidates - 1))) for b in budgets]


class _AxisRouter(torch.nn.Module):
    """``Linear -> LeakyReLU -> Linear`` for one axis; output reshaped to [num_layers, num_candidates]."""

    def __init__(self, num_budgets: int, num_candidates: int, num_layers: int, hidden_size: int):
        super().__init__()
        self.num_candidates = num_candidates
        self.num_layers = num_layers
        self.fc1 = torch.nn.Linear(num_budgets, hidden_size)
        self.fc2 = torch.nn.Linear(hidden_size, num_layers * num_candidates)

    # FP32 math whatever the weights' storage (a BF16 model keeps them in BF16, with FP32 main
    # copies in Megatron's optimizer, as Megatron does for its MoE router)
    def hidden(self, encoding: torch.Tensor) -> torch.Tensor:
        fc1 = self.fc1
        return F.leaky_relu(
            F.linear(encoding.float(), fc1.weight.float(), fc1.bias.float()), LEAKY_SLOPE
        )

    def forward(self, encoding: torch.Tensor) -> torch.Tensor:
        fc2 = self.fc2
        logits = F.linear(self.hidden(encoding), fc2.weight.float(), fc2.bias.float())
        return logits.reshape(self.num_layers, self.num_candidates)

    @torch.no_grad()
    def init_output(self, targets: Sequence[int], strength: float) -> None:
        """Set ``fc2`` so that budget i's logits are ``strength`` on its target candidate and 0 elsewhere.

        The hidden codes h_i of the one-hot inputs are fixed by ``fc1``; the minimum-norm least-squares
        ``W2 = (pinv(H) T)ᵀ`` (bias 0) reproduces the targets exactly whenever hidden >= num_budgets
        (the h_i are then independent almost surely), and stays small and trainable (not zero), so
        gradients still reach ``fc1``.
        """
        eye = torch.eye(
            self.fc1.in_features, dtype=self.fc1.weight.dtype, device=self.fc1.weight.device
        )
        h = self.hidden(eye).double()  # [B, hidden]
        t = torch.zeros(len(targets), self.num_candidates, dtype=torch.float64, device=h.device)
        t[torch.arange(len(targets)), torch.tensor(list(targets))] = strength
        t = t.repeat(1, self.num_layers)  # same prior for every layer: [B, L*C]
        w2 = torch.linalg.pinv(h) @ t  # [hidden, L*C]
        self.fc2.weight.copy_(w2.T.to(self.fc2.weight.dtype))
        self.fc2.bias.zero_()


class BudgetRouter(torch.nn.Module):
    """One small MLP per axis: budget one-hot -> logits over the axis' candidate sizes (per layer if heterogeneous).

    ``axes`` maps an axis name to ``(num_candidates, num_layers)``; num_layers 1 = homogeneous (one
    choice shared by all layers). Initialisation:

    - ``init_bias_to_budget=True``: the output layer is solved (see ``_AxisRouter.init_output``) so that
      budget i's logits are ``prior_strength`` on a plausible candidate and 0 elsewhere, in every
      layer: the candidate whose size fraction is closest to the budget when ``candidate_fractions``
      (axis -> size/full per candidate, same order as the candidates) is given, else the candidate at
      the budget's relative rank (largest budget -> largest candidate). With the default strength 2 and
      3 candidates the prior choice has probability ~0.79: preferred, not frozen.
    - ``False``: output layer zero, so every budget starts uniform over the candidates and the
      budget loss does all the work.

    ``seed`` (default 0) builds the weights from a private generator, so every rank gets identical
    routers whatever its global RNG state (Megatron offsets seeds per pipeline stage); ``None`` uses
    the global torch RNG.
    """

    def __init__(
        self,
        budgets: Sequence[float],
        axes: Mapping[str, tuple[int, int]],
        hidden_size: int = 256,
        init_bias_to_budget: bool = True,
        *,
        candidate_fractions: Mapping[str, Sequence[float]] | None = None,
        prior_strength: float = 2.0,
        seed: int | None = 0,
    ):
        super().__init__()
        self.budgets = _check_budgets(budgets)
        if not axes:
            raise ConfigError("router axes: at least one axis is required, got {}")
        if hidden_size < 1:
            raise ConfigError(f"router hidden_size must be >= 1, got {hidden_size}")
        fractions = dict(candidate_fractions or {})
        unknown = sorted(set(fractions) - set(axes))
        if unknown:
            raise ConfigError(
                f"candidate_fractions: unknown axes {unknown}; router axes are {sorted(axes)}"
            )
        self.axes: dict[str, tuple[int, int]] = {}
        for name, shape in axes.items():
            if not isinstance(name, str) or not name or "." in name:
                raise ConfigError(
                    f"router axis names must be non-empty strings without '.', got {name!r}"
                )
            num_candidates, num_layers = (int(v) for v in shape)
            if num_candidates < 1 or num_layers < 1:
                raise ConfigError(
                    f"router axis {name!r}: (num_candidates, num_layers) must both be >= 1, got {tuple(shape)}"
                )
            if name in fractions and len(fractions[name]) != num_candidates:
                raise ConfigError(
                    f"candidate_fractions[{name!r}] has {len(fractions[name])} entries, expected {num_candidates}"
                )
            self.axes[name] = (num_candidates, num_layers)

        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            self.routers = torch.nn.ModuleDict(
                {
                    name: _AxisRouter(len(self.budgets), c, layers, hidden_size)
                    for name, (c, layers) in self.axes.items()
                }
            )
        for name, module in self.routers.items():
            router = cast(_AxisRouter, module)  # a ModuleDict's values are typed Module
            if init_bias_to_budget:
                targets = _prior_targets(self.budgets, router.num_candidates, fractions.get(name))
                router.init_output(targets, prior_strength)
            else:
                with torch.no_grad():
                    router.fc2.weight.zero_()
                    router.fc2.bias.zero_()

    def encode(self, budget: float, interpolate: bool = False) -> torch.Tensor:
        """``budget_encoding`` against this router's trained budgets."""
        return budget_encoding(budget, self.budgets, interpolate)

    def logits(self, encoding: torch.Tensor) -> dict[str, torch.Tensor]:
        """Axis -> logits [num_layers, num_candidates] for one budget encoding ([num_budgets])."""
        if encoding.dim() != 1 or encoding.shape[0] != len(self.budgets):
            raise ConfigError(
                f"router encoding must have shape [{len(self.budgets)}] (one entry per trained budget), "
                f"got {list(encoding.shape)}"
            )
        ref = next(self.parameters())
        enc = encoding.to(device=ref.device, dtype=torch.float32)
        return {name: router(enc) for name, router in self.routers.items()}

    def forward(
        self,
        encoding: torch.Tensor,
        temperature: float,
        logit_scale: float,
        hard: bool,
        generator: torch.Generator | None,
    ) -> dict[str, torch.Tensor]:
        """Axis -> probabilities [num_layers, num_candidates] (Gumbel-Softmax; see ``gumbel_softmax``).

        Axes draw their noise from ``generator`` one after another in insertion order of ``axes``,
        so the same generator seed reproduces the whole choice.
        """
        return {
            name: gumbel_softmax(lg, temperature, logit_scale, hard, generator)
            for name, lg in self.logits(encoding).items()
        }

    @torch.no_grad()
    def choose(self, budget: float, interpolate: bool = False) -> dict[str, list[int]]:
        """Deterministic hard choice for inference/extraction: axis -> candidate index per layer.
        Budget 1.0 is the parent: the full size (candidate 0) of every axis, whatever the
        logits say (it is never routed in training)."""
        logits = self.logits(self.encode(budget, interpolate))
        if is_full_budget(budget):
            return {name: [0] * lg.shape[0] for name, lg in logits.items()}
        return {name: lg.argmax(dim=-1).tolist() for name, lg in logits.items()}


# ----------------------------------------------------------------------------- annealing
@dataclass
class AnnealSchedule:
    """Value annealed from ``start`` to ``end`` over ``iters`` iterations, then held at ``end``.

    ``exponential``: geometric interpolation ``start * (end/start)**(t/iters)`` (the usual schedule for
    a Gumbel temperature 1.0 -> 0.05 or a logit scale 1 -> 10: equal ratios per step); ``linear``:
    ``start + (end - start) * t/iters``. ``value(0) == start``, ``value(t >= iters) == end``.
    """

    start: float
    end: float
    iters: int
    kind: str = "exponential"

    def __post_init__(self) -> None:
        if self.kind not in ANNEAL_KINDS:
            raise ConfigError(f"anneal kind must be one of {list(ANNEAL_KINDS)}, got {self.kind!r}")
        if self.iters < 0:
            raise ConfigError(f"anneal iters must be >= 0, got {self.iters}")
        if self.kind == "exponential" and not (self.start > 0 and self.end > 0):
            raise ConfigError(
                f"exponential anneal needs start > 0 and end > 0, got start={self.start}, end={self.end}"
            )

    def value(self, iteration: int) -> float:
        if self.iters == 0:
            return float(self.end)
        if iteration >= self.iters:
            return float(self.end)
        t = max(iteration, 0) / self.iters
        if self.kind == "linear":
            return float(self.start + (self.end - self.start) * t)
        return float(self.start * (self.end / self.start) ** t)


# ------------------------------------------------------------------------------ in a model
ROUTER_ATTR = (
    "elastic_router"  # the router's submodule name: its checkpoint keys start "elastic_router."
)


class RouterModule(torch.nn.Module):
    """Holds the ``BudgetRouter``; checkpoints it as one replicated copy (main replica: the
    rank at pipeline, tensor and data-parallel position 0)."""

    def __init__(self, router: BudgetRouter) -> None:
        super().__init__()
        self.router = router

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        replica = (
            ps.get_pipeline_model_parallel_rank(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_data_parallel_rank(with_context_parallel=True),
        )
        return {
            f"{prefix}{name}": ShardedTensor.from_rank_offsets(
                f"{prefix}{name}", tensor, replica_id=replica
            )
            for name, tensor in self.state_dict(prefix="", keep_vars=True).items()
        }


def make_router(resolved, seed: int = 0) -> BudgetRouter:
    """One router output per axis (per layer when heterogeneous), biased toward plausible sizes."""
    axes = {
        name: (len(spec.candidates), len(spec.layers) if resolved.per_layer(name) else 1)
        for name, spec in resolved.axes.items()
    }
    fractions = {
        name: [c / spec.full for c in spec.candidates] for name, spec in resolved.axes.items()
    }
    return BudgetRouter(
        resolved.budgets,
        axes,
        hidden_size=resolved.config.router.hidden_size,
        candidate_fractions=fractions,
        seed=seed,
    )


def load_router(model: torch.nn.Module, ckpt_dir: str | Path) -> None:
    """Load the router of an elastic checkpoint into ``model``'s ``RouterModule`` (any layout:
    the router is one replicated copy)."""
    from megatron.core import dist_checkpointing

    from elastic_plugin.checkpoint.history import resolve_checkpoint

    inner = getattr(model, "module", model)
    module = cast(RouterModule, inner.get_submodule(ROUTER_ATTR))  # attach_elastic added it
    sharded = module.sharded_state_dict(prefix=f"{ROUTER_ATTR}.")
    from elastic_plugin.checkpoint.safe_pickle import check_checkpoint_pickles

    source = resolve_checkpoint(ckpt_dir)
    check_checkpoint_pickles(source)  # the model's load checked it: cached unless changed
    loaded = dist_checkpointing.load(sharded, str(source))
    prefix = f"{ROUTER_ATTR}."
    module.load_state_dict({k[len(prefix) :]: v for k, v in loaded.items() if k.startswith(prefix)})
