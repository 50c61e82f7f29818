"""The Hugging Face Hub's Nemotron-H files: its key layout, both ways, and sharded safetensors.

``transformers`` holds a ``NemotronHForCausalLM`` in memory as ``model.*``, with the routed
experts of an MoE layer stacked into one 3-D ``mixer.experts.up_proj`` / ``down_proj``. The
released Nemotron-H / Nemotron-3 checkpoints, transformers' own ``save_pretrained`` and the tools
that read them (vLLM, TensorRT-LLM, SGLang, Megatron-Bridge) store ``backbone.*`` instead, with
one ``mixer.experts.{e}.up_proj.weight`` per expert. ``to_hub`` / ``from_hub`` convert between the
two (quantized experts are per expert in both, each with its own scales), so every export is
written, and every Hub directory is read, in one place.

Files follow ``save_pretrained``: one ``model.safetensors`` when everything fits one shard, else
``model-0000i-of-0000N.safetensors`` (tensors in key order, a new shard whenever the next tensor
would pass ``max_shard_bytes``) plus ``model.safetensors.index.json`` (``metadata.total_size``,
``weight_map``: key -> file). ``read_hub_tensors`` reads either form shard by shard and names
the file for anything missing or contradictory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from elastic_plugin.checkpoint.meta import EXPORT_META
from elastic_plugin.models.config import ConfigError

if TYPE_CHECKING:  # the export command's parser reads this module's constants: no torch there
    import torch

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "EXPORT_META",
    "HUB_INDEX",
    "HUB_PREFIX",
    "HUB_WEIGHTS",
    "MEMORY_PREFIX",
    "from_hub",
    "hub_name",
    "hub_weight_files",
    "memory_name",
    "iter_hub_shards",
    "parse_shard_size",
    "read_hub_tensors",
    "to_hub",
    "verify_export_files",
    "write_hub_shards",
]

HUB_PREFIX = "backbone."  # the released checkpoints' (and save_pretrained's) prefix
MEMORY_PREFIX = "model."  # transformers' in-memory module path
HUB_WEIGHTS = "model.safetensors"
HUB_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default "5GB"
_SHARD = "model-{index:05d}-of-{count:05d}.safetensors"
_STACKED = re.compile(r"^(?P<head>.*\.mixer\.experts)\.(?P<proj>up_proj|down_proj)$")
_PER_EXPERT = re.compile(
    r"^(?P<head>.*\.mixer\.experts)\.(?P<e>\d+)\.(?P<proj>up_proj|down_proj)\.(?P<leaf>\w+)$"
)
_UNITS = {
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "B": 1,
}


# ------------------------------------------------------------------------------ key layout
def to_hub(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory NemotronH names -> the Hub's: ``model.`` becomes ``backbone.``
    and each stacked expert tensor becomes one ``experts.{e}.{proj}.weight`` per expert (a view
    of the stack, no copy). Keys already in the Hub's form pass through."""
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        name = HUB_PREFIX + key[len(MEMORY_PREFIX) :] if key.startswith(MEMORY_PREFIX) else key
        stacked = _STACKED.match(name)
        if stacked is None:
            _put(out, name, value)
            continue
        if value.dim() != 3:
            raise ConfigError(
                f"{key}: stacked experts must be [experts, out, in]; got {tuple(value.shape)}"
            )
        for e in range(value.shape[0]):
            _put(out, f"{stacked['head']}.{e}.{stacked['proj']}.weight", value[e])
    return out


