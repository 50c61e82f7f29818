"""Rank-pool cases for importance tests: single-rank reference, REAP by direct computation,
and the same collection under TP/PP/EP layouts from the same weights and data."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from elastic_plugin.importance import ImportanceScores, collect_importance
from elastic_plugin.parallel import Layout, build_model_chunks, initialize_layout
from tests.support.equivalence import (
    NUM_MICROBATCHES,
    REF_MICRO_BATCH,
    SEQ_LEN,
    dp_shard,
    load_dist,
    reference_batches,
    save_dist,
    tiny_model,
)

if TYPE_CHECKING:  # Megatron ships no types: this annotates what a function takes
    from megatron.core.models.hybrid.hybrid_model import HybridModel

NUM_SAMPLES = REF_MICRO_BATCH * NUM_MICROBATCHES


def _dp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size()


def reference_importance(config_path: str, workdir: str, seed: int = 1234) -> dict[str, Any]:
    """One rank: save the initial weights, collect scores, and compute REAP directly."""
    work = Path(workdir)
    model_cfg = tiny_model(config_path)
    initialize_layout(Layout(), seed=seed)
    (model,), _ = build_model_chunks(model_cfg, Layout(), wrap_ddp=False)
    save_dist(model, work / "init")
    captured = _capture_router_io(model)
    scores = collect_importance(
        [model],
        dp_shard(reference_batches(model_cfg)),
        NUM_SAMPLES,
        SEQ_LEN,
        REF_MICRO_BATCH,
        progress=False,
    )
    for handle in captured.pop("_handles"):
        handle.remove()
    scores.save(work / "scores_ref.pt")
    direct = _reap_direct(model, captured)
    return {
        "direct_reap": direct,
        "collected_reap": {k: v.tolist() for k, v in scores.experts.items()},
        "axes": scores.axes(),
        "tokens": scores.tokens,
    }


def _capture_router_io(model: HybridModel) -> dict[int | str, Any]:
    """Record every MoE router's input tokens and its (probs, routing_map)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    captured: dict[int | str, Any] = {"_handles": []}  # layer number -> records
    for layer in model.decoder.layers:
        moe = getattr(layer, "mlp", None)
        if not isinstance(moe, MoELayer):
            continue
        number = int(layer.layer_number)
        captured[number] = []

        def hook(_m, args, out, number=number):
            probs, routing_map = out
            tokens = args[0].reshape(-1, args[0].shape[-1])
            captured[number].append(
                (tokens.detach().clone(), probs.detach().clone(), routing_map.detach().clone())
            )

        captured["_handles"].append(moe.router.register_forward_hook(hook))
    return captured


@torch.no_grad()
def _reference_model(config_path: str, work: Path):
    """One rank, the reference's initial weights: (model config, model)."""
    model_cfg = tiny_model(config_path)
    initialize_layout(Layout())
    (model,), _ = build_model_chunks(model_cfg, Layout(), wrap_ddp=False)
    load_dist(model, work / "init")
    return model_cfg, model


def _reap_direct(model: HybridModel, captured: dict[int | str, Any]) -> dict[int, list[float]]:
    """REAP from the formula: mean over routed tokens of g_j(x) * ||f_j(x)||_2, f_j un-weighted."""
    out: dict[int, list[float]] = {}
    for layer in model.decoder.layers:
        number = int(layer.layer_number)
        if number not in captured:
            continue
        experts = layer.mlp.experts.local_experts
        total = torch.zeros(len(experts), dtype=torch.float64)
        count = torch.zeros(len(experts), dtype=torch.float64)
        for tokens, probs, routing_map in captured[number]:
            for j, expert in enumerate(experts):
                rows = routing_map[:, j].nonzero().squeeze(-1)
                if rows.numel() == 0:
                    continue
                x = tokens[rows]
                f, _ = expert(x, torch.ones(x.shape[0], dtype=x.dtype))
                total[j] += (probs[rows, j].double() * f.double().norm(dim=-1)).sum()
                count[j] += rows.numel()
        out[number] = (total / count.clamp(min=1)).tolist()
    return out


