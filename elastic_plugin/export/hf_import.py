"""``elastic-plugin import``: a Hugging Face model directory as a teacher checkpoint.

Users bring a pretrained model of a supported family (``elastic_plugin/families/``: Nemotron-H,
Llama, Qwen ...; what ``save_pretrained`` and the Hub write: sharded safetensors with an index)
and start ``importance`` / ``reorder`` / ``elastic-train`` from it as from a teacher we trained.
The import is the inverse of the family's exporter (the same renaming table, fused
``linear_qkv`` rows interleaved per query group, gate and up fused into ``linear_fc1``,
per-expert linears), so an import exported again gives the input bit for bit.

Everything is checked before a weight is read (:func:`plan_import`, torch- and Megatron-free):
``config.json`` (the family the registry picks from ``architectures``, then its mapping),
``--out``, the shard files (the index's names, each
file's safetensors header against its size, so a truncated shard is found without reading it),
and every tensor's name, dtype and shape against the model ``config.json`` describes. Then
:func:`run_import` builds our Megatron model at TP=PP=EP=1 in this process and copies the shards
into it one tensor at a time (peak memory: the model plus one memory-mapped shard), and saves it
with :func:`checkpoint.io.save_checkpoint` as a ``kind: teacher`` checkpoint. The whole output is
staged beside ``--out`` and renamed at the end, so a killed import leaves no complete-looking
``--out``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.history import IMPORT_ITERATION, iteration_dir
from elastic_plugin.data.token_rule import TOKENIZER_FILES as _RULE_FILES
from elastic_plugin.families import family_for_config
from elastic_plugin.families.base import Target
from elastic_plugin.models.config import ConfigError, ExperimentConfig, ModelConfig
from elastic_plugin.models.hf_config import HF_CONFIG_FILE, read_hf_config

__all__ = [
    "IMPORT_DTYPES",
    "TOKENIZER_DIR",
    "TOKENIZER_FILES",
    "HfSource",
    "ImportPlan",
    "check_hf_source",
    "check_import_out",
    "import_hf",
    "plan_import",
    "read_safetensors_header",
    "run_import",
]

IMPORT_DTYPES = ("fp32", "bf16")
TOKENIZER_DIR = "hf_tokenizer"  # inside the checkpoint directory
# the model's own tokenizer files (tokenizer.json, its config, chat template, generation config)
TOKENIZER_FILES = _RULE_FILES
_INDEX = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {"F32": 4, "BF16": 2, "F16": 2}  # floating tensors a model is made of
_MAX_HEADER = 100 * 2**20


@dataclasses.dataclass
class HfSource:
    """A checked Hugging Face directory: its config, files and every tensor's header entry."""

    path: Path
    config_json: dict[str, Any]
    model: ModelConfig
    files: list[Path]
    tensors: dict[str, tuple[Path, tuple[int, ...], str]]  # stored key -> (file, shape, dtype)
    table: dict[str, Target]
    zero_filled: list[str]  # Megatron keys no stored tensor sets (a conv bias NemotronH lacks)
    nbytes: int
    notes: list[str]
    architecture: str = "NemotronHForCausalLM"  # the family the registry picked


@dataclasses.dataclass
class ImportPlan:
    source: HfSource
    out: Path
    dtype: str


