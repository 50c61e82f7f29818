"""checkpoint.history: Megatron-LM's iter_NNNNNNN + latest_checkpointed_iteration.txt layout, the
pointer written atomically, pruning that never removes the newest, and the newest save that
verifies (training's fallback is tested end to end in test_elastic_multirank)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_plugin.checkpoint.history import (
    LATEST_FILE,
    iteration_dir,
    iteration_dirs,
    newest_verified,
    prune_history,
    resolve_checkpoint,
    run_dir,
    write_latest,
)
from elastic_plugin.checkpoint.meta import read_checkpoint_meta
from elastic_plugin.models.config import ConfigError


def _save(stage: Path, iteration: int) -> Path:
    """A published save with just enough files for read_checkpoint_meta."""
    path = iteration_dir(stage, iteration)
    path.mkdir(parents=True)
    (path / "elastic_meta.json").write_text(f'{{"config": {{}}, "iteration": {iteration}}}')
    (path / "metadata.json").write_text("{}")
    return path


def test_layout_pointer_and_resolution(tmp_path):
    stage = tmp_path / "run" / "checkpoints" / "elastic"
    assert iteration_dir(stage, 20).name == "iter_0000020"
    for it in (10, 20, 30):
        _save(stage, it)
    (stage / "iter_0000040.tmp").mkdir()  # an interrupted save is not a save
    assert [n for n, _ in iteration_dirs(stage)] == [30, 20, 10]
    assert resolve_checkpoint(stage) == stage  # no pointer yet: the directory itself
    write_latest(stage, 20)
    assert (stage / LATEST_FILE).read_text() == "20\n"
    assert not list(stage.glob(".*tmp"))  # the pointer was renamed into place
    assert resolve_checkpoint(stage) == stage / "iter_0000020"
    assert read_checkpoint_meta(stage)["iteration"] == 20  # every reader: the pointer's save
    assert resolve_checkpoint(stage / "iter_0000010") == stage / "iter_0000010"  # a given save
    assert run_dir(stage) == run_dir(stage / "iter_0000010") == tmp_path / "run"


def test_a_bad_pointer_is_named(tmp_path):
    stage = tmp_path / "elastic"
    _save(stage, 1)
    (stage / LATEST_FILE).write_text("two\n")
    with pytest.raises(ConfigError, match=r"'two' is not an iteration number"):
        resolve_checkpoint(stage)
    write_latest(stage, 7)
    with pytest.raises(ConfigError, match=r"names iteration 7, but .*iter_0000007 is missing; "
                       r"saves present: \['iter_0000001'\]"):  # fmt: skip
        read_checkpoint_meta(stage)


def test_prune_keeps_the_newest_and_never_the_pointed_save(tmp_path):
    stage = tmp_path / "elastic"
    for it in (1, 2, 3, 4):
        _save(stage, it)
    write_latest(stage, 4)
    removed = prune_history(stage, 2)
    assert sorted(p.name for p in removed) == ["iter_0000001", "iter_0000002"]
    assert [n for n, _ in iteration_dirs(stage)] == [4, 3]
    assert prune_history(stage, 0) == []  # 0 keeps everything
    _save(stage, 5)  # published, but the pointer has not moved to it yet
    write_latest(stage, 3)
    prune_history(stage, 1)
    assert [n for n, _ in iteration_dirs(stage)] == [5, 3]  # 3 is what readers use: kept


def test_newest_verified_skips_damaged_saves_with_the_reason(tmp_path):
    stage = tmp_path / "elastic"
    for it in (1, 2, 3):
        _save(stage, it)
    damaged = {"iter_0000003": "file x differs", "iter_0000002": "file y is truncated"}

    def verify(path: Path) -> None:
        if path.name in damaged:
            raise ConfigError(damaged[path.name])

    chosen, skipped = newest_verified(stage, verify)
    assert chosen == stage / "iter_0000001"
    assert [(p.name, why) for p, why in skipped] == list(damaged.items())
    damaged["iter_0000001"] = "file z is missing"
    assert newest_verified(stage, verify)[0] is None


def test_megatron_lm_reads_the_pointer_and_finds_the_save(tmp_path, monkeypatch):
    """The layout is Megatron-LM's own: its checkpointing module (shipped in our megatron-core
    wheel) reads our pointer and names the same save directory that resolve_checkpoint does."""
    import torch.distributed
    from megatron.training import checkpointing as mlm

    stage = tmp_path / "teacher"
    for it in (3, 12):
        _save(stage, it)
    write_latest(stage, 12)
    # read_metadata all-reduces on CUDA under a process group; this test reads as one process
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    iteration, release = mlm.read_metadata(mlm.get_checkpoint_tracker_filename(str(stage)))
    assert (iteration, release) == (12, False)
    found = mlm.get_checkpoint_name(str(stage), iteration, release, return_base_dir=True)
    assert Path(found) == resolve_checkpoint(stage) == stage / "iter_0000012"


def test_a_requested_budget_is_matched_to_a_trained_one_or_refused_naming_the_flag():
    """``match_trained_budget``: the one check ``generate`` and ``load_nested_model`` share."""
    from elastic_plugin.checkpoint.meta import match_trained_budget
    from elastic_plugin.models.config import ConfigError

    meta = {"elastic": {"budgets": [1.0, 0.77, 0.4]}}
    assert match_trained_budget(0.77, meta) == 0.77
    assert match_trained_budget(0.4 + 1e-12, meta, "--think-budget") == 0.4  # float noise
    assert match_trained_budget(1, meta) == 1.0
    with pytest.raises(
        ConfigError, match=r"^--answer-budget 0.5 was not trained; trained budgets: 1, 0.77, 0.4$"
    ):
        match_trained_budget(0.5, meta, "--answer-budget")
    for bad in (float("nan"), float("inf"), True, "0.4", None):
        with pytest.raises(
            ConfigError, match=r"^--budget .*: not a number; trained budgets: 1, 0.77, 0.4$"
        ):
            match_trained_budget(bad, meta)