def layout_importance(
    config_path: str,
    workdir: str,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
    seed: int = 1234,
    cp: int = 1,
) -> dict[str, Any]:
    """Collect under a layout from the reference's weights; compare with the reference file."""
    from elastic_plugin.importance import rankings_agree

    work = Path(workdir)
    model_cfg = tiny_model(config_path)
    layout = Layout(tp, pp, ep, sequence_parallel, cp=cp)
    initialize_layout(layout, seed=seed + 3)
    (model,), _ = build_model_chunks(model_cfg, layout, wrap_ddp=False)
    load_dist(model, work / "init")
    dp = _dp_size()
    scores = collect_importance(
        [model],
        dp_shard(reference_batches(model_cfg)),
        NUM_SAMPLES // dp,
        SEQ_LEN,
        REF_MICRO_BATCH // dp,
        progress=False,
    )
    reference = ImportanceScores.load(work / "scores_ref.pt")
    report: dict[str, Any] = {
        "axes": scores.axes(),
        "tokens": scores.tokens,
        "max_rel_diff": {},
        "rankings_agree": {},
    }
    for axis in reference.axes() + ["mamba_out"]:
        ours, ref = getattr(scores, axis), getattr(reference, axis)
        pairs = (
            [(0, ours, ref)]
            if axis == "embedding"
            else [(layer, ours[layer], ref[layer]) for layer in ref]
        )
        worst, agree = 0.0, True
        for _, a, b in pairs:
            scale = b.abs().max().clamp(min=1e-30)
            worst = max(worst, float((a - b).abs().max() / scale))
            mamba = axis in ("mamba", "mamba_out")
            flat_a, flat_b = (a.sum(1), b.sum(1)) if mamba else (a, b)
            agree &= rankings_agree(flat_a, flat_b)
            if mamba:
                agree &= rankings_agree(a.sum(0), b.sum(0))
        report["max_rel_diff"][axis] = worst
        report["rankings_agree"][axis] = agree
    for key, layers in reference.variants.items():  # the statistics --method can select
        worst, agree = 0.0, True
        for layer, b in layers.items():
            a = scores.variants[key][layer]
            worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)))
            agree &= rankings_agree(a.reshape(-1), b.reshape(-1))
        report["max_rel_diff"][key] = worst
        report["rankings_agree"][key] = agree
    return report


class _Interrupt(RuntimeError):
    pass


def _failing_after(iterator, n: int):
    for i, item in enumerate(iterator):
        if i == n:
            raise _Interrupt(f"simulated failure after {n} batches")
        yield item


def resume_after_interruption(config_path: str, workdir: str) -> dict[str, Any]:
    """Collect with a failure half-way, rerun with the same resume dir: the result must equal an
    uninterrupted collection; the partial file must be gone afterwards."""
    work = Path(workdir)
    model_cfg, model = _reference_model(config_path, work)
    batches = reference_batches(model_cfg)
    args: dict[str, Any] = dict(
        num_samples=NUM_SAMPLES,
        seq_length=SEQ_LEN,
        micro_batch_size=REF_MICRO_BATCH,
        progress=False,
    )
    full = collect_importance([model], iter(batches), **args)
    resume = work / "resume"
    interrupted = False
    try:
        collect_importance(
            [model], _failing_after(iter(batches), 1), resume_dir=resume, save_every=1, **args
        )
    except _Interrupt:
        interrupted = True
    partial_left = sorted(p.name for p in resume.glob("partial_*"))
    resumed = collect_importance([model], iter(batches), resume_dir=resume, save_every=1, **args)
    equal = all(
        torch.equal(getattr(full, a)[k], getattr(resumed, a)[k])
        for a in ("ffn", "attention_heads", "mamba", "mamba_out", "experts")
        for k in getattr(full, a)
    )
    assert full.embedding is not None and resumed.embedding is not None  # all axes collected
    return {
        "interrupted": interrupted,
        "partial_files": partial_left,
        "equal": equal and torch.equal(full.embedding, resumed.embedding),
        "tokens": (full.tokens, resumed.tokens),
        "left_after": sorted(p.name for p in resume.glob("partial_*")),
        "hooks_left": sum(
            len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()
        ),
    }


