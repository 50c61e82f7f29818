"""One budget cut out of a quantized (FP8 / NVFP4, ModelOpt layout) nested model.

A quantized nested directory holds the full model quantized once; a budget is its prefix. Cutting
the quantized tensors (rather than quantizing each budget's weights anew) is what lets one file
serve every budget, so it is also how a per-budget quantized export is made: the parent's
quantization, cut to the budget. What that means per tensor:

* FP8: the E4M3 values are cut like the plain weight; the per-tensor ``weight_scale`` (and a
  static ``input_scale``) carry over unchanged.
* NVFP4: rows (outputs) cut freely. Along the input dim two values share a byte and 16 share an
  E4M3 block scale, so a budget may keep only whole, aligned 16-value blocks: a prefix of a
  multiple of 16, or an index set made of such blocks. :func:`unaligned_weights` finds the weights
  a budget would cut through a block, before anything is written, so the caller can refuse them
  (naming the axis) or keep them in high precision for every budget.
* Routed experts are per expert (``…experts.{e}.up_proj.weight`` + scales; a gated stack's
  ``gate_proj`` / ``up_proj`` parts each): experts past the budget's count are dropped, the
  rest cut like the stacked plain weight.

Tensors use transformers' in-memory names (the family's ``from_hub`` of the stored files); which
per-expert projections make up which stack is the families' ``QuantLayout`` (through
``export.quantize``), so nothing here names a family.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic_plugin.export.hf_slicing import Cut, cut_tensor, read_cut, tensor_cuts
from elastic_plugin.export.quantize import (
    DEFAULT_QUANTIZED,
    NVFP4_BLOCK,
    check_format,
    expert_parts,
    expert_stacks,
)
from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = [
    "UNALIGNED_POLICIES",
    "check_unaligned",
    "quantize_nested",
    "with_input_scales",
    "slice_quant_config",
    "slice_quantized_files",
    "slice_quantized_state",
    "unaligned_weights",
]

UNALIGNED_POLICIES = ("error", "high-precision")
ChoiceT = Mapping[str, int | Sequence[int]]

_PER_EXPERT = re.compile(
    r"^(?P<head>.*\.experts)\.(?P<e>\d+)\.(?P<proj>[a-z_]*proj)"
    r"\.(?P<leaf>weight|weight_scale|weight_scale_2|input_scale)$"
)
_LEAF = re.compile(r"^(?P<module>.*)\.(?P<leaf>weight_scale_2|weight_scale|input_scale)$")
# which elastic axis sets each projection's input width (for the error message)
_INPUT_AXIS = (
    ("shared_experts.down_proj", "shared_ffn"),
    ("o_proj", "attention_heads (whole heads of kv_channels)"),
    ("out_proj", "mamba_heads / mamba_head_dim"),
    ("down_proj", "ffn"),
)


class _Unaligned(ValueError):
    """An input-dim cut that does not keep whole NVFP4 blocks."""


def _input_axis(module: str) -> str:
    return next((axis for part, axis in _INPUT_AXIS if f".{part}" in module), "embedding")


def _block_cut(index: int | torch.Tensor, factor: int) -> int | torch.Tensor:
    """An input-dim cut in values -> the same cut in packed bytes (``factor`` 2) or block scales
    (``factor`` 16); :class:`_Unaligned` unless it keeps whole aligned 16-value blocks."""
    if isinstance(index, int):
        if index % NVFP4_BLOCK:
            raise _Unaligned(f"keeps the first {index} input values")
        return index // factor
    values = index.long().flatten()
    if values.numel() % NVFP4_BLOCK:
        raise _Unaligned(f"keeps {values.numel()} input values")
    blocks = values.view(-1, NVFP4_BLOCK)
    starts = blocks[:, 0]
    if bool((starts % NVFP4_BLOCK).any()) or not torch.equal(
        blocks, starts[:, None] + torch.arange(NVFP4_BLOCK)
    ):
        raise _Unaligned(f"keeps {values.numel()} input values that are not whole blocks")
    ids = starts // NVFP4_BLOCK
    if factor == NVFP4_BLOCK:
        return ids
    per_block = NVFP4_BLOCK // factor
    return (ids[:, None] * per_block + torch.arange(per_block)).flatten()


def _packed(cut: Cut, last: int, factor: int) -> Cut:
    """``cut`` with its entry on dim ``last`` (the input dim) converted by ``factor``."""
    return tuple((dim, _block_cut(index, factor) if dim == last else index) for dim, index in cut)


def unaligned_weights(
    model: ModelConfig,
    choices: Mapping[str, ChoiceT],
    quantize: Callable[[str], bool] = DEFAULT_QUANTIZED,
) -> dict[str, str]:
    """Weights NVFP4 would quantize (``quantize``-picked, full input dim divisible by 16) that
    some budget of ``choices`` (label -> choice) cuts through a 16-value block along the input
    dim: weight name (transformers' names) -> why. Needs the config only (no weights), so it runs
    before anything is loaded or written."""
    full = tensor_cuts(model, {})
    found: dict[str, str] = {}
    for label, choice in choices.items():
        cuts = tensor_cuts(model, choice)
        for name, full_cut in full.items():
            last = max((dim for dim, _ in full_cut), default=-1)
            is_input = (name.endswith(".weight") and last == 1) or last == 2  # 2-D, or a stack
            if name in found or not quantize(name) or not is_input:
                continue
            width = dict(full_cut)[last]
            width = width if isinstance(width, int) else int(width.numel())
            if width % NVFP4_BLOCK:
                continue  # not quantized at all (quantize_state_dict leaves it out)
            index = dict(cuts[name]).get(last, width)
            try:
                _block_cut(index, 2)
            except _Unaligned as why:
                module = name.removesuffix(".weight")
                found[name] = (
                    f"budget {label} {why} of the {width} inputs of {module}; that width "
                    f"comes from the {_input_axis(module)} axis, whose sizes must keep whole "
                    f"{NVFP4_BLOCK}-value blocks there"
                )
    return found


@dataclass(frozen=True)
class _Piece:
    """What a quantized-layout tensor is: its module, its leaf, and the cut of the module's
    plain weight expressed in this tensor's dims (``keep`` False: an expert past the budget)."""

    module: str
    leaf: str
    weight_cut: Cut
    keep: bool = True


def _piece(key: str, cuts: Mapping[str, Cut], stacks: Mapping[str, str]) -> _Piece | None:
    expert = _PER_EXPERT.match(key)
    if expert is not None:
        module = f"{expert['head']}.{expert['e']}.{expert['proj']}"
        stack = stacks.get(module)
        stacked = cuts.get(stack) if stack is not None else None
        if stack is None or stacked is None:
            return None
        (_, count), *rest = stacked  # the expert axis, then the expert's own dims
        if len(expert_parts(stack.rsplit(".", 1)[1])) > 1 and any(dim == 1 for dim, _ in rest):
            raise ConfigError(f"{stack}: a cut of its rows has no per-expert form")
        return _Piece(
            module,
            expert["leaf"],
            tuple((dim - 1, index) for dim, index in rest),
            int(expert["e"]) < int(count),
        )
    if key in cuts:
        return _Piece(key.removesuffix(".weight"), "weight", cuts[key])
    leaf = _LEAF.match(key)
    if leaf is not None and leaf["module"] + ".weight" in cuts:
        return _Piece(leaf["module"], leaf["leaf"], cuts[leaf["module"] + ".weight"])
    return None


def _tensor_cut(piece: _Piece, ndim: int, quantized: bool, fmt: str) -> Cut:
    """The cut of one tensor of ``piece`` (``quantized``: its module has a ``weight_scale``)."""
    if piece.leaf in ("weight_scale_2", "input_scale") or (
        piece.leaf == "weight_scale" and fmt == "fp8"
    ):
        return ()  # per-tensor scales carry over
    if not quantized or fmt == "fp8":
        return piece.weight_cut
    factor = 2 if piece.leaf == "weight" else NVFP4_BLOCK
    try:
        return _packed(piece.weight_cut, ndim - 1, factor)
    except _Unaligned as why:
        raise ConfigError(
            f"NVFP4 slice of {piece.module}: this budget {why}; NVFP4 keeps whole "
            f"{NVFP4_BLOCK}-value blocks along the input dim ({_input_axis(piece.module)} sizes "
            "must be multiples of 16 there)"
        ) from None


def _plan(
    keys: Iterable[str], cuts: Mapping[str, Cut]
) -> tuple[dict[str, _Piece], set[str], list[str]]:
    keys = list(keys)
    stacks = expert_stacks(keys)
    pieces, unknown = {}, []
    for key in keys:
        piece = _piece(key, cuts, stacks)
        if piece is None:
            unknown.append(key)
        else:
            pieces[key] = piece
    quantized = {k.removesuffix(".weight_scale") for k in keys if k.endswith(".weight_scale")}
    return pieces, quantized, unknown


def _refuse(unknown: list[str]) -> None:
    if unknown:
        raise ConfigError(f"slice: quantized tensors without a slicing rule: {sorted(unknown)[:3]}")


@torch.no_grad()
def slice_quantized_state(
    tensors: Mapping[str, torch.Tensor], model: ModelConfig, choice: ChoiceT, fmt: str
) -> dict[str, torch.Tensor]:
    """The nested model of ``choice`` cut from the full model's quantized tensors (the output
    layout of ``quantize_state_dict``; ``fmt`` "fp8"/"nvfp4"). ConfigError for an NVFP4 cut
    through a block or a tensor no rule covers."""
    check_format(fmt)
    pieces, quantized, unknown = _plan(tensors, tensor_cuts(model, choice))
    _refuse(unknown)
    out = {}
    for key, tensor in tensors.items():
        piece = pieces[key]
        if piece.keep:
            cut = _tensor_cut(piece, tensor.dim(), piece.module in quantized, fmt)
            out[key] = cut_tensor(tensor, cut)
    return out


@torch.no_grad()
def slice_quantized_files(
    path: str | Path, model: ModelConfig, choice: ChoiceT, fmt: str
) -> dict[str, torch.Tensor]:
    """:func:`slice_quantized_state` of a quantized Hub directory's files, reading only what the
    budget keeps (experts past it are not read; prefix cuts go through ``get_slice``). Returns
    transformers' in-memory names, experts per expert and unquantized expert stacks stacked, as
    ``checkpoint.hub.from_hub`` gives them."""
    from safetensors import safe_open

    from elastic_plugin.checkpoint.hub import hub_weight_files
    from elastic_plugin.families import family_for_model

    check_format(fmt)
    family = family_for_model(model, "slice")
    files = hub_weight_files(path)
    names: dict[str, tuple[Path, str]] = {}
    for file in files:
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                names[family.memory_name(key)] = (file, key)
    pieces, quantized, unknown = _plan(names, tensor_cuts(model, choice))
    _refuse(unknown)
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), "pt") as handle:
            for name, (where, key) in names.items():
                if where != file or not pieces[name].keep:
                    continue
                piece = pieces[name]
                ndim = len(handle.get_slice(key).get_shape())
                cut = _tensor_cut(piece, ndim, piece.module in quantized, fmt)
                out[key] = read_cut(handle, key, cut) if cut else handle.get_tensor(key)
    return family.from_hub(out)  # unquantized experts (no scales) are stacked again


