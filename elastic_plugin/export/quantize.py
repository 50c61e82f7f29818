"""FP8 and NVFP4 weight quantization of an exported Hugging Face state dict (any family in
``elastic_plugin/families/``), laid out as NVIDIA ModelOpt's "unified HF checkpoint" so that
vLLM / TensorRT-LLM read it.

Conventions (matched to ModelOpt 0.47, ``modelopt/torch/quantization/qtensor/{fp8,nvfp4}_tensor.py``
and ``modelopt/torch/export/{quant_utils,moe_utils,unified_export_hf}.py``):

* **FP8** (E4M3, ``quant_algo: "FP8"``): one fp32 scale per tensor, ``scale = amax / 448``;
  ``X.weight = (w / scale)`` cast to ``float8_e4m3fn`` (round to nearest even), ``X.weight_scale``
  is the 0-d fp32 scale. Dequantized ``w ~= q * scale``.
* **NVFP4** (``quant_algo: "NVFP4"``, ``group_size: 16``): a global fp32 scale
  ``weight_scale_2 = amax / (6 * 448)``; per 16 consecutive values along the input (last) dim a
  block scale ``block_amax / (6 * weight_scale_2)`` (0 -> 1), clamped to [2^-9, 448] and cast
  to E4M3 (``X.weight_scale``); values ``w / (block_scale * weight_scale_2)`` rounded to the
  E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (nearest, ties to the even code, |x| > 6 saturates
  to 6), code = magnitude index | sign << 3 (sign set for every x < 0, so tiny negatives
  become code 8, "-0"). Two codes per uint8: the **even** element in the **low** nibble.
* **Experts**: a stacked 3-D ``…experts.<stack>`` (experts x out x in) is written per expert
  as the projections its family's ``QuantLayout.expert_stacks`` names (NemotronH
  ``experts.up_proj`` -> ``experts.{e}.up_proj.weight``; a gated ``experts.gate_up_proj`` ->
  ``experts.{e}.gate_proj`` + ``experts.{e}.up_proj``, its rows split in two), each expert
  with its own scale(s), shared by the parts of one expert — what ModelOpt's fused-experts
  export does (one weight quantizer per expert of the fused parameter) and what the Hub
  checkpoints use. :func:`quantize_fp8` / :func:`quantize_nvfp4` on a 3-D tensor likewise
  give one per-tensor scale per expert.
* ``exclude_modules``: module names (the weight name less ``.weight``) of matrix-shaped weights
  left in high precision — the embeddings, ``lm_head``, Mamba ``conv1d``, the MoE router
  ``gate`` and any projection not quantized — as ModelOpt 0.47's export lists them (tested
  against it); 1-D tensors (norms, ``A_log``, ``D``, ``dt_bias``, biases) are not listed.
  On disk the names are the family's Hub names (``Family.to_hub``,
  ``export.hf.write_hf_checkpoint``).

NVFP4 projections a runtime fuses into one GEMM (``QuantLayout.fused``: q/k/v of one attention
layer; a dense gated MLP's gate/up) share one global scale (the max of their amaxes), as
ModelOpt's export has it. The layouts are the families' (``families.all_families()``, merged:
their leaf names do not collide), so nothing here names a family. Scales are all computed
in fp32 from the (exact) fp32 image of the weight; ModelOpt's FP8
export divides a bf16 weight by a 0-d fp32 scale in bf16 (type promotion), which can differ by
one E4M3 step where that extra rounding lands on a tie. Zero tensors (amax 0) get scale 1
instead of ModelOpt's 0/0 = NaN. The quantization is weight-only; ModelOpt's ``FP8``/``NVFP4``
algorithms also quantize activations with calibrated static scales (``X.input_scale``), which
:func:`quantize_state_dict` writes only when given the activation ``input_amax``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from functools import cache

import torch

from elastic_plugin import __version__
from elastic_plugin.families.base import QuantLayout
from elastic_plugin.models.config import ConfigError
from elastic_plugin.ops import (
    E2M1_MAX,
    E4M3_MAX,
    fp8_quantize,
    nvfp4_quantize,
    pack_e2m1,
    round_e2m1,
)
from elastic_plugin.ops import NVFP4_BLOCK as BLOCK

__all__ = [
    "FORMATS",
    "QUANT_ALGO",
    "NVFP4_BLOCK",
    "E4M3_MAX",
    "E2M1_MAX",
    "E2M1_VALUES",
    "quantize_fp8",
    "dequantize_fp8",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "pack_e2m1",
    "unpack_e2m1",
    "round_e2m1",
    "DEFAULT_QUANTIZED",
    "check_format",
    "quantize_state_dict",
    "quant_layout",
    "expert_parts",
    "expert_stacks",
    "stack_of",
    "input_scale",
    "stored_input_amax",
    "same_bits",
    "dequantize_state_dict",
    "tensor_bytes",
    "quantized_weight_bytes",
    "bytes_per_weight",
]

FORMATS = ("fp8", "nvfp4")
QUANT_ALGO = {"fp8": "FP8", "nvfp4": "NVFP4"}
NVFP4_BLOCK = BLOCK
# E2M1 magnitudes by 3-bit code (1 exponent-bias-1 bit pair + 1 mantissa bit)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

WEIGHT, SCALE, SCALE_2, INPUT_SCALE = ".weight", ".weight_scale", ".weight_scale_2", ".input_scale"
_PROJ = r"(q_proj|k_proj|v_proj|o_proj|in_proj|out_proj|gate_proj|up_proj|down_proj)"
_LINEAR = re.compile(rf"(^|\.){_PROJ}\.weight$")
_EXPERT_STACK = re.compile(r"^(?P<head>.*\.experts)\.(?P<proj>[a-z_]*proj)$")
_EXPERT_ONE = re.compile(r"^(?P<head>.*\.experts)\.(?P<e>\d+)\.(?P<proj>[a-z_]*proj)\.weight$")
_NEVER = re.compile(r"(^|\.)(embeddings|embed_tokens|lm_head|norm[^.]*|gate|conv1d)\.")


@cache
def quant_layout() -> QuantLayout:
    """Every family's quantized layout, merged (``families.base.QuantLayout``)."""
    from elastic_plugin.families import all_families

    out = QuantLayout()
    for family in all_families():
        out = out.merged(family.quant_layout)
    return out


