"""Zero-shot extraction: one nested model of an elastic checkpoint, saved as a plain smaller model.

The elastic checkpoint holds the full (importance-ordered) weights and the budget router. The
nested model of a budget is the router's hard choice for it (``nested.choice``: the stored choice
table for trained budgets; the router itself for an untrained budget in between, with
``interpolate=True``). ``nested.slicing.nested_state_dict`` cuts its weights out; they load
strictly into the plain ``HybridModel`` of ``models.axes.model_for_choice``, which is written as
an ordinary Megatron dist
checkpoint: any Megatron-Core code (any TP/PP/EP layout) loads it, nothing elastic is needed.

The input-checking half (``ExtractPlan``, ``plan_extraction``) loads no weights and imports no
Megatron, so the CLI rejects bad input in a moment; ``extract_nested`` does the heavy part.

A quantized HF export is the parent's quantization cut to the budget (``export.quant_slicing``):
the full model is quantized once, FP8 scales carry over, NVFP4 keeps whole 16-value blocks, so
the budget cut from a quantized nested directory equals this export bit for bit.
``QuantOptions.calib_samples`` adds ModelOpt-calibrated static activation scales (``input_scale``)
measured on the budget's own model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.hub import DEFAULT_MAX_SHARD_BYTES, EXPORT_META, parse_shard_size
from elastic_plugin.checkpoint.meta import (
    CHECKPOINT_META,
    match_budget,
    read_elastic_meta,
    stored_choice,
    trained_budgets,
    trained_listing,
)
from elastic_plugin.cli_args import start_ranks
from elastic_plugin.export.hf_compat import HF_DTYPES, QUANTIZE_FORMATS, check_hf_compatible
from elastic_plugin.models.axes import model_for_choice
from elastic_plugin.models.config import ConfigError, ModelConfig, config_from_dict
from elastic_plugin.nested.choice import homogeneous_choice, interpolated_choice, nested_params

EXTRACTED_KIND = "extracted"
FORMATS = ("megatron", "hf")
CALIB_BATCH = 8  # sequences per calibration forward
_TARGET_FLAGS = (
    ("--target-tensor-model-parallel-size", "tp"),
    ("--target-pipeline-model-parallel-size", "pp"),
    ("--target-expert-model-parallel-size", "ep"),
)

__all__ = [
    "ExtractPlan",
    "QuantOptions",
    "check_quant_options",
    "quantized_budget",
    "plan_extraction",
    "extract_nested",
    "run_extraction",
    "load_source",
    "check_target_layout",
    "extracted_config",
]


# ------------------------------------------------------------------------------ input checks
def check_target_layout(model: ModelConfig, tp: int, pp: int, ep: int, budget: float) -> None:
    """The extracted model must split under the target layout; the error names the flag."""
    for flag, key in _TARGET_FLAGS:
        size = {"tp": tp, "pp": pp, "ep": ep}[key]
        try:
            model.check_parallel(**{key: size})
        except ConfigError as exc:
            raise ConfigError(
                f"{flag} {size}: the extracted model (budget {budget:g}) does not "
                f"split this way: {exc}"
            ) from None


def extracted_config(
    meta: Mapping[str, Any], model: ModelConfig, target: tuple[int, int, int] | None
) -> dict[str, Any]:
    """The source's experiment config with the reduced model and no elastic section. Its
    ``parallel:`` section (the default layout of later jobs) must divide the reduced model: the
    target layout when given, else the source's when it divides, else TP=PP=EP=1."""
    raw = {k: v for k, v in meta["config"].items() if k != "elastic"}
    parallel = dict(raw.get("parallel") or {})
    tp, pp, ep = target or (
        parallel.get("tensor_model_parallel_size", 1),
        parallel.get("pipeline_model_parallel_size", 1),
        parallel.get("expert_model_parallel_size", 1),
    )
    try:
        model.check_parallel(tp, pp, ep)
    except ConfigError:
        tp, pp, ep = 1, 1, 1
    parallel.update(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
    )
    if tp == 1:
        parallel["sequence_parallel"] = False
    elif model.count("moe"):
        parallel["sequence_parallel"] = True  # Megatron-Core needs it for MoE under TP
    out = {**raw, "model": dataclasses.asdict(model), "parallel": parallel}
    config_from_dict(out, source="extracted config")  # it must be loadable as it is written
    return out