def bad_axis_errors(config_path: str) -> list[str]:
    """Axis checks happen before any forward pass."""
    model_cfg = tiny_model(config_path, pattern="M*-M*-")  # no MoE layers
    initialize_layout(Layout())
    (model,), _ = build_model_chunks(model_cfg, Layout(), wrap_ddp=False)
    messages = []
    for axes in (["experts"], ["bogus"]):
        try:
            collect_importance(
                [model], iter([]), NUM_SAMPLES, SEQ_LEN, REF_MICRO_BATCH, axes=axes, progress=False
            )
        except ValueError as exc:
            messages.append(str(exc))
    try:
        collect_importance(
            [model],
            iter(reference_batches(model_cfg)[:1]),
            NUM_SAMPLES,
            SEQ_LEN,
            REF_MICRO_BATCH,
            progress=False,
        )
    except ValueError as exc:
        messages.append(str(exc))
    return messages


@torch.no_grad()
def depth_check(
    config_path: str, workdir: str, tp: int = 1, pp: int = 1, sequence_parallel: bool = False
) -> dict[str, Any]:
    """Depth scores under a layout; on one rank also the formula computed by removing a layer."""
    from megatron.core import parallel_state as ps

    from elastic_plugin.importance.depth import depth_scores

    work = Path(workdir)
    model_cfg = tiny_model(config_path)
    initialize_layout(Layout(tp, pp, 1, sequence_parallel))
    (model,), _ = build_model_chunks(
        model_cfg, Layout(tp, pp, 1, sequence_parallel), wrap_ddp=False
    )
    load_dist(model, work / "init")
    batch = reference_batches(model_cfg)[0]
    reads = ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()
    scores = depth_scores([model], [batch] if reads else [], SEQ_LEN, REF_MICRO_BATCH)
    direct = None
    if tp == 1 and pp == 1:
        model.eval()
        tokens = batch["tokens"]
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        full = model(tokens, positions, None).double()
        layers = model.decoder.layers
        removed = layers[2]  # an attention layer
        del layers[2]
        without = model(tokens, positions, None).double()
        layers.insert(2, removed)
        direct = float((without - full).pow(2).sum() / full.pow(2).sum())
    return {"scores": scores, "direct_layer3": direct}


