"""Every compared model measured the same way, in this process: held-out validation loss
(``evaluation.lm_loss.sequence_loss_sums`` on the same windows of the validation split) and accuracy
on the same held-out problems (``evaluation.settings.run_setting``, the demo report's measure),
one model in memory at a time."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["Measure", "load_route_model"]


def load_route_model(
    route: str,
    checkpoint: Path,
    budget: float,
    choice: Mapping[str, int],
) -> tuple[torch.nn.Module, Any]:
    """``(plain model, its ModelConfig)`` a route produced for one size.

    elastic / prune_distil: the budget cut from an elastic checkpoint (``nested.model``);
    scratch: the plain checkpoint as trained; zero_shot: the importance-ordered teacher cut to
    ``choice`` with no training."""
    from elastic_plugin.nested.model import load_nested_model, nested_model

    if route in ("elastic", "prune_distil"):
        return load_nested_model(checkpoint, budget)
    model, cfg = load_nested_model(checkpoint)
    if route == "zero_shot":
        return nested_model(model, cfg, choice)
    return model, cfg


class Measure:
    """Validation loss and accuracy with the same data for every model."""

    def __init__(
        self,
        prepared_dir: str,
        valid_prefix: str,
        num_problems: int,
        batch_size: int,
        eval_sequences: int,
        seq_length: int,
        micro_batch_size: int = 16,
    ):
        from elastic_plugin.evaluation.problems import load_problems
        from elastic_plugin.export.tokens import token_windows

        self.problems = load_problems(prepared_dir, num_problems)
        self.tokens = token_windows(valid_prefix, eval_sequences, seq_length, "validation data")
        self.batch_size = batch_size
        self.micro_batch_size = micro_batch_size

    def __call__(self, name: str, model: torch.nn.Module, model_cfg: Any) -> dict[str, Any]:
        from elastic_plugin.evaluation.lm_loss import sequence_loss_sums
        from elastic_plugin.evaluation.settings import Setting, run_setting
        from elastic_plugin.models.counting import count_parameters

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny decode steps are dispatch-bound (as evaluate does)
        try:
            model.eval()
            sums = sequence_loss_sums(model, self.tokens, self.micro_batch_size)
            result = run_setting(
                Setting(name, 1.0, 1.0), {(1.0, "fp32"): model}, self.problems, self.batch_size, 0
            )
        finally:
            torch.set_num_threads(threads)
        counts = count_parameters(model_cfg)
        per_window = self.tokens.shape[1] - 1
        return {
            "valid_loss": sum(sums) / (len(sums) * per_window),
            "accuracy": result["accuracy"],
            # per problem / per window: what the report's paired sampling errors are made of
            "correct": [bool(c) for c in result["correct"]],
            "window_losses": [x / per_window for x in sums],
            "params": {"total": counts.total, "active": counts.active},
        }


def measure_all(
    items: list[tuple[dict[str, Any], Callable[[], tuple[torch.nn.Module, Any]]]],
    measure: Measure,
    log: Callable[[str], None],
) -> None:
    """Measure each ``(record, loader)`` into its record (``valid_loss``, ``accuracy``,
    ``params``), freeing each model before the next is loaded."""
    for i, (record, loader) in enumerate(items, 1):
        model, cfg = loader()
        record.update(measure(record["name"], model, cfg))
        del model
        log(
            f"measured {i}/{len(items)} {record['name']}: valid loss "
            f"{record['valid_loss']:.4f}, accuracy {100 * record['accuracy']:.1f}%"
        )
