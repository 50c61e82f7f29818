"""Where the training loop's batches come from: the built-in reasoning task or a user's
Megatron indexed dataset, both read through Megatron-Core's ``GPTDataset`` builders."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_plugin.models.config import ConfigError, ExperimentConfig


@dataclass
class DataFeed:
    """Train/valid datasets plus how to iterate them for this data-parallel rank."""

    train_dataset: Any
    valid_dataset: Any
    micro_batch_size: int
    seed: int
    tokenizer_path: str
    vocab_size: int
    source: dict[str, Any]

    def train_iterator(self, consumed_samples: int = 0) -> Iterator[dict] | None:
        """This DP rank's micro-batches from global sample ``consumed_samples`` on (a resumed
        run continues where the save left off)."""
        from elastic_plugin.data.indexed import batch_iterator

        return batch_iterator(
            self.train_dataset,
            self.micro_batch_size,
            seed=self.seed,
            consumed_samples=consumed_samples,
        )

    def valid_iterator(self) -> Iterator[dict] | None:
        """A fresh pass over the validation split (same batches every evaluation)."""
        from elastic_plugin.data.indexed import batch_iterator

        return batch_iterator(
            self.valid_dataset, self.micro_batch_size, seed=self.seed, shuffle=False
        )

    def describe(self) -> dict[str, Any]:
        return dict(self.source)


def build_data_feed(
    cfg: ExperimentConfig,
    out_dir: str | Path,
    layout,
    *,
    data_path: str | None = None,
    valid_data_path: str | None = None,
    tokenizer_path: str | None = None,
    progress: bool = True,
) -> DataFeed:
    """Prepare (or open) the data and build Megatron GPT datasets sized for the run."""
    from elastic_plugin.data.indexed import build_gpt_datasets
    from elastic_plugin.data.jsonl import open_tokenizer
    from elastic_plugin.data.prepare import prepare_dataset

    t = cfg.training
    num_train_samples = t.train_iters * t.global_batch_size
    num_valid_samples = t.eval_iters * t.micro_batch_size
    if data_path is None:
        prepared = prepare_dataset(
            Path(out_dir) / "data",
            task=cfg.data.task,
            num_train=cfg.data.num_train,
            num_valid=cfg.data.num_valid,
            seed=cfg.data.seed,
            progress=progress,
        )
        tokenizer = prepared.load_tokenizer()
        datasets = build_gpt_datasets(
            tokenizer,
            t.seq_length,
            train_data_path=prepared.train_prefix,
            valid_data_path=prepared.valid_prefix,
            num_samples=(num_train_samples, num_valid_samples, None),
            seed=t.seed,
            is_built_on_rank=_builds_data,
        )
        tokenizer_file = prepared.tokenizer_path
        source = {"task": cfg.data.task, "prepared": prepared.out_dir}
    else:
        if tokenizer_path is None:
            raise ConfigError(
                f"data_path={data_path!r} needs tokenizer_path (the tokenizer.json of the data)"
            )
        tokenizer = open_tokenizer(tokenizer_path)  # EOS of an imported (Hub) tokenizer too
        datasets = build_gpt_datasets(
            tokenizer,
            t.seq_length,
            train_data_path=data_path,
            valid_data_path=valid_data_path or data_path,
            num_samples=(num_train_samples, num_valid_samples, None),
            seed=t.seed,
            is_built_on_rank=_builds_data,
        )
        tokenizer_file = tokenizer_path
        source = {"data_path": data_path, "valid_data_path": valid_data_path or data_path}
    return DataFeed(
        datasets.train,
        datasets.valid,
        t.micro_batch_size,
        t.seed,
        str(tokenizer_file),
        tokenizer.vocab_size,
        source,
    )


def _builds_data() -> bool:
    """Only pipeline stages that read tokens or labels (first and last) need the datasets."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return True
    return parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()
