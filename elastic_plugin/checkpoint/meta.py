"""The one reader and writer of a checkpoint's ``elastic_meta.json``; imports no torch.

Every checkpoint this plugin writes (teacher, reordered, elastic, extracted) is Megatron's dist
checkpoint plus ``elastic_meta.json``: the experiment config, the layout that wrote it, whether
its weights are importance-reordered and, for an elastic checkpoint, the trained budgets and the
choice table (budget label -> axis -> size). The command lines check their input before anything
heavy is loaded, through these functions, so a user gets the same message for the same mistake
everywhere; budgets are spelled (``budget_label``) and matched (``match_budget``) here only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elastic_plugin.models.config import ConfigError

__all__ = [
    "CHECKPOINT_META",
    "DIST_METADATA",
    "EXPORT_META",
    "ELASTIC_SUBDIR",
    "TEACHER_SUBDIR",
    "budget_label",
    "has_saves",
    "match_budget",
    "newest_readable_meta",
    "read_checkpoint_meta",
    "read_elastic_meta",
    "stored_choice",
    "stored_choices",
    "trained_budgets",
    "trained_listing",
    "write_checkpoint_meta",
]

CHECKPOINT_META = "elastic_meta.json"
EXPORT_META = "export_meta.json"  # our HF exports: what they were cut from, their files' digests
DIST_METADATA = "metadata.json"  # Megatron dist checkpoint's own index
ELASTIC_SUBDIR = ("checkpoints", "elastic")
TEACHER_SUBDIR = ("checkpoints", "teacher")  # `train`'s stage directory under --out
_ELASTIC_HINT = "the output of elastic-plugin elastic-train (OUT/checkpoints/elastic)"


def has_saves(stage: str | Path) -> bool:
    """Whether a stage directory holds a save (``iter_*``) or is an old single-directory one."""
    from elastic_plugin.checkpoint.history import iteration_dirs

    return bool(iteration_dirs(stage)) or (Path(stage) / CHECKPOINT_META).is_file()


def newest_readable_meta(stage: str | Path, flag: str = "--resume:") -> tuple[Path, dict[str, Any]]:
    """The newest save of ``stage`` whose metadata reads, and that metadata: the run's settings,
    to compare with a resuming command line before anything heavy (which save is resumed is
    decided after hashing, in training). A ConfigError naming ``flag`` when none reads."""
    from elastic_plugin.checkpoint.history import newest_verified

    stage = Path(stage)
    readable, skipped = newest_verified(stage, lambda path: read_checkpoint_meta(path, flag))
    if readable is None and (stage / CHECKPOINT_META).is_file():
        readable = stage  # a checkpoint written before history existed
    if readable is None:
        problems = "; ".join(why for _, why in skipped)
        raise ConfigError(f"{flag} no save of {stage} has readable metadata: {problems}")
    return readable, read_checkpoint_meta(readable, flag)


def read_checkpoint_meta(
    ckpt: str | Path, flag: str = "--ckpt", require_weights: bool = True
) -> dict[str, Any]:
    """The metadata of a complete checkpoint written by this plugin, or a ConfigError naming ``flag``.

    ``require_weights``: also insist on Megatron's dist-checkpoint index (an interrupted save
    leaves only ``<dir>.tmp``); commands that read metadata only can skip it. A stage
    directory with history (``checkpoint.history``) stands for its newest save."""
    from elastic_plugin.checkpoint.history import LATEST_FILE, resolve_checkpoint

    path = Path(ckpt)
    if not path.is_dir():
        raise ConfigError(f"{flag} {path}: no such checkpoint directory")
    try:
        path = resolve_checkpoint(path)
    except OSError as exc:
        raise ConfigError(
            f"{flag} {path}: its latest-save pointer is not readable ({exc})"
        ) from None
    if not (path / CHECKPOINT_META).is_file():
        nested = path.joinpath(*ELASTIC_SUBDIR)
        has_nested = (nested / CHECKPOINT_META).is_file() or (nested / LATEST_FILE).is_file()
        hint = f" (did you mean {flag} {nested}?)" if has_nested else ""
        raise ConfigError(f"{flag} {path}: not a complete checkpoint (no {CHECKPOINT_META}){hint}")
    if require_weights and not (path / DIST_METADATA).is_file():
        raise ConfigError(
            f"{flag} {path}: not a complete checkpoint (needs {CHECKPOINT_META} and "
            f"{DIST_METADATA}; an interrupted save leaves only {path.name}.tmp)"
        )
    try:
        meta = json.loads((path / CHECKPOINT_META).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"{flag} {path}: {CHECKPOINT_META} is not readable JSON ({exc})"
        ) from None
    if not isinstance(meta, Mapping) or not isinstance(meta.get("config"), Mapping):
        raise ConfigError(f"{flag} {path}: {CHECKPOINT_META} has no experiment config")
    return dict(meta)


def read_elastic_meta(
    ckpt: str | Path, flag: str = "--ckpt", require_weights: bool = True
) -> dict[str, Any]:
    """``read_checkpoint_meta`` of an elastic checkpoint: kind, budgets and the choice table."""
    meta = read_checkpoint_meta(ckpt, flag, require_weights)
    path = Path(ckpt)
    kind = meta.get("kind")
    if kind != "elastic":
        what = f"a {kind!r} checkpoint" if kind is not None else "a checkpoint without a 'kind'"
        raise ConfigError(
            f"{flag} {path}: kind={kind!r}, not an elastic checkpoint ({what}); "
            f"this needs {_ELASTIC_HINT}"
        )
    elastic = meta.get("elastic")
    if (
        not isinstance(elastic, Mapping)
        or not isinstance(elastic.get("choices"), Mapping)
        or not elastic["choices"]
        or not elastic.get("budgets")
        or not isinstance(meta["config"].get("elastic"), Mapping)
    ):
        raise ConfigError(
            f"{flag} {path}: {CHECKPOINT_META} lacks the elastic config or the "
            f"choice table (elastic.budgets / elastic.choices); this needs "
            f"{_ELASTIC_HINT}"
        )
    return meta


def write_checkpoint_meta(ckpt: str | Path, meta: Mapping[str, Any]) -> None:
    """Write ``elastic_meta.json`` into a checkpoint directory (values JSON cannot hold are
    written as their ``str``, as the readers expect)."""
    (Path(ckpt) / CHECKPOINT_META).write_text(json.dumps(dict(meta), indent=2, default=str))


# ------------------------------------------------------------------------------ budgets
_BUDGET_REL_TOL, _BUDGET_ABS_TOL = 1e-9, 1e-12


FULL_BUDGET = 1.0  # the parent itself: never routed, never shrunk (Megatron-LM samples it too)


def is_full_budget(budget: float) -> bool:
    """True for the budget that names the unmodified parent model."""
    return math.isclose(
        float(budget), FULL_BUDGET, rel_tol=_BUDGET_REL_TOL, abs_tol=_BUDGET_ABS_TOL
    )


def budget_label(budget: float) -> str:
    """A budget's one spelling (``0.77`` -> ``"0.77"``): its key in the choice table, in metrics
    files and in every report."""
    return f"{float(budget):g}"


def match_budget(budget: float, budgets: Sequence[float]) -> float | None:
    """The trained budget that ``budget`` names (equal up to float noise), or None."""
    return next(
        (
            float(b)
            for b in budgets
            if math.isclose(float(b), budget, rel_tol=_BUDGET_REL_TOL, abs_tol=_BUDGET_ABS_TOL)
        ),
        None,
    )


def trained_budgets(meta: Mapping[str, Any]) -> list[float]:
    """The budgets an elastic checkpoint's ``meta`` (from ``read_elastic_meta``) was trained for."""
    return [float(b) for b in meta["elastic"]["budgets"]]