def expert_parts(stack: str) -> tuple[str, ...]:
    """The per-expert projections a 3-D ``…experts.<stack>`` is written as (rows split evenly)."""
    return tuple(quant_layout().expert_stacks.get(stack, (stack,)))


def stack_of(parts: Iterable[str]) -> list[tuple[str, tuple[str, ...]]]:
    """``(stack, its parts)`` for the per-expert projections ``parts`` of one expert: the stacks
    with the most parts first, each taken when all its parts are there (a gated expert's
    ``gate_proj`` + ``up_proj`` -> ``gate_up_proj``; NemotronH's lone ``up_proj`` ->
    ``up_proj``); a projection no stack names is its own."""
    left = set(parts)
    found = []
    stacks = sorted(quant_layout().expert_stacks.items(), key=lambda kv: -len(kv[1]))
    for stack, members in stacks:
        if set(members) <= left:
            found.append((stack, tuple(members)))
            left -= set(members)
    return found + [(p, (p,)) for p in sorted(left)]


def check_format(fmt: str) -> str:
    """``fmt`` if it is a known format; else a ConfigError naming ``--quantize``."""
    if fmt not in FORMATS:
        raise ConfigError(f"--quantize must be one of {', '.join(FORMATS)}; got {fmt!r}")
    return fmt


# ------------------------------------------------------------------------------ per-tensor scales
def _amax(w: torch.Tensor) -> torch.Tensor:
    """|w|max in fp32: 0-d for a matrix, one per expert (leading dim) for a 3-D stack."""
    if w.dim() not in (2, 3):
        raise ValueError(f"expected a 2-D weight or a 3-D expert stack, got shape {tuple(w.shape)}")
    a = w.detach().abs().float()
    return a.amax() if w.dim() == 2 else a.flatten(1).amax(1)