@dataclass(frozen=True)
class QuantOptions:
    """How a quantized export is made: ``nvfp4_unaligned`` ("error" / "high-precision") for
    NVFP4 weights a budget would cut through a block; ``calib_samples`` > 0 calibrates static
    activation scales on that many sequences of ``calib_data`` (an indexed dataset prefix;
    default: the checkpoint's training data)."""

    nvfp4_unaligned: str = "error"
    calib_samples: int = 0
    calib_data: str | None = None
    seq_length: int | None = None  # tokens per sequence; None: the checkpoint's training one

    def sequence_length(self, meta: dict[str, Any]) -> int:
        """``seq_length``, else the checkpoint's training ``seq_length`` (128 when it has none)."""
        if self.seq_length is not None:
            return self.seq_length
        return int((meta["config"].get("training") or {}).get("seq_length", 128))


@dataclass
class ExtractPlan:
    """A checked extraction: what to load, which budget, and the choice when it is known up
    front (trained budgets; an interpolated budget's choice needs the router)."""

    ckpt: Path
    out: Path
    budget: float
    meta: dict[str, Any]
    model: ModelConfig  # the full (elastic) model
    choice: dict[str, Any] | None  # None: ask the router; per-layer lists only for "hf"
    target: tuple[int, int, int] | None
    fmt: str = "megatron"
    dtype: str = "bf16"  # HF only: the floating dtype of the written tensors
    quantize: str | None = None  # HF only: "fp8" / "nvfp4" weights
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES  # HF only: safetensors shard size
    quant: QuantOptions = QuantOptions()  # --quantize only


