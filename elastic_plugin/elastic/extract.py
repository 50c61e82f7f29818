"""Zero-shot extraction: one nested model of an elastic checkpoint, saved as a plain smaller model.

The elastic checkpoint holds the full (importance-ordered) weights and the budget router. The
nested model of a budget is the router's hard choice for it (the stored choice table for trained
budgets; the router itself for an untrained budget in between, with ``interpolate=True``).
``slicing.sliced_state_dict`` cuts its weights out; they load strictly into the plain
``HybridModel`` of ``cost.model_for_choice``, which is written as an ordinary Megatron dist
checkpoint: any Megatron-Core code (any TP/PP/EP layout) loads it, nothing elastic is needed.

The input-checking half (``ExtractPlan``, ``plan_extraction``) imports no torch, so the CLI can
reject bad input in milliseconds; ``extract_nested`` does the heavy part.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from elastic_plugin.elastic.meta import CHECKPOINT_META, read_elastic_meta
from elastic_plugin.models.config import ConfigError, ModelConfig, config_from_dict

EXTRACTED_KIND = "extracted"
_TARGET_FLAGS = (("--target-tensor-model-parallel-size", "tp"),
                 ("--target-pipeline-model-parallel-size", "pp"),
                 ("--target-expert-model-parallel-size", "ep"))

__all__ = ["ExtractPlan", "plan_extraction", "extract_nested", "homogeneous_choice",
           "check_target_layout", "extracted_config", "read_elastic_meta"]


# ------------------------------------------------------------------------------ input checks



def _label(budget: float) -> str:
    return f"{budget:g}"  # = train.budget_label (that module imports torch)


def _trained_budget(budget: float, budgets: Sequence[float]) -> float | None:
    return next((b for b in budgets if math.isclose(b, budget, rel_tol=1e-9, abs_tol=1e-12)), None)


def homogeneous_choice(choice: Mapping[str, Any], budget: float) -> dict[str, int]:
    """One size per axis; per-layer lists must be uniform (plain Megatron builds every layer of
    a kind from one config, so per-layer widths cannot be a Megatron model)."""
    out: dict[str, int] = {}
    for axis, value in choice.items():
        if isinstance(value, (list, tuple)):
            if len(set(value)) != 1:
                raise ConfigError(
                    f"--budget {budget:g}: the nested model has per-layer sizes ({axis}={list(value)}); "
                    "plain Megatron-Core builds every layer of a kind alike, so it cannot hold this "
                    "model (export it per layer, e.g. to Hugging Face, instead)")
            value = value[0]
        out[axis] = int(value)
    return out


def check_target_layout(model: ModelConfig, tp: int, pp: int, ep: int, budget: float) -> None:
    """The extracted model must split under the target layout; the error names the flag."""
    for flag, key in _TARGET_FLAGS:
        size = {"tp": tp, "pp": pp, "ep": ep}[key]
        try:
            model.check_parallel(**{key: size})
        except ConfigError as exc:
            raise ConfigError(f"{flag} {size}: the extracted model (budget {budget:g}) does not "
                              f"split this way: {exc}") from None


def extracted_config(meta: Mapping[str, Any], model: ModelConfig,
                     target: tuple[int, int, int] | None) -> dict[str, Any]:
    """The source's experiment config with the reduced model and no elastic section. Its
    ``parallel:`` section (the default layout of later jobs) must divide the reduced model: the
    target layout when given, else the source's when it divides, else TP=PP=EP=1."""
    raw = {k: v for k, v in meta["config"].items() if k != "elastic"}
    parallel = dict(raw.get("parallel") or {})
    tp, pp, ep = target or (parallel.get("tensor_model_parallel_size", 1),
                            parallel.get("pipeline_model_parallel_size", 1),
                            parallel.get("expert_model_parallel_size", 1))
    try:
        model.check_parallel(tp, pp, ep)
    except ConfigError:
        tp, pp, ep = 1, 1, 1
    parallel.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                    expert_model_parallel_size=ep)
    if tp == 1:
        parallel["sequence_parallel"] = False
    elif model.count("moe"):
        parallel["sequence_parallel"] = True  # Megatron-Core needs it for MoE under TP
    out = {**raw, "model": dataclasses.asdict(model), "parallel": parallel}
    config_from_dict(out, source="extracted config")  # it must be loadable as it is written
    return out


@dataclass
class ExtractPlan:
    """A checked extraction: what to load, which budget, and the choice when it is known up
    front (trained budgets; an interpolated budget's choice needs the router)."""

    ckpt: Path
    out: Path
    budget: float
    meta: dict[str, Any]
    model: ModelConfig                  # the full (elastic) model
    choice: dict[str, int] | None       # None: ask the router (interpolated budget)
    target: tuple[int, int, int] | None


def plan_extraction(ckpt_dir: str | Path, budget: float, out_dir: str | Path,
                    interpolate: bool = False,
                    target: tuple[int, int, int] | None = None) -> ExtractPlan:
    """Everything that can be wrong with the request, found without torch."""
    meta = read_elastic_meta(ckpt_dir)
    cfg = config_from_dict(meta["config"], source=f"--ckpt {ckpt_dir}/{CHECKPOINT_META}")
    budgets = [float(b) for b in meta["elastic"]["budgets"]]
    trained = ", ".join(_label(b) for b in budgets)
    if not isinstance(budget, (int, float)) or not math.isfinite(budget):
        raise ConfigError(f"--budget {budget!r}: not a number; trained budgets: {trained}")
    match = _trained_budget(budget, budgets)
    choice = None
    if match is not None:
        raw = meta["elastic"]["choices"].get(_label(match))
        if raw is None:
            raise ConfigError(f"--ckpt {ckpt_dir}: no stored choice for budget {_label(match)}")
        choice = homogeneous_choice(raw, match)
        budget = match
    elif not min(budgets) < budget < max(budgets):
        raise ConfigError(f"--budget {budget:g} is outside the trained range "
                          f"[{min(budgets):g}, {max(budgets):g}]; trained budgets: {trained}")
    elif not interpolate:
        raise ConfigError(f"--budget {budget:g} was not trained; trained budgets: {trained} "
                          f"(pass --interpolate to let the router blend the two nearest)")
    if target is not None and choice is not None:
        from elastic_plugin.elastic.cost import model_for_choice  # imports torch, not Megatron

        check_target_layout(model_for_choice(cfg.model, choice), *target, budget)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not an empty directory (choose a new path; "
                          f"nothing is overwritten)")
    return ExtractPlan(Path(ckpt_dir), out, float(budget), meta, cfg.model, choice, target)