def _positive(scale: torch.Tensor) -> torch.Tensor:
    """Scale 0 (an all-zero tensor, or an amax so small its scale underflows) -> 1, so that
    quantizing divides by a finite non-zero number and dequantizing still gives zeros."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _per_expert(scale: torch.Tensor, ndim: int) -> torch.Tensor:
    """Broadcast a 0-d / per-expert scale against a tensor of ``ndim`` dims."""
    return scale if scale.dim() == 0 else scale.view(-1, *([1] * (ndim - 1)))


def _rows(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` as [rows, in] (float32 or bfloat16, as the quantize ops take it) and the scale of
    each row: the tensor's one, or its expert's for a 3-D stack."""
    x = w.detach()
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    per_row = torch.broadcast_to(_per_expert(scale.float(), w.dim() - 1), w.shape[:-1])
    return x.reshape(-1, x.shape[-1]), per_row.reshape(-1).contiguous()


# ------------------------------------------------------------------------------ FP8
def quantize_fp8(
    w: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn, scale fp32)`` with ``scale = amax / 448`` (0-d; shape [E] for a 3-D
    expert stack, one per expert) and ``q = w / scale`` rounded to nearest even E4M3. ``amax``
    defaults to ``w``'s own; the parts of one fused parameter (a gated expert's gate and up)
    share the whole parameter's."""
    scale = _positive((_amax(w) if amax is None else amax.float()) / E4M3_MAX)
    rows, row_scale = _rows(w, scale)
    return fp8_quantize(rows, row_scale).reshape(w.shape), scale


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q * scale`` (computed in fp32, then cast to ``dtype``)."""
    return (q.float() * _per_expert(scale.float(), q.dim())).to(dtype)


# ------------------------------------------------------------------------------ E2M1
# round_e2m1 / pack_e2m1 live with the NVFP4 kernel's reference (elastic_plugin.ops._quantize.py).


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_e2m1`: uint8 codes, last dim doubled."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (code 8, "-0", decodes to 0)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 0x07).long()]
    return torch.where((codes & 0x08) != 0, -mag, mag)


# ------------------------------------------------------------------------------ NVFP4
def _blocks(w: torch.Tensor) -> torch.Tensor:
    """``w`` viewed as [..., in/16, 16] blocks along the input dim."""
    if w.shape[-1] % NVFP4_BLOCK:
        raise ValueError(
            f"NVFP4 needs the input dim to divide by {NVFP4_BLOCK}; got shape {tuple(w.shape)}"
        )
    return w.reshape(*w.shape[:-1], w.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)


def quantize_nvfp4(
    w: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed uint8 [..., in/2], block_scale float8_e4m3fn [..., in/16], global_scale fp32)``.

    ``global_scale = amax / (6 * 448)`` (0-d; [E] for a 3-D expert stack); block scale
    ``block_amax / (6 * global_scale)`` (0 -> 1) clamped to [2^-9, 448] and cast to E4M3, so
    that the largest block scale is 448 and the block's largest value lands on 6. ``amax``
    defaults to ``w``'s own; a group of weights that runtimes fuse into one GEMM shares one.
    The input dim must divide by 16 (:func:`quantize_state_dict` leaves other tensors
    unquantized)."""
    gs = _positive((_amax(w) if amax is None else amax.float()) / (E2M1_MAX * E4M3_MAX))
    _blocks(w)  # the input dim must divide by 16
    packed, block_scale = nvfp4_quantize(*_rows(w, gs))
    return (packed.reshape(*w.shape[:-1], -1), block_scale.reshape(*w.shape[:-1], -1), gs)


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``e2m1(code) * (block_scale * global_scale)`` per 16-value block, in fp32, cast to dtype."""
    values = _blocks(_e2m1_decode(unpack_e2m1(packed)))
    g = _per_expert(global_scale.float(), values.dim() - 1)
    out = values * (block_scale.float() * g).unsqueeze(-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2).to(dtype)


# ------------------------------------------------------------------------------ state dicts
def DEFAULT_QUANTIZED(name: str) -> bool:  # noqa: N802 (a constant-like default predicate)
    """Linear projection weights (q/k/v/o_proj, in_proj, out_proj, gate_proj, up_proj,
    down_proj, shared experts and the 3-D ``experts.*_proj`` stacks); never embeddings,
    lm_head, norms, the router gate, conv1d, A_log, D, dt_bias or biases."""
    if _NEVER.search(name):
        return False
    return bool(_LINEAR.search(name) or _EXPERT_STACK.search(name))


def _is_stack(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 3 and _EXPERT_STACK.search(name) is not None


def _entries(state: Mapping[str, torch.Tensor]):
    """(source name, module name, weight, amax) per output weight: expert stacks split into
    one module per expert and part (the parts of one expert with that expert's whole amax);
    ``None`` module for tensors that are not a module's weight matrix."""
    for name, t in state.items():
        if not _is_stack(name, t):
            yield name, None, t, None
            continue
        head, stack = name.rsplit(".", 1)
        parts = expert_parts(stack)
        if t.shape[1] % len(parts):
            raise ConfigError(f"{name}: {t.shape[1]} rows do not split into {parts}")
        for e in range(t.shape[0]):
            amax = _amax(t[e]) if len(parts) > 1 else None
            for part, rows in zip(parts, t[e].chunk(len(parts))):
                yield name, f"{head}.{e}.{part}", rows, amax


def quantize_state_dict(
    state: Mapping[str, torch.Tensor],
    fmt: str,
    quantize: Callable[[str], bool] = DEFAULT_QUANTIZED,
    input_amax: Mapping[str, float | torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """All tensors of the quantized export and its ``hf_quant_config.json`` dict.

    ``quantize(name)`` picks the tensors (HF names; a 3-D expert stack by its own name). A picked
    weight becomes ``X.weight`` + ``X.weight_scale`` (+ ``X.weight_scale_2`` for NVFP4); expert
    stacks are always written per expert (``…experts.{e}.up_proj.weight``). A picked NVFP4
    weight whose input dim does not divide by 16 is left unquantized and listed in
    ``exclude_modules``, like ``lm_head`` / ``conv1d`` / router ``gate`` and every other
    unpicked weight matrix. ``input_amax`` (module name -> calibrated activation |x|max; an
    expert stack's name covers all its experts) adds ModelOpt's static ``X.input_scale``
    (amax / 448 for FP8, amax / (6 * 448) for NVFP4)."""
    check_format(fmt)
    picked = {n for n, t in state.items() if quantize(n)}
    for n in sorted(picked):
        t = state[n]
        stack = _is_stack(n, t)
        if not (stack or (n.endswith(WEIGHT) and t.dim() == 2)) or not t.is_floating_point():
            raise ConfigError(
                f"--quantize {fmt}: {n!r} (shape {tuple(t.shape)}, {t.dtype}) is not a "
                "2-D linear weight or a 3-D experts.*_proj stack"
            )
    amax = dict(input_amax or {})
    unknown = sorted(set(amax) - {n.removesuffix(WEIGHT) for n in picked})
    if unknown:
        raise ConfigError(f"input_amax names modules that are not quantized: {unknown[:4]}")
    shared = _fused_amax(state, picked) if fmt == "nvfp4" else {}
    out: dict[str, torch.Tensor] = {}
    exclude: list[str] = []
    for source, module, t, part_amax in _entries(state):
        if module is None and source not in picked:
            out[source] = t
            if source.endswith(WEIGHT) and t.dim() >= 2:
                exclude.append(source.removesuffix(WEIGHT))
            continue
        module = module if module is not None else source.removesuffix(WEIGHT)
        if source not in picked or (fmt == "nvfp4" and t.shape[-1] % NVFP4_BLOCK):
            # an expert's slice is cloned: safetensors refuses tensors sharing storage
            out[module + WEIGHT] = t.clone() if module != source.removesuffix(WEIGHT) else t
            exclude.append(module)
            continue
        if fmt == "fp8":
            out[module + WEIGHT], out[module + SCALE] = quantize_fp8(t, part_amax)
        else:
            out[module + WEIGHT], out[module + SCALE], out[module + SCALE_2] = quantize_nvfp4(
                t, part_amax if part_amax is not None else shared.get(source)
            )
        key = source.removesuffix(WEIGHT)
        if key in amax:
            out[module + INPUT_SCALE] = input_scale(amax[key], fmt)

    quantization: dict = {"quant_algo": QUANT_ALGO[fmt], "kv_cache_quant_algo": None}
    if fmt == "nvfp4":
        quantization["group_size"] = NVFP4_BLOCK
    quantization["exclude_modules"] = sorted(exclude)
    return out, {
        "producer": {"name": "elastic_plugin", "version": __version__},
        "quantization": quantization,
    }


def _fused_amax(state: Mapping[str, torch.Tensor], picked: set[str]) -> dict[str, torch.Tensor]:
    """One weight amax per group of sibling projections a runtime fuses into one GEMM
    (``QuantLayout.fused``: an attention layer's q/k/v, a gated MLP's gate/up; weight name ->
    amax), so they share NVFP4's global ``weight_scale_2``, as ModelOpt's export unifies them
    (its ``preprocess_linear_fusion``, NVFP4 only). Only when every member is quantized."""
    out: dict[str, torch.Tensor] = {}
    for group in quant_layout().fused:
        members: dict[str, list[str]] = {}
        for name in picked:
            head, _, leaf = name.removesuffix(WEIGHT).rpartition(".")
            if name.endswith(WEIGHT) and leaf in group and state[name].dim() == 2:
                if state[name].shape[-1] % NVFP4_BLOCK == 0:
                    members.setdefault(head, []).append(name)
        for names in members.values():
            if len(names) == len(group):
                amax = torch.stack([_amax(state[n]) for n in names]).amax()
                out.update(dict.fromkeys(names, amax))
    return out


def input_scale(amax: float | torch.Tensor, fmt: str) -> torch.Tensor:
    """ModelOpt's static activation scale of a calibrated input |x|max: amax / 448 (FP8) or
    amax / (6 * 448) (NVFP4's global input scale), 0-d fp32 (0 -> 1)."""
    act_max = E4M3_MAX if check_format(fmt) == "fp8" else E2M1_MAX * E4M3_MAX
    return _positive(torch.as_tensor(amax, dtype=torch.float32).reshape(()) / act_max)


def stored_input_amax(tensors: Mapping[str, torch.Tensor], fmt: str) -> dict[str, float]:
    """The calibrated activation |x|max that a quantized state's ``X.input_scale`` stand for
    (the inverse of :func:`input_scale`), per module; experts' per-expert scales under their
    stack's name (``…experts.up_proj`` / ``…experts.gate_up_proj``: the largest, ModelOpt
    writes one value for all)."""
    act_max = E4M3_MAX if check_format(fmt) == "fp8" else E2M1_MAX * E4M3_MAX
    stacks = _expert_modules(
        [n.removesuffix(INPUT_SCALE) + WEIGHT for n in tensors if n.endswith(INPUT_SCALE)]
    )
    out: dict[str, float] = {}
    for name, scale in tensors.items():
        if not name.endswith(INPUT_SCALE):
            continue
        module = name.removesuffix(INPUT_SCALE)
        module = stacks.get(module + WEIGHT, module)
        out[module] = max(out.get(module, 0.0), float(scale.float()) * act_max)
    return out


_EXPERT_MODULE = re.compile(
    r"^(?P<head>.*\.experts)\.(?P<e>\d+)\.(?P<proj>[a-z_]*proj)(\.(weight|weight_scale|"
    r"weight_scale_2|input_scale))?$"
)


def expert_stacks(names: Iterable[str]) -> dict[str, str]:
    """Per-expert module (``…experts.{e}.<part>``, from any of its tensor names or its module
    name) -> its in-memory stack (``…experts.<stack>``), the stack found from the parts each
    expert has (:func:`stack_of`)."""
    parts: dict[tuple[str, int], set[str]] = {}
    for name in names:
        one = _EXPERT_MODULE.match(name)
        if one is not None:
            parts.setdefault((one["head"], int(one["e"])), set()).add(one["proj"])
    out: dict[str, str] = {}
    for (head, e), present in parts.items():
        for stack, members in stack_of(present):
            for part in members:
                out[f"{head}.{e}.{part}"] = f"{head}.{stack}"
    return out


def _expert_modules(names: Iterable[str]) -> dict[str, str]:
    """Per-expert weight name -> its in-memory stack (:func:`expert_stacks`)."""
    return {m + WEIGHT: stack for m, stack in expert_stacks(names).items()}


def dequantize_state_dict(
    tensors: Mapping[str, torch.Tensor], quant_config: Mapping, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The inverse layout of :func:`quantize_state_dict`: plain names and shapes, quantized
    weights dequantized to ``dtype`` (others unchanged), scales and ``input_scale`` dropped, and
    per-expert ``…experts.{e}.{proj}.weight`` restacked into the 3-D ``…experts.{proj}``."""
    algo = quant_config.get("quantization", {}).get("quant_algo")
    fmt = {v: k for k, v in QUANT_ALGO.items()}.get(algo)
    if fmt is None:
        raise ConfigError(
            f"hf_quant_config.json quantization.quant_algo must be one of "
            f"{', '.join(QUANT_ALGO.values())}; got {algo!r}"
        )
    plain: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith((SCALE, SCALE_2, INPUT_SCALE)):
            continue
        module = name.removesuffix(WEIGHT)
        if name.endswith(WEIGHT) and module + SCALE in tensors:
            if fmt == "fp8":
                t = dequantize_fp8(t, tensors[module + SCALE], dtype)
            else:
                t = dequantize_nvfp4(t, tensors[module + SCALE], tensors[module + SCALE_2], dtype)
        plain[name] = t
    return _restack_experts(plain)


def _restack_experts(plain: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``…experts.{e}.<part>.weight`` (e = 0..E-1) -> one 3-D ``…experts.<stack>`` (a stack of
    several parts has each expert's parts concatenated by rows, :func:`stack_of`), in place of
    expert 0's first part so the key order stays that of the export."""
    stacks = _expert_modules(plain)
    groups: dict[str, dict[int, list[str]]] = {}
    for name in plain:
        if name in stacks:
            e = int(_EXPERT_ONE.match(name)["e"])  # type: ignore[index]  # a stacks key matches
            groups.setdefault(stacks[name], {}).setdefault(e, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for name, t in plain.items():
        stacked = stacks.get(name)
        if stacked is None:
            out[name] = t
            continue
        members = groups[stacked]
        if sorted(members) != list(range(len(members))):
            raise ValueError(f"{stacked}: experts {sorted(members)} are not 0..E-1")
        if name == members[0][0]:
            order = expert_parts(stacked.rsplit(".", 1)[1])

            def part(n: str) -> int:
                return order.index(n.removesuffix(WEIGHT).rsplit(".", 1)[1])

            rows = [
                torch.cat([plain[n] for n in sorted(members[e], key=part)])
                for e in range(len(members))
            ]
            out[stacked] = torch.stack(rows)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits: the bitwise comparison of quantized tensors (float8 has no
    CPU ``torch.equal``)."""
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*flat)


# ------------------------------------------------------------------------------ sizes
def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Sum of numel * element_size over ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def quantized_weight_bytes(shape: tuple[int, ...], fmt: str) -> int:
    """Exact bytes of one quantized weight with its scales: per matrix (per expert for a 3-D
    stack) FP8 stores numel + 4 (fp32 scale); NVFP4 numel/2 + numel/16 (E4M3 block scales) + 4."""
    check_format(fmt)
    experts = shape[0] if len(shape) == 3 else 1
    per = 1
    for d in shape[-2:]:
        per *= d
    body = per + 4 if fmt == "fp8" else per // 2 + per // NVFP4_BLOCK + 4
    return experts * body


def bytes_per_weight(fmt: str, numel: int | None = None) -> float:
    """Bytes per weight parameter: FP8 1 + 4/numel, NVFP4 0.5 + 1/16 + 4/numel (``numel`` the
    size of the matrix sharing the fp32 per-tensor scale; None -> the large-matrix limit)."""
    check_format(fmt)
    base = 1.0 if fmt == "fp8" else 0.5 + 1.0 / NVFP4_BLOCK
    return base + (4.0 / numel if numel else 0.0)