def _check_format(
    fmt: str,
    dtype: str | None,
    quantize: str | None,
    target: tuple[int, int, int] | None,
    model: ModelConfig,
) -> str:
    """Flag combinations; returns the dtype to use."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: allowed: {', '.join(FORMATS)}")
    if quantize is not None and quantize not in QUANTIZE_FORMATS:
        raise ConfigError(f"--quantize {quantize!r}: allowed: {', '.join(QUANTIZE_FORMATS)}")
    if dtype is not None and dtype not in HF_DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: allowed: {', '.join(HF_DTYPES)}")
    if fmt == "megatron":
        for flag, value in (("--quantize", quantize), ("--dtype", dtype)):
            if value is not None:
                raise ConfigError(
                    f"{flag} goes with --format hf (a Megatron checkpoint keeps the "
                    f"model's own dtype)"
                )
        return "fp32"
    if target is not None:
        raise ConfigError(
            "--target-* layouts go with --format megatron (an HF export has no parallel layout)"
        )
    check_hf_compatible(model)
    return dtype or "bf16"


def plan_extraction(
    ckpt_dir: str | Path,
    budget: float,
    out_dir: str | Path,
    interpolate: bool = False,
    target: tuple[int, int, int] | None = None,
    fmt: str = "megatron",
    dtype: str | None = None,
    quantize: str | None = None,
    max_shard_size: str | int | None = None,
    quant: QuantOptions | None = None,
) -> ExtractPlan:
    """Everything that can be wrong with the request, found before any weight is loaded."""
    meta = read_elastic_meta(ckpt_dir)
    cfg = config_from_dict(meta["config"], source=f"--ckpt {ckpt_dir}/{CHECKPOINT_META}")
    dtype = _check_format(fmt, dtype, quantize, target, cfg.model)
    if max_shard_size is not None and fmt != "hf":
        raise ConfigError("--max-shard-size goes with --format hf (safetensors shards)")
    shard_bytes = (
        DEFAULT_MAX_SHARD_BYTES if max_shard_size is None else parse_shard_size(max_shard_size)
    )
    budgets = trained_budgets(meta)
    trained = trained_listing(budgets)
    if not isinstance(budget, (int, float)) or not math.isfinite(budget):
        raise ConfigError(f"--budget {budget!r}: not a number; trained budgets: {trained}")
    match = match_budget(budget, budgets)
    choice = None
    if match is not None:
        raw = stored_choice(meta, match, ckpt_dir)
        choice = homogeneous_choice(raw, match) if fmt == "megatron" else raw
        budget = match
    elif not min(budgets) < budget < max(budgets):
        raise ConfigError(
            f"--budget {budget:g} is outside the trained range "
            f"[{min(budgets):g}, {max(budgets):g}]; trained budgets: {trained}"
        )
    elif not interpolate:
        raise ConfigError(
            f"--budget {budget:g} was not trained; trained budgets: {trained} "
            f"(pass --interpolate to let the router blend the two nearest)"
        )
    if target is not None and choice is not None:
        check_target_layout(model_for_choice(cfg.model, choice), *target, budget)
    quant = check_quant_options(meta, cfg.model, quantize, quant, choice, budget)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"--out {out}: exists and is not an empty directory (choose a new path; "
            f"nothing is overwritten)"
        )
    return ExtractPlan(
        Path(ckpt_dir),
        out,
        float(budget),
        meta,
        cfg.model,
        choice,
        target,
        fmt,
        dtype,
        quantize,
        shard_bytes,
        quant,
    )


def check_quant_options(
    meta: dict[str, Any],
    model: ModelConfig,
    quantize: str | None,
    quant: QuantOptions | None,
    choice: Mapping[str, Any] | None = None,
    budget: float | None = None,
) -> QuantOptions:
    """``quant`` checked against ``--quantize`` and the checkpoint: NVFP4 block alignment of
    every trained budget (and ``choice``, when it is known), the calibration data's presence."""
    quant = quant or QuantOptions()
    if quantize is None:
        if quant != QuantOptions():
            raise ConfigError(
                "--calib-samples / --calib-data / --nvfp4-unaligned go with --quantize"
            )
        return quant
    if quant.calib_samples < 0:
        raise ConfigError(f"--calib-samples {quant.calib_samples}: must be >= 0")
    if quant.calib_data is not None and not quant.calib_samples:
        raise ConfigError("--calib-data goes with --calib-samples N (N > 0)")
    if quant.calib_samples:
        from elastic_plugin.export.tokens import check_calibration_source

        check_calibration_source(meta, quant.calib_data)
    from elastic_plugin.checkpoint.meta import budget_label, stored_choices
    from elastic_plugin.export.quant_slicing import check_unaligned

    choices = dict(stored_choices(meta))
    if choice is not None and budget is not None:
        choices[budget_label(budget)] = dict(choice)
    check_unaligned(model, quantize, choices, quant.nvfp4_unaligned)
    return quant


# ------------------------------------------------------------------------------ the heavy part
def load_source(plan: ExtractPlan):
    """``(full model at TP=PP=EP=1, its checkpoint meta)`` (any source layout: dist checkpoints
    reshard). Load once, extract many: ``run_extraction(plan, source)``."""
    from elastic_plugin.checkpoint.io import build_from_checkpoint
    from elastic_plugin.parallel import Layout

    start_ranks(Layout(), one_process="extraction runs as one process")
    chunks, _, meta = build_from_checkpoint(plan.ckpt, Layout(), wrap_ddp=False)
    return chunks[0], meta


def _write_megatron(
    plan: ExtractPlan,
    full,
    source_meta: dict[str, Any],
    choice: dict[str, int],
    provenance: dict[str, Any],
) -> dict[str, Any]:
    from elastic_plugin.checkpoint.io import save_new_stage
    from elastic_plugin.checkpoint.layout import STRIDED_ATTR
    from elastic_plugin.nested.slicing import nested_state_dict
    from elastic_plugin.parallel import Layout, build_model_chunks

    small = model_for_choice(plan.model, choice)
    if plan.target is not None:
        check_target_layout(small, *plan.target, plan.budget)
    config = extracted_config(plan.meta, small, plan.target)
    state = nested_state_dict(full, plan.model, choice)
    plain = build_model_chunks(small, Layout(), wrap_ddp=False)[0][0]
    plain.load_state_dict(state, strict=True)
    del state
    # a prefix of an importance order is still importance-ordered (canonical on disk)
    setattr(plain, STRIDED_ATTR, bool(source_meta.get("reordered")))
    out_meta = {
        "kind": EXTRACTED_KIND,
        "config": config,
        "layout": dataclasses.asdict(Layout()),
        **provenance,
    }
    saved = save_new_stage(  # a stage directory, at the iteration it was extracted from
        [plain], plan.out, out_meta, iteration=int(source_meta.get("iteration", 0))
    )
    return {"out": str(saved.resolve()), "bytes": _dir_bytes(saved)}


