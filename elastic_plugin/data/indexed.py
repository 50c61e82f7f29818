"""Megatron indexed datasets (``.bin``/``.idx``) and Megatron-Core GPT dataset builders.

Why: training reads data exactly the way Megatron-LM does (``IndexedDataset`` ->
``GPTDataset`` via ``BlendedMegatronDatasetBuilder``), so a user can point the same code at
their own ``--data-path`` prefix(es) and ``tokenizer.json``; the demo only differs in how the
``.bin/.idx`` files were produced.

Megatron-Core facts this module relies on (0.19.2):

- ``GPTDataset`` packs documents back to back into ``sequence_length + 1`` token windows
  (a sample spans document boundaries; each document ends with ``eod``); only the last
  validation sample can be padded, with ``tokenizer.pad``.
- It rewrites pad ids to 0 in ``tokens``/``labels`` and zeroes their ``loss_mask``.
- Sample indices come from the C++ ``helpers_cpp`` module; the wheel ships it prebuilt but
  not the Makefile that ``compile_helpers()`` runs, so :func:`ensure_dataset_helpers`
  compiles ``helpers.cpp`` itself when the module is missing.
- Index caches go to ``path_to_cache`` (default ``<prefix>/cache/GPTDataset_indices``,
  a directory named after the prefix); under ``torch.distributed`` rank 0 builds them
  and the other ranks wait at a barrier, then load them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import struct
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple, cast

import numpy as np
import torch

from .progress import progress_bar
from .tokenizer import JsonTokenizer

_HELPERS_MODULE = "megatron.core.datasets.helpers_cpp"


# --------------------------------------------------------------------------- writing / reading


@dataclass(frozen=True)
class IndexedStats:
    """What was written to one ``.bin/.idx`` pair."""

    path_prefix: str
    num_documents: int
    num_tokens: int
    max_document_tokens: int
    dtype: str


def write_indexed_dataset(
    path_prefix: str | os.PathLike,
    documents: Iterable[Sequence[int] | np.ndarray],
    *,
    vocab_size: int,
    progress: bool = False,
    total: int | None = None,
) -> IndexedStats:
    """Write token-id documents as ``<prefix>.bin`` + ``<prefix>.idx`` (one sequence each).

    The token dtype is Megatron's choice for ``vocab_size`` (uint16 below 65500, else int32).
    """
    from megatron.core.datasets.indexed_dataset import (
        DType,
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    prefix = os.fspath(path_prefix)
    dtype = DType.optimal_dtype(vocab_size)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    num_docs = num_tokens = max_len = 0
    bar = progress_bar(total, f"write {os.path.basename(prefix)}", progress, unit="doc")
    try:
        for doc in documents:
            arr = np.asarray(doc, dtype=np.int64)
            if arr.ndim != 1 or arr.size == 0:
                raise ValueError(f"document {num_docs} must be a non-empty 1-D sequence of ids")
            if arr.min() < 0 or arr.max() >= vocab_size:
                raise ValueError(f"document {num_docs} has ids outside [0, {vocab_size})")
            builder.add_document(arr.astype(dtype), [arr.size])
            num_docs += 1
            num_tokens += arr.size
            max_len = max(max_len, arr.size)
            bar.update(1)
    finally:
        bar.close()
    if num_docs == 0:
        builder.data_file.close()
        os.remove(get_bin_path(prefix))
        raise ValueError("documents is empty; an indexed dataset needs at least one document")
    builder.finalize(get_idx_path(prefix))
    return IndexedStats(prefix, num_docs, num_tokens, max_len, np.dtype(dtype).name)


def write_text_documents(
    path_prefix: str | os.PathLike,
    texts: Sequence[str],
    tokenizer: JsonTokenizer,
    *,
    append_eod: bool = True,
    batch_size: int = 4096,
    progress: bool = False,
) -> IndexedStats:
    """Tokenize ``texts`` (each + ``<eod>``, as Megatron's preprocess_data does) and write them."""

    def docs() -> Iterator[list[int]]:
        for start in range(0, len(texts), batch_size):
            for ids in tokenizer.tokenize_batch(texts[start : start + batch_size]):
                yield ids + [tokenizer.eod] if append_eod else ids

    return write_indexed_dataset(
        path_prefix, docs(), vocab_size=tokenizer.vocab_size, progress=progress, total=len(texts)
    )


def read_indexed_documents(path_prefix: str | os.PathLike) -> list[np.ndarray]:
    """All documents of an indexed dataset, as arrays (for checks and small data)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = _check_prefix(os.fspath(path_prefix))
    ds = IndexedDataset(prefix)
    return [np.array(ds[i]) for i in range(len(ds))]


# --------------------------------------------------------------------------- C++ helpers


def ensure_dataset_helpers(build_dir: str | os.PathLike | None = None) -> ModuleType:
    """Return Megatron's ``helpers_cpp`` module, compiling ``helpers.cpp`` if the wheel lacks it.

    Compiles with g++ and the pybind11 headers shipped inside torch, into ``build_dir``
    (default ``~/.cache/elastic_plugin/megatron_helpers/<hash>``), under a file lock so
    concurrent ranks compile once per machine; no collective call, so any rank may call it.
    """
    try:
        import megatron.core.datasets.helpers_cpp as mod

        return mod
    except ImportError:
        pass
    return _load_module(compile_dataset_helpers(build_dir))


def compile_dataset_helpers(build_dir: str | os.PathLike | None = None) -> str:
    """Compile Megatron's ``helpers.cpp`` into ``build_dir``; returns the shared-object path."""
    import megatron.core.datasets as mds

    source = os.path.join(os.path.dirname(mds.__file__), "helpers.cpp")
    if not os.path.isfile(source):
        raise RuntimeError(f"Megatron-Core's helpers.cpp is missing at {source}")
    with open(source, "rb") as fh:
        key = hashlib.sha256(fh.read() + sys.version.encode()).hexdigest()[:16]
    if build_dir is None:
        build_dir = os.path.join(
            os.path.expanduser("~"), ".cache", "elastic_plugin", "megatron_helpers", key
        )
    build_dir = os.fspath(build_dir)
    os.makedirs(build_dir, exist_ok=True)
    target = os.path.join(build_dir, "helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))
    with open(os.path.join(build_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(target):
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=build_dir)
            os.close(fd)
            cmd = [
                os.environ.get("CXX", "g++"),
                "-O3",
                "-shared",
                "-std=c++17",
                "-fPIC",
                f"-I{_pybind11_include()}",
                f"-I{sysconfig.get_paths()['include']}",
                source,
                "-o",
                tmp,
            ]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                os.remove(tmp)
                raise RuntimeError(
                    f"compiling Megatron's helpers.cpp failed:\n{' '.join(cmd)}\n{result.stderr}"
                )
            os.replace(tmp, target)
    return target


def _pybind11_include() -> str:
    try:
        import pybind11

        return pybind11.get_include()
    except ImportError as exc:
        path = os.path.join(os.path.dirname(torch.__file__), "include")
        if not os.path.isfile(os.path.join(path, "pybind11", "pybind11.h")):
            raise RuntimeError(
                "no pybind11 headers found (neither the pybind11 package nor torch's copy)"
            ) from exc
        return path


def _load_module(path: str) -> ModuleType:
    """Load the compiled module and register it where Megatron imports it from.

    Loaded under a private name first: CPython hands back an already-loaded extension module
    of the same name instead of initialising the new file.
    """
    import megatron.core.datasets as mds

    spec = importlib.util.spec_from_file_location(
        "_elastic_plugin_megatron_helpers.helpers_cpp", path
    )
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load Megatron-Core's compiled helpers from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_HELPERS_MODULE] = module
    mds.helpers_cpp = module
    return module


# --------------------------------------------------------------------------- GPT datasets


class GPTDatasets(NamedTuple):
    """Train/valid/test splits (a split is None when not requested or not built on this rank)."""

    train: Any
    valid: Any
    test: Any


def build_gpt_datasets(
    tokenizer: JsonTokenizer,
    sequence_length: int,
    *,
    data_path: str | Sequence[str] | None = None,
    split: str = "969,30,1",
    train_data_path: str | Sequence[str] | None = None,
    valid_data_path: str | Sequence[str] | None = None,
    test_data_path: str | Sequence[str] | None = None,
    num_samples: Sequence[int | None] = (None, None, None),
    seed: int = 1234,
    path_to_cache: str | os.PathLike | None = None,
    is_built_on_rank: Callable[[], bool] | None = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = True,
    drop_last_partial_validation_sequence: bool = True,
    **config_kwargs: Any,
) -> GPTDatasets:
    """Megatron-Core ``GPTDataset`` splits from indexed-dataset prefixes.

    Either ``data_path`` (Megatron's ``--data-path``: one prefix, a list, or ``"w1 p1 w2 p2"``)
    split by ``split``, or per-split ``train/valid/test_data_path``. ``num_samples`` per split:
    None = one pass over the data, an int = at least that many samples (more epochs if needed).
    ``is_built_on_rank`` (default: every rank) is Megatron's hook for ranks that need no data.
    Call on every rank when ``torch.distributed`` is initialised (it holds barriers).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if not isinstance(tokenizer, JsonTokenizer) and not hasattr(tokenizer, "eod"):
        raise TypeError(
            f"tokenizer must be a JsonTokenizer (or Megatron tokenizer), got {type(tokenizer).__name__}"
        )
    if not isinstance(sequence_length, int) or sequence_length <= 0:
        raise ValueError(f"sequence_length must be a positive int, got {sequence_length!r}")
    sizes = list(num_samples)
    if len(sizes) != 3 or any(s is not None and (not isinstance(s, int) or s <= 0) for s in sizes):
        raise ValueError(
            f"num_samples must be 3 entries (train, valid, test), each None or > 0, got {num_samples!r}"
        )
    per_split = [train_data_path, valid_data_path, test_data_path]
    if data_path is not None and any(p is not None for p in per_split):
        raise ValueError(
            "give either data_path (with split) or train/valid/test_data_path, not both"
        )
    if data_path is None and all(p is None for p in per_split):
        raise ValueError("no data: give data_path or at least one of train/valid/test_data_path")

    blend_kwargs: dict[str, Any]
    if data_path is not None:
        blend_kwargs = {"blend": _blend(data_path, "data_path"), "split": split}
    else:
        names = ("train_data_path", "valid_data_path", "test_data_path")
        blend_kwargs = {
            "blend_per_split": [
                None if p is None else _blend(p, n) for p, n in zip(per_split, names)
            ]
        }
        sizes = [s if p is not None else None for s, p in zip(sizes, per_split)]

    ensure_dataset_helpers()
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=sequence_length,
        tokenizer=tokenizer,
        path_to_cache=None if path_to_cache is None else os.fspath(path_to_cache),
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        drop_last_partial_validation_sequence=drop_last_partial_validation_sequence,
        **blend_kwargs,
        **config_kwargs,
    )
    builder = BlendedMegatronDatasetBuilder(
        GPTDataset, sizes, is_built_on_rank or (lambda: True), config
    )
    return GPTDatasets(*builder.build())


def _blend(paths: str | Sequence[str], name: str) -> tuple[list[str], list[float] | None]:
    from megatron.core.datasets.utils import get_blend_from_list

    items = paths.split() if isinstance(paths, str) else [os.fspath(p) for p in paths]
    if not items:
        raise ValueError(f"{name} is empty")
    try:
        prefixes, weights = get_blend_from_list(items)
    except (AssertionError, ValueError) as err:
        raise ValueError(
            f"{name} must be prefixes or 'weight prefix' pairs, got {items!r} ({err})"
        ) from None
    for prefix in prefixes:
        _check_prefix(prefix, name)
    return prefixes, weights


class IndexedDatasetError(ValueError):
    """An indexed dataset's ``.idx`` / ``.bin`` pair is malformed (names the file)."""


# Megatron's .idx: header, version <Q, dtype code <B, sequence count <Q, document count <Q
_INDEX_HEADER = b"MMIDIDX\x00\x00"  # Megatron's .idx magic
_IDX_FIXED = struct.Struct("<9sQBQQ")
_DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # Megatron's DType codes


def _check_prefix(prefix: str, name: str = "path_prefix") -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if not IndexedDataset.exists(prefix):
        raise ValueError(
            f"{name}: no indexed dataset at prefix {prefix!r} (expected {prefix}.bin and {prefix}.idx)"
        )
    check_indexed_files(prefix, name)
    return prefix


def check_indexed_files(prefix: str, name: str = "path_prefix") -> None:
    """The ``.idx`` header and tables agree with each other and with the ``.bin`` size, or an
    :class:`IndexedDatasetError` naming the file: Megatron's reader only asserts the magic and
    version, and a truncated or damaged index would otherwise fail deep inside it (or read
    past the end of the ``.bin``)."""
    idx, bin_ = f"{prefix}.idx", f"{prefix}.bin"
    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(_IDX_FIXED.size)
    if len(head) < _IDX_FIXED.size:
        raise IndexedDatasetError(f"{name}: {idx} is truncated ({size} bytes, no full header)")
    magic, version, code, sequences, documents = _IDX_FIXED.unpack(head)
    if magic != _INDEX_HEADER or version != 1 or code not in _DTYPE_SIZES:
        raise IndexedDatasetError(
            f"{name}: {idx} is not a Megatron indexed dataset index (header {magic!r}, version "
            f"{version}, dtype code {code})"
        )
    need = _IDX_FIXED.size + 12 * sequences + 8 * documents
    if need > size:
        raise IndexedDatasetError(
            f"{name}: {idx} declares {sequences} sequences and {documents} documents "
            f"({need} bytes), but holds {size} bytes"
        )
    table = np.memmap(idx, mode="r", dtype=np.uint8)
    start = _IDX_FIXED.size
    lengths = np.frombuffer(table, np.int32, sequences, start)
    pointers = np.frombuffer(table, np.int64, sequences, start + 4 * sequences)
    docs = np.frombuffer(table, np.int64, documents, start + 12 * sequences)
    item = _DTYPE_SIZES[code]
    expected = np.concatenate(([0], np.cumsum(lengths.astype(np.int64))[:-1])) * item
    if sequences and ((lengths < 0).any() or not np.array_equal(pointers, expected[:sequences])):
        raise IndexedDatasetError(f"{name}: {idx}: its sequence lengths and offsets disagree")
    if documents and (docs[0] != 0 or docs[-1] != sequences or (np.diff(docs) < 0).any()):
        raise IndexedDatasetError(f"{name}: {idx}: its document table is not in order")
    tokens = int(lengths.astype(np.int64).sum()) * item
    if tokens > os.path.getsize(bin_):
        raise IndexedDatasetError(
            f"{name}: {bin_} holds {os.path.getsize(bin_)} bytes; its index needs {tokens}"
        )


# --------------------------------------------------------------------------- batches


class MicroBatchSampler(torch.utils.data.Sampler):
    """Index lists of one micro batch for one data-parallel rank.

    Like Megatron-LM's pretraining sampler (rank ``r`` takes slice ``r`` of each global micro
    batch of ``micro_batch_size * data_parallel_size`` samples, partial tails dropped, resumable
    from ``consumed_samples``), plus an optional per-epoch reshuffle from ``seed``.
    """

    def __init__(
        self,
        num_samples: int,
        micro_batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        infinite: bool = True,
        consumed_samples: int = 0,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
    ) -> None:
        for name, value, low in (
            ("micro_batch_size", micro_batch_size, 1),
            ("data_parallel_size", data_parallel_size, 1),
            ("consumed_samples", consumed_samples, 0),
            ("data_parallel_rank", data_parallel_rank, 0),
        ):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if data_parallel_rank >= data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank} must be < data_parallel_size {data_parallel_size}"
            )
        self.global_batch = micro_batch_size * data_parallel_size
        self.per_epoch = (num_samples // self.global_batch) * self.global_batch
        if self.per_epoch == 0:
            raise ValueError(
                f"dataset has {num_samples} samples, fewer than one global micro batch "
                f"(micro_batch_size {micro_batch_size} x data_parallel_size {data_parallel_size})"
            )
        self.num_samples = num_samples
        self.micro_batch_size = micro_batch_size
        self.seed, self.shuffle, self.infinite = seed, shuffle, infinite
        self.consumed_samples = consumed_samples
        self.rank = data_parallel_rank

    def __len__(self) -> int:
        if self.infinite:
            raise TypeError("an infinite MicroBatchSampler has no length")
        return (self.per_epoch - self.consumed_samples % self.per_epoch) // self.global_batch

    def __iter__(self) -> Iterator[list[int]]:
        epoch, offset = divmod(self.consumed_samples, self.per_epoch)
        lo, hi = self.rank * self.micro_batch_size, (self.rank + 1) * self.micro_batch_size
        while True:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                order = torch.randperm(self.num_samples, generator=gen).tolist()
            else:
                order = list(range(self.num_samples))
            for start in range(
                offset - offset % self.global_batch, self.per_epoch, self.global_batch
            ):
                yield order[start + lo : start + hi]
            if not self.infinite:
                return
            epoch, offset = epoch + 1, 0


def batch_iterator(
    dataset: torch.utils.data.Dataset | None,
    micro_batch_size: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    infinite: bool = True,
    consumed_samples: int = 0,
    data_parallel_rank: int | None = None,
    data_parallel_size: int | None = None,
    num_workers: int = 0,
) -> Iterator[dict[str, torch.Tensor | None]] | None:
    """Megatron-format micro batches for ``get_forward_backward_func(data_iterator=...)``.

    Yields dicts: ``tokens``/``labels``/``position_ids`` [b, s] int64, ``loss_mask`` [b, s]
    float32, ``attention_mask`` [b, 1, s, s] bool (True = masked) or None when the dataset was
    built with ``create_attention_mask=False``. Data-parallel rank/size default to Megatron's
    ``parallel_state`` when initialised, else 0/1. Returns None for a None dataset (a rank that
    does not build data), as Megatron-LM's loader does.
    """
    if dataset is None:
        return None
    if data_parallel_rank is None or data_parallel_size is None:
        rank, size = _data_parallel_defaults()
        data_parallel_rank = rank if data_parallel_rank is None else data_parallel_rank
        data_parallel_size = size if data_parallel_size is None else data_parallel_size
    sampler = MicroBatchSampler(
        len(cast(Sized, dataset)),  # a map-style dataset with a length (Megatron's GPTDataset)
        micro_batch_size,
        seed=seed,
        shuffle=shuffle,
        infinite=infinite,
        consumed_samples=consumed_samples,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
    )
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, persistent_workers=num_workers > 0
    )
    return _with_attention_mask_key(iter(loader))


def _with_attention_mask_key(
    it: Iterator[dict[str, torch.Tensor | None]],
) -> Iterator[dict[str, torch.Tensor | None]]:
    for batch in it:
        batch.setdefault("attention_mask", None)
        yield batch


def _data_parallel_defaults() -> tuple[int, int]:
    with contextlib.suppress(Exception):
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return (
                parallel_state.get_data_parallel_rank(),
                parallel_state.get_data_parallel_world_size(),
            )
    return 0, 1