def from_hub(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Hub's names -> transformers' in-memory ones: the inverse of :func:`to_hub`.
    Unquantized per-expert weights are stacked again (experts 0..E-1, one shape); quantized
    experts (a ``weight_scale`` beside the weight) stay per expert, as the quantized model
    holds them."""
    renamed = {
        (MEMORY_PREFIX + k[len(HUB_PREFIX) :] if k.startswith(HUB_PREFIX) else k): v
        for k, v in tensors.items()
    }
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for key in renamed:
        match = _PER_EXPERT.match(key)
        if match is not None and match["leaf"] == "weight":
            scale = f"{match['head']}.{match['e']}.{match['proj']}.weight_scale"
            if scale not in renamed:
                groups.setdefault((match["head"], match["proj"]), {})[int(match["e"])] = key
    out = dict(renamed)
    for (head, proj), members in groups.items():
        if sorted(members) != list(range(len(members))):
            raise ConfigError(
                f"{head}.*.{proj}.weight: experts {sorted(members)} are not 0..{len(members) - 1}"
            )
        parts = [out.pop(members[e]) for e in range(len(members))]
        shapes = {tuple(p.shape) for p in parts}
        if len(shapes) != 1:
            raise ConfigError(
                f"{head}.*.{proj}.weight: experts of different shapes {sorted(shapes)}"
            )
        import torch

        out[f"{head}.{proj}"] = torch.stack(parts)
    return out


def hub_name(name: str) -> str:
    """A module or tensor name in the Hub's form (``model.`` -> ``backbone.``)."""
    return HUB_PREFIX + name[len(MEMORY_PREFIX) :] if name.startswith(MEMORY_PREFIX) else name


def memory_name(name: str) -> str:
    """A module or tensor name in transformers' in-memory form (``backbone.`` -> ``model.``)."""
    return MEMORY_PREFIX + name[len(HUB_PREFIX) :] if name.startswith(HUB_PREFIX) else name


def _put(out: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    if key in out:
        raise ConfigError(f"{key}: given twice (once stacked, once per expert?)")
    out[key] = value


# ------------------------------------------------------------------------------ files
def parse_shard_size(text: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a number of bytes -> bytes (``--max-shard-size``)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text).upper())
        if match is None:
            raise ConfigError(
                f"--max-shard-size {text!r}: allowed: a size like 5GB, 500MB, 2GiB "
                "or a number of bytes"
            )
        value = int(float(match[1]) * _UNITS[match[2] or "B"])
    if value <= 0:
        raise ConfigError(f"--max-shard-size {text!r}: must be > 0 bytes")
    return value


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def write_hub_shards(
    out_dir: str | Path,
    tensors: Mapping[str, torch.Tensor],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write ``tensors`` (already in the Hub's names and final dtypes) into ``out_dir`` as
    ``save_pretrained`` does; returns the files written (weights, then the index if any). A
    tensor larger than a shard gets a shard of its own."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        tensor = tensors[key].detach().contiguous().cpu()
        if shards[-1] and size + _nbytes(tensor) > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += _nbytes(tensor)
    if len(shards) == 1:
        save_file(shards[0], str(out / HUB_WEIGHTS), metadata={"format": "pt"})
        return [out / HUB_WEIGHTS]
    written, weight_map = [], {}
    for index, shard in enumerate(shards, start=1):
        name = _SHARD.format(index=index, count=len(shards))
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        written.append(out / name)
    total = sum(_nbytes(t) for shard in shards for t in shard.values())
    index_file = out / HUB_INDEX
    index_file.write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    return [*written, index_file]


def verify_export_files(path: str | Path) -> bool:
    """Check an export of ours against the sizes and SHA-256 digests its ``export_meta.json``
    recorded when it was written: a ConfigError naming the first missing, truncated or altered
    file. A directory without them (a Hub download, an older export) passes unchecked (False).
    Verified directories are remembered by their files' stats, so repeated reads hash once."""
    from elastic_plugin.checkpoint.integrity import (
        already_verified,
        files_signature,
        recorded_digests,
        remember_verified,
        verify_digests,
    )

    root = Path(path)
    meta_file = root / EXPORT_META
    if not meta_file.is_file():
        return False
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{meta_file}: not readable JSON ({exc})") from None
    recorded = recorded_digests(meta, root, EXPORT_META) if isinstance(meta, dict) else None
    if recorded is None:
        return False
    signature = files_signature(root, recorded)  # None when a file is missing: verify names it
    if not already_verified(signature):
        verify_digests(root, recorded)
        remember_verified(signature)
    return True


def hub_weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a Hub directory (the index's shards, or ``model.safetensors``);
    a ConfigError naming the directory or the missing file otherwise. An export of ours is
    verified against its recorded digests first (:func:`verify_export_files`)."""
    path = Path(path)
    verify_export_files(path)
    index = path / HUB_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{index}: not a safetensors index ({exc})") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) for f in weight_map.values()
        ):
            raise ConfigError(f"{index}: 'weight_map' must map tensor names to file names")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise ConfigError(f"{index} names {missing[0]}, which is not in {path}")
        return [path / f for f in files]
    if (path / HUB_WEIGHTS).is_file():
        return [path / HUB_WEIGHTS]
    raise ConfigError(f"{path}: no {HUB_WEIGHTS} or {HUB_INDEX} (not a Hugging Face checkpoint)")


def iter_hub_shards(path: str | Path) -> Iterator[tuple[Path, dict[str, torch.Tensor]]]:
    """``(file, its tensors)`` one shard at a time: at most one shard is in memory at once. The
    index, when there is one, must list exactly the keys the shards hold."""
    from safetensors.torch import load_file

    path = Path(path)
    files = hub_weight_files(path)
    index = path / HUB_INDEX
    expected = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    for file in files:
        try:
            tensors = load_file(str(file))
        except Exception as exc:  # safetensors raises its own error types for truncated files
            raise ConfigError(f"{file}: not a readable safetensors file ({exc})") from None
        if expected is not None:
            listed = {k for k, f in expected.items() if f == file.name}
            if listed != set(tensors):
                extra = sorted(set(tensors) - listed)[:3]
                absent = sorted(listed - set(tensors))[:3]
                raise ConfigError(
                    f"{file}: does not match {HUB_INDEX} (missing {absent}, unlisted {extra})"
                )
        yield file, tensors


def read_hub_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hub directory, under the names it is stored with."""
    out: dict[str, torch.Tensor] = {}
    for file, tensors in iter_hub_shards(path):
        for key, value in tensors.items():
            if key in out:
                raise ConfigError(f"{file}: {key!r} is stored in two shards")
            out[key] = value
    return out