def _write_hf(
    plan: ExtractPlan, full, choice: dict[str, Any], provenance: dict[str, Any]
) -> dict[str, Any]:
    from elastic_plugin.checkpoint.io import fresh_temporary, publish_directory
    from elastic_plugin.export.hf import (
        hf_config,
        megatron_to_hf,
        tokenizer_token_ids,
        write_hf_checkpoint,
    )
    from elastic_plugin.nested.slicing import nested_state_dict

    tensors = megatron_to_hf(nested_state_dict(full, plan.model, choice), plan.model)
    config = hf_config(
        tensors, plan.model, plan.dtype, tokenizer_token_ids(plan.meta.get("tokenizer"))
    )
    quant_config = None
    if plan.quantize is not None:
        tensors, quant_config = quantized_budget(plan, full, choice, tensors, config)
    tmp = fresh_temporary(plan.out)
    write_hf_checkpoint(
        tmp,
        tensors,
        config,
        plan.dtype,
        plan.meta.get("tokenizer"),
        quant_config,
        {
            EXPORT_META: {
                "kind": "hf",
                "dtype": plan.dtype,
                "quantize": plan.quantize,
                **({"quant": dataclasses.asdict(plan.quant)} if plan.quantize else {}),
                "model": dataclasses.asdict(plan.model),
                **provenance,
            }
        },
        max_shard_bytes=plan.max_shard_bytes,
    )
    publish_directory(tmp, plan.out)
    return {"out": str(plan.out.resolve()), "bytes": _dir_bytes(plan.out)}


def quantized_parent(plan: ExtractPlan, full, choices: Mapping[str, Any]):
    """The full model's HF tensors quantized once (``quant_slicing.quantize_nested``) so that
    every budget of ``choices`` is a cut of them; cached on ``full`` per format and choices,
    since an export run cuts several budgets from one parent."""
    import json

    from elastic_plugin.export.hf import megatron_to_hf
    from elastic_plugin.export.quant_slicing import quantize_nested
    from elastic_plugin.nested.slicing import nested_state_dict

    assert plan.quantize is not None
    key = (plan.quantize, plan.quant.nvfp4_unaligned, json.dumps(choices, sort_keys=True))
    cache = full.__dict__.setdefault("_elastic_quantized_parent", {})
    if key not in cache:
        cache.clear()  # one parent at a time: a 30B parent is large
        parent = megatron_to_hf(nested_state_dict(full, plan.model, {}), plan.model)
        cache[key] = quantize_nested(
            parent, plan.model, plan.quantize, choices, plan.quant.nvfp4_unaligned
        )
    return cache[key]


def calibrated_amax(
    plan: ExtractPlan, plain: Mapping[str, Any], config: Mapping[str, Any]
) -> dict[str, float]:
    """ModelOpt-calibrated input |x|max of every quantizable module of one budget's plain
    model (transformers, fp32) over ``plan.quant.calib_samples`` sequences."""
    import torch

    from elastic_plugin.export.calibrate import calibrate_input_amax
    from elastic_plugin.export.hf import build_hf_model
    from elastic_plugin.export.tokens import calibration_tokens

    assert plan.quantize is not None
    tokens = calibration_tokens(
        plan.meta, plan.quant.calib_samples, plan.quant.sequence_length(plan.meta),
        plan.quant.calib_data,
    )  # fmt: skip
    model = build_hf_model(config, plain, torch.float32, "the budget's model")
    return calibrate_input_amax(model, tokens[:, :-1].split(CALIB_BATCH), plan.quantize)