# ------------------------------------------------------------------------------ the heavy part
def _interpolated_choice(plan: ExtractPlan) -> dict[str, Any]:
    """The trained router's hard choice for an untrained budget (candidates as trained)."""
    import torch

    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.model import ROUTER_ATTR, RouterModule, load_router, make_router

    layout = plan.meta.get("layout") or {}
    ecfg = ElasticConfig.from_dict(plan.meta["config"]["elastic"],
                                   source=f"{plan.ckpt}/{CHECKPOINT_META}")
    resolved = ecfg.resolve(plan.model, int(layout.get("tp", 1)), int(layout.get("ep", 1)))
    holder = torch.nn.Module()
    holder.add_module(ROUTER_ATTR, RouterModule(make_router(resolved)))
    load_router(holder, plan.ckpt)
    router = holder.get_submodule(ROUTER_ATTR).router
    with torch.no_grad():
        picks = router.choose(plan.budget, interpolate=True)
    choice: dict[str, Any] = {}
    for name, spec in resolved.axes.items():
        sizes = [spec.candidates[i] for i in picks[name]]
        choice[name] = sizes if resolved.per_layer(name) else sizes[0]
    return choice


def _require_single_process() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() != 1:
        raise ConfigError(f"extraction runs as one process; got a world of "
                          f"{dist.get_world_size()} ranks (run it without torchrun)")


def run_extraction(plan: ExtractPlan) -> dict[str, Any]:
    """Load, slice, build the plain model, load strictly, save atomically. Returns the summary."""
    from elastic_plugin.compat import enable_cpu_megatron

    enable_cpu_megatron()
    import torch

    from elastic_plugin.checkpointing import build_from_checkpoint, save_checkpoint
    from elastic_plugin.elastic.cost import model_for_choice
    from elastic_plugin.elastic.slicing import sliced_state_dict
    from elastic_plugin.importance.reorder import STRIDED_ATTR, canonical_weights
    from elastic_plugin.models.counting import count_parameters
    from elastic_plugin.parallel import Layout, build_model_chunks, init_distributed, \
        initialize_layout

    init_distributed()
    _require_single_process()
    initialize_layout(Layout())
    interpolated = plan.choice is None
    choice = (homogeneous_choice(_interpolated_choice(plan), plan.budget) if interpolated
              else plan.choice)
    small = model_for_choice(plan.model, choice)
    if plan.target is not None:
        check_target_layout(small, *plan.target, plan.budget)
    config = extracted_config(plan.meta, small, plan.target)
    # the full model at TP=PP=EP=1 (any source layout: dist checkpoints reshard)
    chunks, _, meta = build_from_checkpoint(plan.ckpt, Layout(), wrap_ddp=False)
    full = chunks[0]
    with canonical_weights(full), torch.no_grad():
        state = sliced_state_dict(full, plan.model, choice)
    del chunks, full
    plain = build_model_chunks(small, Layout(), wrap_ddp=False)[0][0]
    plain.load_state_dict(state, strict=True)
    del state
    # a prefix of an importance order is still importance-ordered (canonical on disk)
    setattr(plain, STRIDED_ATTR, bool(meta.get("reordered")))
    counts = count_parameters(small)
    out_meta = {
        "kind": EXTRACTED_KIND,
        "config": config,
        "layout": dataclasses.asdict(Layout()),
        "source": str(plan.ckpt),
        "budget": plan.budget,
        "interpolated": interpolated,
        "choice": choice,
        "params": {"total": counts.total, "active": counts.active},
        **{k: plan.meta[k] for k in ("data", "tokenizer") if k in plan.meta},
    }
    saved = save_checkpoint([plain], plan.out, out_meta)
    size = sum(p.stat().st_size for p in saved.rglob("*") if p.is_file())
    return {"out": str(saved.resolve()), "budget": plan.budget, "interpolated": interpolated,
            "choice": choice, "params": out_meta["params"], "bytes": size}


def extract_nested(ckpt_dir: str | Path, budget: float, out_dir: str | Path,
                   interpolate: bool = False,
                   target: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """Extract the nested model of ``budget`` from an elastic checkpoint into ``out_dir``.

    Single process (TP=PP=EP=1; the source may have any layout). A trained budget uses the
    stored choice table; an untrained one strictly inside the trained range needs
    ``interpolate=True`` (the router's choice). ``target=(tp, pp, ep)`` only checks that the
    extracted model splits that way (and becomes its config's default layout). Written to
    ``<out>.tmp`` and renamed to ``<out>`` at the end: an interrupted run leaves no ``<out>``.
    Returns ``{"out", "budget", "interpolated", "choice", "params": {"total", "active"},
    "bytes"}``. Raises ``ConfigError`` for bad input (before loading anything when possible).
    """
    return run_extraction(plan_extraction(ckpt_dir, budget, out_dir, interpolate, target))