def trained_listing(budgets: Sequence[float]) -> str:
    """``"1, 0.77, 0.4"``: the trained budgets as error messages list them."""
    return ", ".join(budget_label(b) for b in budgets)


def match_trained_budget(budget: Any, meta: Mapping[str, Any], flag: str = "--budget") -> float:
    """The trained budget of an elastic checkpoint's ``meta`` that ``budget`` names; else a
    ConfigError naming ``flag`` and the trained budgets (the one check of a requested budget
    for every command that loads a nested model)."""
    budgets = trained_budgets(meta)
    listing = trained_listing(budgets)
    if (
        isinstance(budget, bool)
        or not isinstance(budget, (int, float))
        or not math.isfinite(budget)
    ):
        raise ConfigError(f"{flag} {budget!r}: not a number; trained budgets: {listing}")
    match = match_budget(float(budget), budgets)
    if match is None:
        raise ConfigError(
            f"{flag} {budget_label(budget)} was not trained; trained budgets: {listing}"
        )
    return match


def stored_choices(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The choice table of an elastic checkpoint: budget label -> axis -> size (or per-layer
    sizes)."""
    return dict(meta["elastic"]["choices"])


def stored_choice(meta: Mapping[str, Any], budget: float, ckpt: str | Path) -> dict[str, Any]:
    """The stored choice of trained ``budget``; a ConfigError naming ``--ckpt`` if the table
    lacks it."""
    choice = meta["elastic"]["choices"].get(budget_label(budget))
    if not isinstance(choice, Mapping):
        raise ConfigError(f"--ckpt {ckpt}: no stored choice for budget {budget_label(budget)}")
    return dict(choice)