def quantized_budget(
    plan: ExtractPlan,
    full,
    choice: Mapping[str, Any],
    plain: Mapping[str, Any],
    config: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One budget's quantized tensors and ``hf_quant_config.json``: the quantized parent cut to
    ``choice`` (``plain``: the budget's unquantized HF tensors, ``config`` its config.json,
    which the calibration runs on)."""
    from elastic_plugin.checkpoint.meta import budget_label, stored_choices
    from elastic_plugin.export.quant_slicing import (
        slice_quant_config,
        slice_quantized_state,
        with_input_scales,
    )

    assert plan.quantize is not None
    choices = {**stored_choices(plan.meta), budget_label(plan.budget): dict(choice)}
    parent, parent_config = quantized_parent(plan, full, choices)
    tensors = slice_quantized_state(parent, plan.model, choice, plan.quantize)
    if plan.quant.calib_samples:
        tensors = with_input_scales(tensors, calibrated_amax(plan, plain, config), plan.quantize)
    return tensors, slice_quant_config(parent_config, tensors)


def _provenance(plan: ExtractPlan, choice: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "source": str(plan.ckpt),
        "budget": plan.budget,
        "interpolated": plan.choice is None,
        "choice": dict(choice),
        "params": nested_params(plan.meta, plan.model, choice, plan.ckpt),
        **{k: plan.meta[k] for k in ("data", "tokenizer") if k in plan.meta},
    }


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def run_extraction(plan: ExtractPlan, source=None) -> dict[str, Any]:
    """Load (unless ``source`` from :func:`load_source` is given), slice, write atomically (a
    Megatron checkpoint, or HF safetensors, optionally quantized). Returns the summary."""
    full, source_meta = source if source is not None else load_source(plan)
    interpolated = plan.choice is None
    choice = (
        interpolated_choice(plan.ckpt, plan.meta, plan.model, plan.budget)
        if plan.choice is None  # interpolated
        else plan.choice
    )
    if plan.fmt == "megatron" and interpolated:
        choice = homogeneous_choice(choice, plan.budget)
    provenance = _provenance(plan, choice)
    if plan.fmt == "megatron":
        written = _write_megatron(plan, full, source_meta, choice, provenance)
    else:
        written = _write_hf(plan, full, choice, provenance)
    return {
        **written,
        "format": plan.fmt,
        "dtype": plan.dtype,
        "quantize": plan.quantize,
        "budget": plan.budget,
        "interpolated": interpolated,
        "choice": choice,
        "params": provenance["params"],
    }


def extract_nested(
    ckpt_dir: str | Path,
    budget: float,
    out_dir: str | Path,
    interpolate: bool = False,
    target: tuple[int, int, int] | None = None,
    fmt: str = "megatron",
    dtype: str | None = None,
    quantize: str | None = None,
    quant: QuantOptions | None = None,
) -> dict[str, Any]:
    """Extract the nested model of ``budget`` from an elastic checkpoint into ``out_dir``.

    Single process (TP=PP=EP=1; the source may have any layout). A trained budget uses the
    stored choice table; an untrained one strictly inside the trained range needs
    ``interpolate=True`` (the router's choice). ``target=(tp, pp, ep)`` only checks that the
    extracted model splits that way (and becomes its config's default layout). Written to
    ``<out>.tmp`` and renamed to ``<out>`` at the end: an interrupted run leaves no ``<out>``.
    ``fmt="hf"`` writes the family's Hugging Face safetensors instead (per-layer widths allowed;
    ``dtype`` bf16/fp16/fp32, ``quantize`` "fp8"/"nvfp4" in ModelOpt's layout, made as
    ``quant`` says).
    Returns ``{"out", "format", "dtype", "quantize", "budget", "interpolated", "choice",
    "params": {"total", "active"}, "bytes"}``. Raises ``ConfigError`` for bad input (before
    loading anything when possible).
    """
    return run_extraction(
        plan_extraction(
            ckpt_dir, budget, out_dir, interpolate, target, fmt, dtype, quantize, quant=quant
        )
    )