@torch.no_grad()
def prune_masks(config_path: str, workdir: str) -> dict[str, Any]:
    """Masked pruning: keep=1 is the identity for every axis; keep=1/2 changes the logits; for a
    dense MLP the masked output equals the MLP computed from the sliced weights."""
    from elastic_plugin.importance.prune import PRUNABLE, magnitude_orders, mask_prune

    work = Path(workdir)
    model_cfg, model = _reference_model(config_path, work)
    model.eval()
    tokens = reference_batches(model_cfg)[0]["tokens"]
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    base = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    full = model(tokens, positions, None)
    report: dict[str, Any] = {"identity": {}, "changed": {}}
    for axis in PRUNABLE:
        orders = magnitude_orders(model, axis)
        model.load_state_dict(base, strict=False)
        mask_prune(model, axis, orders, 1.0)
        report["identity"][axis] = float((model(tokens, positions, None) - full).abs().max())
        model.load_state_dict(base, strict=False)
        mask_prune(model, axis, orders, 0.5)
        report["changed"][axis] = float((model(tokens, positions, None) - full).abs().max())
    model.load_state_dict(base, strict=False)
    mlp_layer = next(layer for layer in model.decoder.layers if type(layer).__name__ == "MLPLayer")
    mlp = mlp_layer.mlp
    x = torch.randn(5, 2, model_cfg.hidden_size)
    order = magnitude_orders(model, "ffn")[int(mlp_layer.layer_number)]
    keep = order[: order.numel() // 2]
    w1, w2 = mlp.linear_fc1.weight[keep], mlp.linear_fc2.weight[:, keep]
    sliced = mlp.config.activation_func(x @ w1.T) @ w2.T
    mask_prune(model, "ffn", {int(mlp_layer.layer_number): order}, 0.5)
    masked, _ = mlp(x)
    report["ffn_mask_vs_slice"] = float((masked - sliced).abs().max())
    return report


def _residual_norms(model: HybridModel) -> list[torch.nn.Module]:
    """Every norm that reads the residual stream (not the Mamba mixer's gated norm)."""
    names = ("norm", "input_layernorm", "pre_mlp_layernorm", "final_norm")
    return [
        module
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in names
        and "mixer" not in name
        and isinstance(getattr(module, "weight", None), torch.Tensor)
    ]


@torch.no_grad()
def variant_statistics(config_path: str, workdir: str) -> dict[str, Any]:
    """The alternative statistics against formulas computed here: inputs and outputs captured by
    this function's own hooks, per-head contributions by running the real output projection
    on inputs with every other head zeroed."""
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.moe.moe_layer import MoELayer

    work = Path(workdir)
    model_cfg, model = _reference_model(config_path, work)
    seen: dict[str, list] = {"norm_in": [], "norm_out": []}
    handles = []

    def keep(key: str, module: torch.nn.Module, pre: bool = True) -> None:
        seen[key] = []

        def grab(_m, args, out=None):
            seen[key].append((args[0] if pre else out).detach().clone())

        handles.append(
            module.register_forward_pre_hook(grab) if pre else module.register_forward_hook(grab)
        )

    def grab_norm(_m, args, out) -> None:  # a hook returning a value would replace the output
        seen["norm_in"].append(args[0].detach().clone())
        seen["norm_out"].append(out.detach().clone())

    handles += [norm.register_forward_hook(grab_norm) for norm in _residual_norms(model)]
    projections: dict[str, torch.nn.Module] = {}
    for layer in model.decoder.layers:
        n = int(layer.layer_number)
        if isinstance(layer, MambaLayer):
            keep(f"mamba_heads_out/{n}", layer.mixer.out_proj)
            projections[f"mamba_heads_out/{n}"] = layer.mixer.out_proj
            continue
        if hasattr(layer.self_attention, "linear_proj"):
            keep(f"attention_heads_out/{n}", layer.self_attention.linear_proj)
            projections[f"attention_heads_out/{n}"] = layer.self_attention.linear_proj
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, MoELayer):
            keep(f"shared_ffn_sq/{n}", mlp.shared_experts.linear_fc2)
        elif mlp is not None and hasattr(mlp, "linear_fc2"):
            keep(f"ffn_sq/{n}", mlp.linear_fc2)
    scores = collect_importance(
        [model],
        iter(reference_batches(model_cfg)),
        NUM_SAMPLES,
        SEQ_LEN,
        REF_MICRO_BATCH,
        progress=False,
    )
    for handle in handles:
        handle.remove()

    def sq(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([x.double().reshape(-1, x.shape[-1]).pow(2).sum(0) for x in xs]).sum(0)

    direct: dict[str, torch.Tensor] = {
        "embedding_in/0": sq(seen["norm_in"]),
        "embedding_sq/0": sq(seen["norm_out"]),
    }
    for key, xs in seen.items():
        if key.startswith(("ffn_sq", "shared_ffn_sq")):
            direct[key] = sq(xs)
        elif key in projections:
            proj = projections[key]
            head_dim = model_cfg.kv_channels if key.startswith("attention") else None
            head_dim = head_dim or model_cfg.mamba_head_dim
            width = xs[0].shape[-1]
            total = torch.zeros(width // head_dim, dtype=torch.float64)
            for x in xs:
                for h in range(width // head_dim):
                    only = torch.zeros_like(x)
                    only[..., h * head_dim : (h + 1) * head_dim] = x[
                        ..., h * head_dim : (h + 1) * head_dim
                    ]
                    out, _ = proj(only)
                    total[h] += out.double().reshape(-1, out.shape[-1]).norm(dim=-1).sum()
            direct[key] = total
    direct.update(_weight_formulas(model, model_cfg))
    diffs = {}
    for key, value in direct.items():
        name, layer = key.split("/")
        got = scores.variants[name][int(layer)]
        diffs[key] = float((got - value).abs().max() / value.abs().max().clamp(min=1e-30))
    return {"rel_diff": diffs, "variants": sorted(scores.variants)}


def _weight_formulas(model: HybridModel, cfg) -> dict[str, torch.Tensor]:
    """Sums of squares of the weights that write each unit, slice by slice."""
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.moe.moe_layer import MoELayer

    out = {"embedding_weight/0": model.embedding.word_embeddings.weight.double().pow(2).sum(0)}
    for layer in model.decoder.layers:
        n = int(layer.layer_number)
        if isinstance(layer, MambaLayer):
            w, p = layer.mixer.in_proj.weight.double(), cfg.mamba_head_dim
            d_inner = cfg.mamba_num_heads * p
            out[f"mamba_weight/{n}"] = torch.tensor(
                [
                    [float(w[d_inner + h * p + c].pow(2).sum()) for c in range(p)]
                    for h in range(cfg.mamba_num_heads)
                ],
                dtype=torch.float64,
            )
            continue
        if hasattr(layer.self_attention, "linear_proj"):
            w, d = layer.self_attention.linear_proj.weight.double(), cfg.kv_channels
            out[f"attention_heads_weight/{n}"] = torch.stack(
                [w[:, h * d : (h + 1) * d].pow(2).sum() for h in range(cfg.num_attention_heads)]
            )
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, MoELayer):
            out[f"experts_weight/{n}"] = torch.stack(
                [e.linear_fc1.weight.double().pow(2).sum() for e in mlp.experts.local_experts]
            )
            fc1 = mlp.shared_experts.linear_fc1.weight.double()
            out[f"shared_ffn_weight/{n}"] = torch.stack([row.pow(2).sum() for row in fc1])
        elif mlp is not None and hasattr(mlp, "linear_fc1"):
            out[f"ffn_weight/{n}"] = torch.stack(
                [row.pow(2).sum() for row in mlp.linear_fc1.weight.double()]
            )
    return out


def ablation_smoke(config_path: str, workdir: str) -> dict[str, Any]:
    """The ablation on a tiny model: every order of one axis zero-shot and recovered; pruned
    units stay pruned through recovery; the weights are restored afterwards."""
    from elastic_plugin.importance.ablation import AblationSettings, recover, run_axis
    from elastic_plugin.importance.prune import importance_orders, mask_prune
    from elastic_plugin.training.step import eval_step

    work = Path(workdir)
    model_cfg, model = _reference_model(config_path, work)
    batches = reference_batches(model_cfg)
    scores = collect_importance(
        [model], iter(batches), NUM_SAMPLES, SEQ_LEN, REF_MICRO_BATCH, progress=False
    )
    before = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}

    def evaluate(m) -> float:
        loss = eval_step([m], iter(batches), len(batches), SEQ_LEN, REF_MICRO_BATCH)
        assert loss is not None  # one rank: the last pipeline stage
        return loss

    settings = AblationSettings(seeds=2, recovery_steps=2, recovery_lr=1e-2)
    results = {}
    for axis in ("ffn", "experts"):
        res = run_axis(
            model,
            scores,
            axis,
            model_cfg.query_groups,
            model_cfg.mamba_num_groups,
            evaluate,
            batches,
            settings,
        )
        assert res is not None
        results[axis] = res.summary()
    restored = all(torch.equal(v, before[k]) for k, v in model.state_dict().items() if k in before)
    # recovery by hand on one order: the dropped FFN neurons' weights stay zero, others move
    order = importance_orders(scores, "ffn", model_cfg.query_groups, model_cfg.mamba_num_groups)
    mask_prune(model, "ffn", order, 0.5)
    layer = next(iter(order))
    fc1 = next(lyr for lyr in model.decoder.layers if int(lyr.layer_number) == layer).mlp.linear_fc1
    dropped = order[layer][order[layer].numel() // 2 :]
    kept_before = fc1.weight[order[layer][: order[layer].numel() // 2]].clone()
    recover(model, batches, before, lr=1e-2)
    return {
        "results": results,
        "restored": restored,
        "dropped_still_zero": bool((fc1.weight[dropped] == 0).all()),
        "kept_moved": float(
            (fc1.weight[order[layer][: order[layer].numel() // 2]] - kept_before).abs().max()
        ),
    }
