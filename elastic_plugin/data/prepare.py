"""One call from settings to training-ready files: problems -> tokenizer -> indexed datasets.

Why: the demo, the tests and a user's first run all need the same artefacts; writing them
once into a directory (cached by settings, completed atomically) makes every later step a
cheap load.

Directory layout (``out_dir``)::

    tokenizer.json                 tokenizers' JSON (load with JsonTokenizer.from_file)
    train_text_document.{bin,idx}  Megatron indexed dataset: each example + <eod>
    valid_text_document.{bin,idx}  the held-out examples, same format (validation loss)
    heldout.jsonl                  held-out examples with reasoning-gym entries (accuracy)
    meta.json                      settings (the cache key) and statistics
    cache/                         created later by Megatron-Core for its sample indices
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

from .indexed import GPTDatasets, build_gpt_datasets, write_text_documents
from .tasks import Example, generate_splits, get_task, resolve_task_kwargs
from .tokenizer import JsonTokenizer, train_tokenizer

FORMAT_VERSION = 1
TOKENIZER_FILE = "tokenizer.json"
TRAIN_PREFIX = "train_text_document"
VALID_PREFIX = "valid_text_document"
HELDOUT_FILE = "heldout.jsonl"
META_FILE = "meta.json"
_OUTPUT_FILES = (
    TOKENIZER_FILE,
    f"{TRAIN_PREFIX}.bin",
    f"{TRAIN_PREFIX}.idx",
    f"{VALID_PREFIX}.bin",
    f"{VALID_PREFIX}.idx",
    HELDOUT_FILE,
    META_FILE,
)


@dataclass(frozen=True)
class PreparedData:
    """Paths and metadata of a prepared data directory."""

    out_dir: str
    meta: Mapping[str, Any] = field(repr=False)
    reused: bool = False

    @property
    def tokenizer_path(self) -> str:
        return os.path.join(self.out_dir, TOKENIZER_FILE)

    @property
    def train_prefix(self) -> str:
        return os.path.join(self.out_dir, TRAIN_PREFIX)

    @property
    def valid_prefix(self) -> str:
        return os.path.join(self.out_dir, VALID_PREFIX)

    @property
    def heldout_path(self) -> str:
        return os.path.join(self.out_dir, HELDOUT_FILE)

    @property
    def meta_path(self) -> str:
        return os.path.join(self.out_dir, META_FILE)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def load_tokenizer(self) -> JsonTokenizer:
        return JsonTokenizer.from_file(self.tokenizer_path)

    def load_heldout(self) -> list[Example]:
        """Held-out examples, scorable with ``tasks.score``."""
        with open(self.heldout_path) as fh:
            return [Example.from_record(json.loads(line)) for line in fh if line.strip()]

    def build_datasets(self, sequence_length: int, **kwargs: Any) -> GPTDatasets:
        """GPTDataset train/valid splits over this directory (test is None).

        ``kwargs`` go to :func:`build_gpt_datasets` (num_samples, seed, is_built_on_rank, ...);
        the index cache defaults to ``<out_dir>/cache``.
        """
        kwargs.setdefault("path_to_cache", os.path.join(self.out_dir, "cache"))
        return build_gpt_datasets(
            self.load_tokenizer(),
            sequence_length,
            train_data_path=self.train_prefix,
            valid_data_path=self.valid_prefix,
            **kwargs,
        )

    @classmethod
    def load(cls, out_dir: str | os.PathLike) -> PreparedData:
        """Open a directory written by :func:`prepare_dataset`."""
        out_dir = os.path.abspath(os.fspath(out_dir))
        meta = _read_meta(out_dir)
        if meta is None or not _complete(out_dir):
            raise ValueError(
                f"{out_dir} is not a complete prepared data directory (see prepare_dataset)"
            )
        return cls(out_dir, meta, reused=True)


def prepare_dataset(
    out_dir: str | os.PathLike,
    task: str = "chain_sum",
    num_train: int = 50_000,
    num_valid: int = 500,
    seed: int = 1234,
    *,
    heldout_seed: int | None = None,
    task_kwargs: Mapping[str, Any] | None = None,
    vocab_size: int | None = None,
    force: bool = False,
    progress: bool = True,
) -> PreparedData:
    """Generate, tokenize and write the demo data into ``out_dir`` (see module docstring).

    Reuses ``out_dir`` when it holds a complete result for the same settings (unless
    ``force``). Writes into a temporary sibling directory renamed into place at the end, so an
    interrupted run leaves nothing that looks complete. When ``torch.distributed`` is
    initialised this is collective: rank 0 writes (``out_dir`` must be on a shared file
    system), the others wait and open the result.
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    get_task(task)
    for name, value in (("num_train", num_train), ("num_valid", num_valid), ("seed", seed)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    for name, value in (("num_train", num_train), ("num_valid", num_valid)):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size <= 0):
        raise ValueError(
            f"vocab_size must be None (character-level) or a positive int, got {vocab_size!r}"
        )
    heldout_seed = seed + 1 if heldout_seed is None else heldout_seed
    settings = {
        "format_version": FORMAT_VERSION,
        "task": task,
        "task_kwargs": resolve_task_kwargs(task, task_kwargs),
        "num_train": num_train,
        "num_valid": num_valid,
        "seed": seed,
        "heldout_seed": heldout_seed,
        "vocab_size_request": vocab_size,
        "reasoning_gym_version": version("reasoning-gym"),
    }

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        error: list[str | None] = [None]
        local = None
        if dist.get_rank() == 0:
            try:
                local = _prepare_on_this_rank(out_dir, settings, force, progress)
            except Exception as err:  # shared with the other ranks, then re-raised
                error = [f"{type(err).__name__}: {err}"]
                dist.broadcast_object_list(error, src=0)
                raise
        dist.broadcast_object_list(error, src=0)
        if error[0] is not None:
            raise RuntimeError(f"prepare_dataset failed on rank 0: {error[0]}")
        return local if local is not None else PreparedData.load(out_dir)
    return _prepare_on_this_rank(out_dir, settings, force, progress)


