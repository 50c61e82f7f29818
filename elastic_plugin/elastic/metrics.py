"""Logging and plots for elastic training: per-budget losses, router choices, temperature.

One JSON line per logged iteration (``elastic_metrics.jsonl``) is the source of truth: the plots are
drawn from it, so they can be redrawn after (or during) a run. Scalars also go to a
TensorBoard-like writer when one is available; TensorBoard itself is optional.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic_plugin.checkpoint.meta import budget_label

METRICS_FILE = "elastic_metrics.jsonl"
LOSS_PLOT = "elastic_loss.png"
ROUTER_PLOT = "elastic_router.png"

# record sections keyed by budget, and the TensorBoard prefix each one gets
_BUDGET_SECTIONS = {
    "train_loss": "loss",
    "budget_loss": "budget_loss",
    "valid_loss": "valid_loss",
    "choices": "choice",
}


def budget_key(budget: Any) -> str:
    """One spelling per budget (``0.77`` → ``"0.77"``), so JSON keys and tags stay stable."""
    try:
        return budget_label(budget)
    except (TypeError, ValueError):
        return str(budget)


def _plain(value: Any) -> Any:
    """JSON-ready copy: tensors to numbers/lists, budget keys normalised, mappings recursed."""
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, Mapping):
        return {
            budget_key(k) if isinstance(k, (int, float)) else str(k): _plain(v)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """Every numeric leaf as ``tag -> value`` (``train_loss.0.77`` → ``loss/budget_0.77``)."""
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if _is_number(value):
            out[prefix] = float(value)
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(f"{prefix}/layer_{i}", v)

    for key, value in record.items():
        if key in _BUDGET_SECTIONS and isinstance(value, Mapping):
            for budget, sub in value.items():
                walk(f"{_BUDGET_SECTIONS[key]}/budget_{budget}", sub)
        else:
            walk(key, value)
    return out


def _megatron_writer():
    """Megatron-LM's TensorBoard writer if its globals were set up in this process, else ``None``."""
    if "megatron.training.global_vars" not in sys.modules:  # never set up: don't import it
        return None
    try:
        from megatron.training.global_vars import get_tensorboard_writer

        return get_tensorboard_writer()
    except Exception:
        return None