# ------------------------------------------------------------------------------ files
def read_safetensors_header(file: str | Path) -> dict[str, dict[str, Any]]:
    """The tensor entries of a safetensors file's header (no tensor data is read). A file whose
    size is not what its header says (a truncated or interrupted download) is refused."""
    file = Path(file)
    size = file.stat().st_size
    with file.open("rb") as fh:
        head = fh.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or length > min(size - 8, _MAX_HEADER):
            raise ConfigError(
                f"{file}: not a safetensors file (truncated or damaged header; {size} bytes)"
            )
        try:
            header = json.loads(fh.read(length))
        except ValueError as exc:
            raise ConfigError(f"{file}: damaged safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{file}: damaged safetensors header (not an object)")
    header.pop("__metadata__", None)
    end = 0
    for key, entry in header.items():
        try:
            start, stop = (int(x) for x in entry["data_offsets"])
            shape, dtype = [int(d) for d in entry["shape"]], str(entry["dtype"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{file}: damaged safetensors header entry {key!r}") from None
        width = _SAFETENSORS_DTYPES.get(dtype)
        if width is not None and stop - start != math.prod(shape) * width:
            raise ConfigError(f"{file}: {key!r} has {stop - start} bytes for shape {shape}")
        end = max(end, stop)
    if 8 + length + end != size:
        state = "truncated" if 8 + length + end > size else "longer than its header says"
        raise ConfigError(
            f"{file}: {state} ({size} bytes on disk, its header describes {8 + length + end}); "
            "download or copy it again"
        )
    return header


def _weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The shard files (the index's, or ``model.safetensors``) and the index's weight map."""
    from elastic_plugin.checkpoint.hub import hub_weight_files

    index = path / _INDEX
    files = hub_weight_files(path)  # names the index's missing file, or the missing weights
    if not index.is_file():
        return files, None
    weight_map = json.loads(index.read_text())["weight_map"]
    if not isinstance(weight_map, dict):
        raise ConfigError(f"{index}: weight_map must map tensor names to files")
    return files, weight_map


def _stored_tensors(
    files: list[Path], weight_map: Mapping[str, str] | None
) -> tuple[dict[str, tuple[Path, tuple[int, ...], str]], int]:
    tensors: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    nbytes = 0
    for file in files:
        header = read_safetensors_header(file)
        if weight_map is not None:
            listed = {k for k, f in weight_map.items() if f == file.name}
            if listed != set(header):
                raise ConfigError(
                    f"{file}: does not match {_INDEX} (missing {sorted(listed - set(header))[:3]}"
                    f", unlisted {sorted(set(header) - listed)[:3]})"
                )
        for key, entry in header.items():
            if key in tensors:
                raise ConfigError(f"{file}: {key!r} is also stored in {tensors[key][0].name}")
            tensors[key] = (file, tuple(int(d) for d in entry["shape"]), str(entry["dtype"]))
        nbytes += file.stat().st_size
    return tensors, nbytes


def _check_tensors(
    stored: Mapping[str, tuple[Path, tuple[int, ...], str]],
    table: Mapping[str, Target],
    model: ModelConfig,
    source: Path,
) -> None:
    """Every stored tensor has a place of the right shape and dtype, and every place a tensor."""
    unknown = sorted(set(stored) - set(table))
    if unknown:
        file = stored[unknown[0]][0]
        raise ConfigError(
            f"{file}: tensor(s) {unknown[:3]} have no place in the model {source / HF_CONFIG_FILE} "
            f"describes (layers {model.hybrid_layer_pattern!r}); {len(unknown)} unknown key(s)"
        )
    missing = [k for k in table if k not in stored]
    if missing:
        raise ConfigError(
            f"{source}: no shard holds {missing[0]!r} (shape {table[missing[0]].shape}), which "
            f"{HF_CONFIG_FILE} implies; {len(missing)} tensor(s) missing"
        )
    for key, (file, shape, dtype) in stored.items():
        target = table[key]
        if dtype not in _SAFETENSORS_DTYPES:
            raise ConfigError(
                f"{file}: {key!r} has dtype {dtype}; allowed: {', '.join(_SAFETENSORS_DTYPES)} "
                "(quantized checkpoints are not imported)"
            )
        if shape != target.shape:
            raise ConfigError(
                f"{file}: {key!r} has shape {list(shape)}, but {HF_CONFIG_FILE} implies "
                f"{list(target.shape)} (from {target.fields})"
            )


def check_hf_source(hf_dir: str | Path) -> HfSource:
    """Read and check a Hugging Face directory without reading any weight: the family first
    (an unsupported architecture is named before any other field), then its config mapping,
    the shard headers and every tensor against the family's import table."""
    path = Path(hf_dir)
    config_json = read_hf_config(path)
    source = str(path / HF_CONFIG_FILE)
    family = family_for_config(config_json, source)
    model = family.model_config(config_json, source)
    files, weight_map = _weight_files(path)
    stored, nbytes = _stored_tensors(files, weight_map)
    layout = family.import_layout(
        config_json, model, {k: shape for k, (_, shape, _) in stored.items()}, source
    )
    _check_tensors(stored, layout.table, layout.model, path)
    return HfSource(
        path,
        config_json,
        layout.model,
        files,
        stored,
        layout.table,
        layout.zero_filled,
        nbytes,
        layout.notes,
        family.architecture,
    )


def check_import_out(out: str | Path, hf_dir: str | Path | None = None) -> Path:
    """``--out``: absent, or an empty directory; never the input or inside it."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: already exists and is not empty; choose a new directory")
    if hf_dir is not None:
        src = Path(hf_dir).resolve()
        if out.resolve() == src or src in out.resolve().parents:
            raise ConfigError(f"--out {out}: must not be inside --hf {hf_dir}")
    return out


def plan_import(hf_dir: str | Path, out_dir: str | Path, dtype: str = "fp32") -> ImportPlan:
    """Every check of an import, before any weight is read or Megatron is imported."""
    if dtype not in IMPORT_DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: allowed: {', '.join(IMPORT_DTYPES)}")
    out = check_import_out(out_dir, hf_dir)
    return ImportPlan(check_hf_source(hf_dir), out, dtype)


# ------------------------------------------------------------------------------ weights
def _placer(target: Target, model: ModelConfig) -> Callable[[Any, Any], None]:
    """Copy a stored tensor into its (part of the) Megatron tensor, casting to its dtype:
    q/k/v rows of the fused ``linear_qkv`` (weight or bias, interleaved per query group), or
    the gate / up half of a gated ``linear_fc1``."""
    if target.part is None:
        return lambda dest, src: dest.copy_(src)
    if target.part in ("gate", "up"):
        half = 0 if target.part == "gate" else 1

        def place_half(dest, src):
            dest.view(2, -1, *dest.shape[1:])[half].copy_(src)

        return place_half
    groups, hd = model.query_groups, model.head_dim
    per_group = model.num_attention_heads // groups
    rows = {"q": slice(0, per_group), "k": slice(per_group, per_group + 1)}
    rows["v"] = slice(per_group + 1, per_group + 2)
    part = rows[target.part]

    def place(dest, src):
        blocks = dest.view(groups, per_group + 2, hd, *dest.shape[1:])
        blocks[:, part].copy_(src.reshape(groups, part.stop - part.start, hd, *src.shape[1:]))

    return place


def _check_model_state(state: Mapping[str, Any], source: HfSource) -> None:
    """The built model has exactly the tensors the table fills, in the table's sizes."""
    sizes: dict[str, int] = {}
    for target in source.table.values():
        sizes[target.megatron] = sizes.get(target.megatron, 0) + math.prod(target.shape)
    for key in source.zero_filled:
        sizes[key] = state[key].numel()
    wanted = {k for k in state if not k.endswith(("_extra_state", "local_tokens_per_expert"))}
    if set(sizes) != wanted or any(state[k].numel() != n for k, n in sizes.items()):
        odd = sorted(set(sizes) ^ wanted) or [k for k, n in sizes.items() if state[k].numel() != n]
        raise RuntimeError(f"import table and the built model disagree on {odd[:5]}")


def _copy_weights(state: Mapping[str, Any], source: HfSource, progress: bool) -> int:
    """Stream every shard into ``state`` one tensor at a time; returns the tensors copied."""
    import torch
    from safetensors import safe_open

    from elastic_plugin.parallel import is_rank0

    bar = None
    if progress and is_rank0():
        from elastic_plugin.data.progress import make_progress

        bar = make_progress(source.nbytes, "import", unit="B", unit_scale=True)
    placers = {k: _placer(t, source.model) for k, t in source.table.items()}
    copied = 0
    with torch.no_grad():
        for key in source.zero_filled:
            state[key].zero_()
        for file in source.files:
            with safe_open(str(file), framework="pt") as shard:
                for key in shard.keys():
                    placers[key](state[source.table[key].megatron], shard.get_tensor(key))
                    copied += 1
            if bar is not None:
                bar.update(file.stat().st_size)
    if bar is not None:
        bar.close()
    return copied


def _import_meta(plan: ImportPlan, tokenizer: Path | None) -> dict[str, Any]:
    from elastic_plugin.parallel import Layout

    src = plan.source
    config = ExperimentConfig(model=src.model).to_dict()
    return {
        "kind": "teacher",
        "imported_from": {
            "hf": str(src.path.resolve()),
            "architecture": src.architecture,
            "torch_dtype": src.config_json.get("torch_dtype", src.config_json.get("dtype")),
            "files": [f.name for f in src.files],
            "bytes": src.nbytes,
            "dtype": plan.dtype,
            "token_ids": {
                k: src.config_json.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            },
            "notes": src.notes,
        },
        "iteration": IMPORT_ITERATION,
        "layout": dataclasses.asdict(Layout()),
        "config": config,
        "tokenizer": str(tokenizer) if tokenizer else None,
    }


def _tokenizer_writer(source: Path, config_json: dict[str, Any]) -> Callable[[Path], None] | None:
    """What copies the source's tokenizer files into the checkpoint (before its digests are
    taken, so they are verified with the weights), or None when the source has none. A source
    without ``generation_config.json`` gets the one transformers derives from ``config.json``
    (its special token ids: what its ``generate`` stops at), so the tokenizer directory states
    the model's stop and pad ids as the source did (``data/token_rule.py``)."""
    files = [source / n for n in TOKENIZER_FILES if (source / n).is_file()]
    if not files:
        return None
    derived = {
        k: config_json[k]
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if config_json.get(k) is not None
    }

    def write(ckpt: Path) -> None:
        (ckpt / TOKENIZER_DIR).mkdir()
        for file in files:
            shutil.copyfile(file, ckpt / TOKENIZER_DIR / file.name)
        generation = ckpt / TOKENIZER_DIR / "generation_config.json"
        if not generation.is_file() and derived:
            payload = {"_from_model_config": True, **derived}
            generation.write_text(json.dumps(payload, indent=2) + "\n")

    return write


def run_import(plan: ImportPlan, progress: bool = True) -> dict[str, Any]:
    """Build the model at TP=PP=EP=1, stream the checked shards into it, save the teacher."""
    import torch

    from elastic_plugin.checkpoint.io import save_new_stage
    from elastic_plugin.cli_args import start_ranks
    from elastic_plugin.parallel import Layout, build_model_chunks

    start = time.perf_counter()
    src = plan.source
    final = plan.out.resolve()
    has_tokenizer = (src.path / "tokenizer.json").is_file()
    saved = iteration_dir(final, IMPORT_ITERATION)  # where the checkpoint lands
    tokenizer = saved / TOKENIZER_DIR / "tokenizer.json" if has_tokenizer else None
    start_ranks(Layout(), one_process="import runs as one process")
    dtype = torch.bfloat16 if plan.dtype == "bf16" else torch.float32
    chunks, _ = build_model_chunks(
        src.model, Layout(), params_dtype=dtype, wrap_ddp=False, perform_initialization=False
    )
    model = chunks[0]
    state = model.state_dict(keep_vars=True)
    _check_model_state(state, src)
    copied = _copy_weights(state, src, progress)
    save_new_stage(  # final was checked empty by plan_import
        [model],
        final,
        _import_meta(plan, tokenizer),
        iteration=IMPORT_ITERATION,
        extra_files=_tokenizer_writer(src.path, src.config_json),
    )
    params = sum(p.numel() for p in model.parameters())
    return {
        "out": str(final),
        "kind": "teacher",
        "hybrid_layer_pattern": src.model.hybrid_layer_pattern,
        "parameters": params,
        "tensors": copied,
        "files": len(src.files),
        "bytes_read": src.nbytes,
        "dtype": plan.dtype,
        "tokenizer": str(tokenizer) if tokenizer else None,
        "notes": src.notes,
        "seconds": round(time.perf_counter() - start, 3),
    }


def import_hf(
    hf_dir: str | Path, out_dir: str | Path, dtype: str = "fp32", progress: bool = True
) -> dict[str, Any]:
    """Import a Hugging Face directory of a supported family as a teacher checkpoint."""
    return run_import(plan_import(hf_dir, out_dir, dtype), progress)