def slice_quant_config(quant_config: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict:
    """``hf_quant_config.json`` of a sliced model: ``exclude_modules`` less the modules the
    budget dropped (experts past its count; ``tensors`` in-memory names)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in quant_config.items()}
    quantization = out.get("quantization") or {}
    kept = {k.removesuffix(".weight") for k in tensors}
    excluded = list(quantization.get("exclude_modules", []))
    stacks = expert_stacks(m + ".weight" for m in excluded)

    def still_there(module: str) -> bool:
        """A budget drops routed experts only (every layer and projection stays; a tied
        ``lm_head`` has no tensor but is listed for the runtime)."""
        stack = stacks.get(module)
        if stack is None or module in kept:
            return True
        if stack not in tensors:  # an expert past the budget (kept ones are per expert)
            return False
        e = int(module[len(stack.rsplit(".", 1)[0]) + 1 :].split(".", 1)[0])
        return e < tensors[stack].shape[0]  # an expert of an unquantized (restacked) stack

    quantization["exclude_modules"] = [m for m in excluded if still_there(m)]
    out["quantization"] = quantization
    return out


def quantize_nested(
    full: Mapping[str, torch.Tensor],
    model: ModelConfig,
    fmt: str,
    choices: Mapping[str, ChoiceT],
    unaligned: str = "error",
) -> tuple[dict[str, torch.Tensor], dict]:
    """The full model's tensors (transformers' names) quantized once so that every budget of
    ``choices`` is a slice of them, and its ``hf_quant_config.json``. NVFP4 weights some budget
    would cut through a block (:func:`unaligned_weights`) are refused (``unaligned`` "error")
    or left in high precision for every budget ("high-precision", listed in exclude_modules)."""
    from elastic_plugin.export.quantize import quantize_state_dict

    check_unaligned(model, fmt, choices, unaligned)
    if fmt != "nvfp4":
        tensors, config = quantize_state_dict(full, fmt)
    else:
        skip = unaligned_weights(model, choices)
        tensors, config = quantize_state_dict(
            full, fmt, lambda n: DEFAULT_QUANTIZED(n) and n not in skip
        )
    excluded = config["quantization"]["exclude_modules"]
    if not model.untie_embeddings_and_output_weights and "lm_head" not in excluded:
        # tied: no lm_head tensor, but the runtime's output layer stays unquantized (ModelOpt
        # lists it too, so that vLLM does not quantize the embedding it reuses)
        config["quantization"]["exclude_modules"] = sorted([*excluded, "lm_head"])
    return tensors, config


def check_unaligned(
    model: ModelConfig, fmt: str, choices: Mapping[str, ChoiceT], unaligned: str
) -> None:
    """The ``--nvfp4-unaligned`` check, from the config alone (before anything is written)."""
    if unaligned not in UNALIGNED_POLICIES:
        raise ConfigError(
            f"--nvfp4-unaligned {unaligned!r}: allowed: {', '.join(UNALIGNED_POLICIES)}"
        )
    if check_format(fmt) != "nvfp4" or unaligned != "error":
        return
    bad = unaligned_weights(model, choices)
    if bad:
        first = next(iter(bad.values()))
        raise ConfigError(
            f"--quantize nvfp4: {len(bad)} weights cannot be sliced in whole NVFP4 blocks, e.g. "
            f"{first}. Choose such sizes, or pass --nvfp4-unaligned high-precision to keep "
            "those weights in high precision in every budget"
        )


def with_input_scales(
    tensors: Mapping[str, torch.Tensor], input_amax: Mapping[str, float], fmt: str
) -> dict[str, torch.Tensor]:
    """``tensors`` (a quantized model, experts per expert) with ModelOpt's static
    ``X.input_scale`` of each calibrated module (``input_amax``: module -> |x|max; an expert
    stack's name covers each of its experts), replacing any already there. A module kept in high
    precision (excluded) takes none."""
    from elastic_plugin.export.quantize import input_scale

    out = dict(tensors)
    stacks = expert_stacks(tensors)
    for module, amax in input_amax.items():
        if module + ".weight" in tensors or module in tensors:  # a linear, or a plain stack
            targets = [module] * (module + ".weight_scale" in tensors)
        else:  # an expert stack, quantized per expert (and part)
            targets = [m for m, stack in stacks.items() if stack == module]
            if not targets:
                raise ConfigError(f"calibrated module {module!r} is not a module of this model")
            targets = [m for m in targets if m + ".weight_scale" in tensors]
        for target in targets:
            out[target + ".input_scale"] = input_scale(amax, fmt)
    return out