def _tensorboard_writer(log_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard not installed: jsonl + PNG only
        return None
    return SummaryWriter(log_dir=str(log_dir))


class ElasticMetrics:
    """Per-budget losses, router choices, temperature; jsonl + optional TensorBoard + PNG plots.

    ``writer``: anything with ``add_scalar(tag, value, step)``; default Megatron-LM's writer when its
    globals are set, else a ``SummaryWriter`` in ``out_dir/tensorboard`` if tensorboard is installed.
    ``full_sizes``: the full size per axis, to plot choices as fractions (default: the largest size
    seen for that axis in the history). Only ``log_rank`` writes (when torch.distributed is
    initialised; negative counts from the end, e.g. -1 = the last rank, where Megatron keeps losses).
    """

    def __init__(
        self,
        out_dir: Path,
        budgets: Sequence[float],
        writer=None,
        full_sizes: Mapping[str, int] | None = None,
        log_rank: int = 0,
    ) -> None:
        if not budgets:
            raise ValueError("budgets must name at least one budget")
        self.out_dir = Path(out_dir)
        self.budgets = [budget_key(b) for b in budgets]
        self.full_sizes = dict(full_sizes or {})
        self.path = self.out_dir / METRICS_FILE
        self.is_writer = self._is_log_rank(log_rank)
        self.writer = None
        if self.is_writer:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.writer = (
                writer
                if writer is not None
                else (_megatron_writer() or _tensorboard_writer(self.out_dir / "tensorboard"))
            )

    @staticmethod
    def _is_log_rank(log_rank: int) -> bool:
        if not (dist.is_available() and dist.is_initialized()):
            return True
        world = dist.get_world_size()
        return dist.get_rank() == log_rank % world

    def log(self, iteration: int, record: Mapping[str, Any]) -> None:
        """Append ``{"iteration": iteration, **record}`` to the jsonl; ``add_scalar`` every number."""
        if not self.is_writer:
            return
        plain = _plain(dict(record))
        with self.path.open("a") as fh:
            fh.write(json.dumps({"iteration": int(iteration), **plain}) + "\n")
        if self.writer is not None:
            for tag, value in _scalars(plain).items():
                self.writer.add_scalar(tag, value, int(iteration))

    def history(self) -> list[dict]:
        """All logged records, oldest first (empty if nothing was logged yet)."""
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def plot(self) -> list[Path]:
        """Draw ``elastic_loss.png`` and ``elastic_router.png`` from the history; return the paths."""
        history = self.history()
        if not self.is_writer or not history:
            return []
        paths = [self._plot_losses(history)]
        router = self._plot_router(history)
        if router is not None:
            paths.append(router)
        return paths

    def _budget_order(self, history: list[dict], section: str) -> list[str]:
        seen = {b for rec in history for b in (rec.get(section) or {})}
        return [b for b in self.budgets if b in seen] + sorted(seen - set(self.budgets))

    def _plot_losses(self, history: list[dict]) -> Path:
        from matplotlib.figure import Figure  # object API: no pyplot global state, Agg on save

        has_budget_loss = any(rec.get("budget_loss") for rec in history)
        fig = Figure(figsize=(11 if has_budget_loss else 7, 4.5))
        axes = fig.subplots(1, 2 if has_budget_loss else 1, squeeze=False)[0]
        colors = _colors(
            self._budget_order(history, "train_loss") + self._budget_order(history, "valid_loss")
        )
        ax = axes[0]
        for section, style in (
            ("train_loss", dict(lw=1.2)),
            ("valid_loss", dict(marker="o", ls="--")),
        ):
            for b in self._budget_order(history, section):
                xs, ys = _series(history, lambda r, b=b, s=section: (r.get(s) or {}).get(b))
                label = f"{'train' if section == 'train_loss' else 'valid'} b={b}"
                ax.plot(xs, ys, color=colors[b], label=label, **style)
        ax.set(xlabel="iteration", ylabel="KD loss (T² KL)", title="distillation loss per budget")
        ax.legend(fontsize=7)
        if has_budget_loss:
            ax = axes[1]
            for b in self._budget_order(history, "budget_loss"):
                xs, ys = _series(history, lambda r, b=b: (r.get("budget_loss") or {}).get(b))
                ax.plot(xs, ys, color=colors.get(b), label=f"b={b}")
            ax.set(xlabel="iteration", ylabel="|C/(b·C_full) − 1|", title="budget loss")
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = self.out_dir / LOSS_PLOT
        fig.savefig(path, dpi=100)
        return path

    def _fractions(self, history: list[dict]) -> dict[str, dict[str, tuple[list, list]]]:
        """axis -> budget -> (iterations, chosen size / full size); per-layer choices are averaged."""

        def size(v: Any) -> float | None:
            if _is_number(v):
                return float(v)
            if isinstance(v, list) and v and all(_is_number(x) for x in v):
                return sum(v) / len(v)
            return None

        full: dict[str, float] = dict(self.full_sizes)
        for rec in history:
            for per_axis in (rec.get("choices") or {}).values():
                for axis, v in per_axis.items():
                    biggest = max(v) if isinstance(v, list) and v else v
                    if axis not in self.full_sizes and _is_number(biggest):
                        full[axis] = max(full.get(axis, 0.0), float(biggest))
        out: dict[str, dict[str, tuple[list, list]]] = {}
        for rec in history:
            for b, per_axis in (rec.get("choices") or {}).items():
                for axis, v in per_axis.items():
                    s = size(v)
                    if s is None or not full.get(axis):
                        continue
                    xs, ys = out.setdefault(axis, {}).setdefault(b, ([], []))
                    xs.append(rec["iteration"])
                    ys.append(s / full[axis])
        return out

    def _plot_router(self, history: list[dict]) -> Path | None:
        from matplotlib.figure import Figure

        fractions = self._fractions(history)
        has_temp = any(_is_number(rec.get("temperature")) for rec in history)
        if not fractions and not has_temp:
            return None
        n = len(fractions) + (1 if has_temp else 0)
        cols = min(3, n)
        rows = math.ceil(n / cols)
        fig = Figure(figsize=(4.2 * cols, 3.4 * rows))
        grid = fig.subplots(rows, cols, squeeze=False).ravel()
        colors = _colors(self._budget_order(history, "choices"))
        for ax, (axis, per_budget) in zip(grid, sorted(fractions.items())):
            for b in self._budget_order(history, "choices"):
                if b in per_budget:
                    ax.plot(*per_budget[b], color=colors[b], label=f"b={b}")
            ax.set(
                title=f"router: {axis}",
                xlabel="iteration",
                ylabel="chosen size / full",
                ylim=(0, 1.05),
            )
            ax.legend(fontsize=7)
        if has_temp:
            ax = grid[len(fractions)]
            xs, ys = _series(history, lambda r: r.get("temperature"))
            ax.plot(xs, ys, color="tab:red", label="temperature")
            ax.set(title="Gumbel-Softmax schedule", xlabel="iteration", ylabel="temperature")
            xs, ys = _series(history, lambda r: r.get("logit_scale"))
            if xs:
                twin = ax.twinx()
                twin.plot(xs, ys, color="tab:blue", ls="--", label="logit scale")
                twin.set_ylabel("logit scale")
                twin.legend(fontsize=7, loc="center right")
            ax.legend(fontsize=7, loc="upper right")
        for ax in grid[n:]:
            ax.set_visible(False)
        fig.tight_layout()
        path = self.out_dir / ROUTER_PLOT
        fig.savefig(path, dpi=100)
        return path


def _series(history: list[dict], get) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for rec in history:
        v = get(rec)
        if _is_number(v):
            xs.append(rec["iteration"])
            ys.append(float(v))
    return xs, ys


def _colors(keys: Sequence[str]) -> dict[str, str]:
    palette = [f"C{i}" for i in range(10)]
    out: dict[str, str] = {}
    for k in keys:
        out.setdefault(k, palette[len(out) % len(palette)])
    return out