def _prepare_on_this_rank(
    out_dir: str, settings: dict[str, Any], force: bool, progress: bool
) -> PreparedData:
    meta = _read_meta(out_dir)
    if not force and meta is not None and meta.get("settings") == settings and _complete(out_dir):
        return PreparedData(out_dir, meta, reused=True)
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise ValueError(f"out_dir {out_dir} exists and is not a directory")
        if os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, META_FILE)):
            raise ValueError(
                f"out_dir {out_dir} is a non-empty directory that is not prepared data; "
                "refusing to overwrite it (choose another out_dir)"
            )
    parent, name = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        meta = _write_all(tmp, settings, progress)
        _swap_in(tmp, out_dir)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return PreparedData(out_dir, meta, reused=False)


def _write_all(directory: str, settings: dict[str, Any], progress: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    train, heldout, info = generate_splits(
        settings["task"],
        settings["num_train"],
        settings["num_valid"],
        settings["seed"],
        settings["heldout_seed"],
        task_kwargs=settings["task_kwargs"],
        progress=progress,
    )
    t_gen = time.perf_counter() - t0
    train_texts = [ex.text for ex in train]
    tokenizer = train_tokenizer(train_texts, settings["vocab_size_request"])
    tokenizer.save(os.path.join(directory, TOKENIZER_FILE))
    t1 = time.perf_counter()
    train_stats = write_text_documents(
        os.path.join(directory, TRAIN_PREFIX), train_texts, tokenizer, progress=progress
    )
    valid_stats = write_text_documents(
        os.path.join(directory, VALID_PREFIX),
        [ex.text for ex in heldout],
        tokenizer,
        progress=progress,
    )
    t_write = time.perf_counter() - t1
    with open(os.path.join(directory, HELDOUT_FILE), "w") as fh:
        for i, ex in enumerate(heldout):
            fh.write(json.dumps({"index": i, **ex.to_record()}) + "\n")
    meta = {
        "settings": settings,
        "task": settings["task"],
        "counts": {"train": train_stats.num_documents, "valid": valid_stats.num_documents},
        "seeds": {"train": info["seed"], "heldout": info["heldout_seed"]},
        "overlaps_removed": info["overlaps_removed"],
        "vocab_size": tokenizer.vocab_size,
        "padded_vocab_size_128": tokenizer.padded_vocab_size(128),
        "special_tokens": tokenizer.special_tokens_dict,
        "tokens": {
            "train": train_stats.num_tokens,
            "valid": valid_stats.num_tokens,
            "per_example_mean": round(train_stats.num_tokens / train_stats.num_documents, 3),
            "per_example_max": max(
                train_stats.max_document_tokens, valid_stats.max_document_tokens
            ),
            "dtype": train_stats.dtype,
        },
        "timing_s": {"generate": round(t_gen, 3), "tokenize_write": round(t_write, 3)},
        "examples_per_s": round((len(train) + len(heldout)) / max(t_gen, 1e-9)),
        "files": {
            "tokenizer": TOKENIZER_FILE,
            "train_prefix": TRAIN_PREFIX,
            "valid_prefix": VALID_PREFIX,
            "heldout": HELDOUT_FILE,
        },
    }
    with open(os.path.join(directory, META_FILE), "w") as fh:  # written last
        json.dump(meta, fh, indent=2)
    return meta


def _swap_in(tmp: str, out_dir: str) -> None:
    """Replace ``out_dir`` by ``tmp`` with renames (the old one, if any, is removed after)."""
    old = None
    if os.path.exists(out_dir):
        old = f"{tmp}.old"
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _read_meta(out_dir: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(out_dir, META_FILE)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _complete(out_dir: str) -> bool:
    return all(os.path.isfile(os.path.join(out_dir, f)) for f in _OUTPUT_FILES)
