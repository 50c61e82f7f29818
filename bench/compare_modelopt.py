"""Compare our importance scores with NVIDIA ModelOpt's Minitron importance (TP=PP=EP=1, CPU).

    .venv/bin/python bench/compare_modelopt.py [--ckpt DIR] [--data DIR] [--num-batches N]
        [--micro-batch-size B] [--seq-length S] [--seed K] [--json PATH]

Both scorers see the same calibration batches: ours through ``collect_importance`` on the plain
model, then ModelOpt's own hooks (``ImportanceEstimatorRegistry`` of
``modelopt/torch/prune/plugins/mcore_minitron.py``) on the same model converted to its dynamic
search space (``mcore_minitron`` mode), made to run without TE by
``tests.support.modelopt_compat``. The LM loss of both passes is printed: equal losses
show the conversion did not change the forward. Per axis the script prints Spearman rank
correlation (mean and min over layers) and top-50% overlap, and how the two definitions differ.

A standalone script (not a ``bench_*.py`` module), so ``make bench`` does not need ModelOpt, which
is an optional tool: ``pip install --no-deps nvidia-modelopt`` plus the packages its import needs
(requests, omegaconf, pydantic, pulp<4, scipy, regex), without changing torch / megatron-core.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_CONFIG = REPO / "examples" / "configs" / "tiny.yaml"

# What differs between the two definitions, per axis (printed under the table).
NOTES: dict[str, str] = {
    "embedding": (
        "ours: sum over all residual norms (incl. the final norm) and tokens of |norm out|; "
        "ModelOpt (_register_hidden_size_importance): per norm sqrt(sum_seqs (mean_tokens |x|)^2), "
        "then summed over norms, final norm NOT hooked; per-norm sqrt before summing."
    ),
    "ffn": (
        "ours: sum_tokens |fc2 input| (L1); ModelOpt (_register_mlp_importance): "
        "sqrt(sum_seqs (mean_tokens |fc2 input|)^2) (L2 over sequences of per-sequence means)."
    ),
    "shared_ffn": "same formulas as ffn (ModelOpt treats SharedExpertMLP as a _DynamicMLP).",
    "attention_heads": (
        "ours: sum_tokens ||head slice of linear_proj input||_2; ModelOpt "
        "(_register_self_attention_importance): per channel sqrt(sum_seqs (mean_tokens |x|)^2), "
        "then L2 over the head's kv channels; ModelOpt only ranks heads WITHIN a query group "
        "(returns an order, not scores) - see the 'grp' columns."
    ),
    "mamba_heads": (
        "ours: sqrt(sum_tokens,channels s^2) (s = x part of in_proj out); ModelOpt "
        "(_register_mamba_mixer_importance): per channel c=sqrt(sum_seqs (mean_tokens |s|)^2), head = "
        "L2 of c over its (kept) channels, ranked WITHIN a Mamba group - see the 'grp' columns. Both are an L2 over sequences and channels of a per-sequence statistic: RMS over tokens (ours) vs mean |s| over tokens (ModelOpt); heads with spikier s rank higher in ours."
    ),
    "mamba_channels": (
        "ours: sqrt(sum_tokens,heads s^2); ModelOpt: L2 over heads of c (as above); the "
        "head-channel ranking is shared by all heads in both."
    ),
    "experts": (
        "ours: REAP = mean over routed tokens of g_j(x)*||f_j(x)||_2; ModelOpt "
        "(_register_sequential_mlp_importance): mean over routed tokens of ||SequentialMLP output||_2, "
        "and Megatron applies the router prob before fc2, so that output IS g_j(x) f_j(x): the same "
        "quantity (float32 vs float64 accumulation, +1e-8 vs clamp in the division)."
    ),
}


# ----------------------------------------------------------------------------- statistics
def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks, ties share their mean rank (as Spearman's rho needs)."""
    x = x.double().flatten()
    order = torch.argsort(x, stable=True)
    ranks = torch.empty_like(x)
    sorted_x = x[order]
    i, n = 0, x.numel()
    while i < n:
        j = i
        while j + 1 < n and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rho (Pearson correlation of average ranks); NaN if either side is constant."""
    if a.numel() != b.numel():
        raise ValueError(f"spearman: sizes differ ({a.numel()} vs {b.numel()})")
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / denom if denom > 0 else math.nan


def top_overlap(a: torch.Tensor, b: torch.Tensor, frac: float = 0.5) -> float:
    """|top-k(a) & top-k(b)| / k for k = max(1, round(frac * n))."""
    k = max(1, round(frac * a.numel()))
    top_a = set(torch.argsort(a.double().flatten(), descending=True, stable=True)[:k].tolist())
    top_b = set(torch.argsort(b.double().flatten(), descending=True, stable=True)[:k].tolist())
    return len(top_a & top_b) / k


def in_group_agreement(a: torch.Tensor, b: torch.Tensor, groups: int) -> tuple[float, float]:
    """ModelOpt's view (it ranks heads only within a group): the fraction of groups with the
    identical descending order, and the mean top-half overlap within a group (heads kept when
    halving every group)."""
    ga, gb = a.reshape(groups, -1), b.reshape(groups, -1)
    same = [
        torch.equal(
            torch.argsort(ga[g], descending=True, stable=True),
            torch.argsort(gb[g], descending=True, stable=True),
        )
        for g in range(groups)
    ]
    kept = [top_overlap(ga[g], gb[g]) for g in range(groups)]
    return sum(same) / groups, sum(kept) / groups


# ------------------------------------------------------------------------------ model/data
def _load_checkpoint_fn() -> tuple[Callable, Callable]:
    try:
        from elastic_plugin.checkpoint.io import load_checkpoint
        from elastic_plugin.checkpoint.meta import read_checkpoint_meta
    except ImportError:  # older layout
        from elastic_plugin.training.teacher import load_checkpoint

        def read_checkpoint_meta(ckpt_dir):  # checkpoints from before history (iter_*) existed
            return json.loads((Path(ckpt_dir) / "elastic_meta.json").read_text())

    return load_checkpoint, read_checkpoint_meta


def build_model(args: argparse.Namespace):
    """Tiny (or the checkpoint's) HybridModel at TP=PP=EP=1, random init or loaded."""
    from elastic_plugin.models.config import config_from_dict, load_config
    from elastic_plugin.parallel import Layout, build_model_chunks, initialize_layout

    initialize_layout(Layout(), seed=args.seed)
    meta = None
    if args.ckpt:
        load_checkpoint, read_checkpoint_meta = _load_checkpoint_fn()
        meta = read_checkpoint_meta(args.ckpt)
        cfg = config_from_dict(meta["config"], source=f"{args.ckpt}/elastic_meta.json")
    else:
        cfg = load_config(args.config)
    (model,), _ = build_model_chunks(cfg.model, Layout(), wrap_ddp=False)
    if args.ckpt:
        load_checkpoint([model], args.ckpt)
    return model, cfg, meta


def calibration_batches(args: argparse.Namespace, vocab_size: int) -> list[dict[str, torch.Tensor]]:
    """The same micro-batches for both scorers: prepared data if ``--data``, else random tokens."""
    mbs, seq = args.micro_batch_size, args.seq_length
    if args.data:
        from elastic_plugin.data.indexed import batch_iterator
        from elastic_plugin.data.prepare import PreparedData

        prepared = PreparedData.load(args.data)
        datasets = prepared.build_datasets(
            seq, num_samples=(args.num_batches * mbs, None, None), seed=args.seed
        )
        it = batch_iterator(datasets.train, mbs, seed=args.seed, shuffle=True)
        keep = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
        return [
            {k: v for k, v in next(it).items() if k in keep and v is not None}
            for _ in range(args.num_batches)
        ]
    gen = torch.Generator().manual_seed(args.seed + 1)
    batches = []
    for _ in range(args.num_batches):
        seqs = torch.randint(0, vocab_size, (mbs, seq + 1), generator=gen)
        batches.append(
            {
                "tokens": seqs[:, :-1].contiguous(),
                "labels": seqs[:, 1:].contiguous(),
                "loss_mask": torch.ones(mbs, seq),
            }
        )
    return batches


@torch.no_grad()
def mean_loss(model, batches, seq: int, mbs: int) -> float:
    from elastic_plugin.training.step import reduce_loss_reports, run_schedule

    model.eval()
    reports = run_schedule([model], iter(batches), len(batches), seq, mbs, forward_only=True)
    model.train()
    return float(reduce_loss_reports(reports))


# ---------------------------------------------------------------------------- the scorers
def our_scores(model, batches, seq: int, mbs: int) -> dict[str, dict[int, torch.Tensor]]:
    from elastic_plugin.importance import collect_importance

    s = collect_importance([model], iter(batches), len(batches) * mbs, seq, mbs, progress=False)
    return {
        "embedding": {0: s.embedding},
        "ffn": dict(s.ffn),
        "shared_ffn": dict(s.shared_ffn),
        "attention_heads": dict(s.attention_heads),
        "mamba_heads": {n: s.mamba_head_scores(n) for n in s.mamba},
        "mamba_channels": {n: s.mamba_channel_scores(n) for n in s.mamba},
        "experts": dict(s.experts),
    }


# ------------------------------------------------------- formula check from raw activations
class RawCapture:
    """Raw activations ([seq, batch, units] per micro-batch) the two definitions are built from.

    Lets the script recompute both definitions from the same tensors, so the formulas written in
    ``NOTES`` are checked against what each scorer actually produced, and single factors can be
    switched off (e.g. the final norm, which ModelOpt does not hook).
    """

    def __init__(self, model) -> None:
        from megatron.core.ssm.mamba_layer import MambaLayer
        from megatron.core.transformer.moe.moe_layer import MoELayer

        self.acts: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._handles = []
        for layer in model.decoder.layers:
            n = int(layer.layer_number)
            if isinstance(layer, MambaLayer):
                d = layer.mixer.d_inner_local_tp
                self._out(layer.norm, ("norm", n))
                self._out(layer.mixer.in_proj, ("mamba", n), lambda t, d=d: t[..., d : 2 * d])
                continue
            attn = getattr(layer, "self_attention", None)
            if attn is not None and hasattr(attn, "linear_proj"):
                self._out(layer.input_layernorm, ("norm", n))
                self._in(attn.linear_proj, ("attention_heads", n))
            mlp = getattr(layer, "mlp", None)
            if isinstance(mlp, MoELayer):
                self._out(layer.pre_mlp_layernorm, ("norm_mlp", n))
                if mlp.shared_experts is not None:
                    self._in(mlp.shared_experts.linear_fc2, ("shared_ffn", n))
            elif mlp is not None and hasattr(mlp, "linear_fc2"):
                self._out(layer.pre_mlp_layernorm, ("norm_mlp", n))
                self._in(mlp.linear_fc2, ("ffn", n))
        self._out(model.decoder.final_norm, ("final_norm", 0))

    def _keep(self, key, t: torch.Tensor) -> None:
        self.acts.setdefault(key, []).append(t.detach().double().clone())

    def _out(self, module, key, pick=lambda t: t) -> None:
        def hook(_m, _i, out):
            self._keep(key, pick(out[0] if isinstance(out, tuple) else out))

        self._handles.append(module.register_forward_hook(hook))

    def _in(self, module, key) -> None:
        self._handles.append(
            module.register_forward_pre_hook(lambda _m, args: self._keep(key, args[0]))
        )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _of(self, kind: str) -> dict[int, list[torch.Tensor]]:
        return {n: v for (k, n), v in self.acts.items() if k == kind}


def _ours_l1(ts: list[torch.Tensor]) -> torch.Tensor:
    """Sum over every token of |x| (our embedding / FFN statistic)."""
    return sum(t.abs().reshape(-1, t.shape[-1]).sum(0) for t in ts)


def _modelopt_l2_of_means(ts: list[torch.Tensor]) -> torch.Tensor:
    """sqrt(sum over sequences of (mean over tokens |x|)^2): ModelOpt's per-channel statistic
    (``x.abs().mean(dim=0).pow(2).sum(dim=0)`` per batch, summed, then ``pow(0.5)``)."""
    return sum(t.abs().mean(dim=0).pow(2).sum(dim=0) for t in ts).sqrt()


def recompute(cap: RawCapture, model_cfg) -> tuple[dict, dict]:
    """Both definitions from raw activations: (ours, modelopt) in the layout of ``compare``."""
    norms = {
        **{("n", k): v for k, v in cap._of("norm").items()},
        **{("m", k): v for k, v in cap._of("norm_mlp").items()},
    }
    final = cap._of("final_norm")[0]
    ours: dict[str, dict[int, torch.Tensor]] = {}
    mo: dict[str, dict[int, torch.Tensor]] = {}
    ours["embedding"] = {0: sum(_ours_l1(v) for v in norms.values()) + _ours_l1(final)}
    mo["embedding"] = {0: sum(_modelopt_l2_of_means(v) for v in norms.values())}
    ours["embedding_no_final_norm"] = {0: ours["embedding"][0] - _ours_l1(final)}
    mo["embedding_no_final_norm"] = mo["embedding"]
    for axis in ("ffn", "shared_ffn"):
        ours[axis] = {n: _ours_l1(v) for n, v in cap._of(axis).items()}
        mo[axis] = {n: _modelopt_l2_of_means(v) for n, v in cap._of(axis).items()}
    kv = model_cfg.head_dim
    ours["attention_heads"], mo["attention_heads"] = {}, {}
    for n, v in cap._of("attention_heads").items():
        ours["attention_heads"][n] = sum(
            t.reshape(-1, t.shape[-1] // kv, kv).norm(dim=-1).sum(0) for t in v
        )
        mo["attention_heads"][n] = _modelopt_l2_of_means(v).view(-1, kv).norm(dim=1)
    heads, hdim = model_cfg.mamba_num_heads, model_cfg.mamba_head_dim
    for name in ("mamba_heads", "mamba_channels"):
        ours[name], mo[name] = {}, {}
    for n, v in cap._of("mamba").items():
        sq = sum(t.pow(2).reshape(-1, heads, hdim).sum(0) for t in v)  # our [heads, head_dim]
        ours["mamba_heads"][n], ours["mamba_channels"][n] = sq.sum(1).sqrt(), sq.sum(0).sqrt()
        c = _modelopt_l2_of_means(v).view(heads, hdim)
        mo["mamba_heads"][n], mo["mamba_channels"][n] = c.norm(dim=1), c.norm(dim=0)
        # mean|s| / RMS(s) per head (0.80 for a Gaussian): the factor that reorders heads
        tokens = sum(t.shape[0] for t in v) / len(v)
        ratio = mo["mamba_heads"][n] / (ours["mamba_heads"][n] / math.sqrt(tokens))
        ours.setdefault("_mamba_ratio", {})[n] = ratio
    return ours, mo


def max_rel_diff(a: dict, b: dict, normalize: bool) -> float:
    """Largest |a-b| / max|b| over layers (after scaling both to max 1 when ``normalize``)."""
    worst = 0.0
    for n in b:
        x, y = a[n].double().flatten(), b[n].double().flatten()
        if normalize:
            x, y = x / x.abs().max(), y / y.abs().max()
        worst = max(worst, float((x - y).abs().max() / y.abs().max().clamp(min=1e-30)))
    return worst


def modelopt_scores(model, batches, seq: int, mbs: int) -> tuple[dict, dict]:
    """ModelOpt's scores from its own hooks; returns (scores per axis, extras for the report).

    Where ModelOpt's estimator returns a *score* (hidden_size, ffn sizes, experts) it is used
    as is (``hp.importance``). For attention heads and Mamba heads/channels its estimator returns
    a group-aware *order*, so the per-unit score it sorts by is recomputed from the activations
    its hooks collected, with the formula of its estimator, and checked to give that very order.
    """
    import modelopt.torch.nas as mtn
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from tests.support.modelopt_compat import load_minitron, local_spec_registry_class

    _, mm = load_minitron()
    config = mm.get_mcore_minitron_config(
        hidden_size_divisor=1,
        ffn_hidden_size_divisor=1,
        mamba_head_dim_divisor=1,
        num_moe_experts_divisor=1,
        num_layers_divisor=1,
    )
    model = mtn.convert(model, mode=[("mcore_minitron", config)])
    registry = local_spec_registry_class()(model)
    try:
        loss = mean_loss(model, batches, seq, mbs)  # ModelOpt's forward loop
        out: dict[str, dict[int, torch.Tensor]] = {k: {} for k in NOTES}
        order_checks: list[bool] = []
        out["embedding"][0] = model.get_hparam("hidden_size").importance
        for layer in model.decoder.layers:
            n = int(layer.layer_number)
            if isinstance(layer, MambaLayer):
                mixer = layer.mixer
                heads, hdim, groups = mixer.nheads, mixer.headdim, mixer.ngroups
                d_inner = heads * hdim
                # _estimate_head_and_head_dim_rankings: sqrt, x part, L2 over heads / channels
                c = mixer._activations.pow(0.5)[d_inner : 2 * d_inner].view(heads, hdim)
                out["mamba_channels"][n] = torch.linalg.vector_norm(c, ord=2, dim=0)
                out["mamba_heads"][n] = torch.linalg.vector_norm(c, ord=2, dim=1)
                head_order = mixer.get_hparam("mamba_num_heads").importance
                mine = _group_order(out["mamba_heads"][n], groups)
                order_checks.append(torch.equal(head_order.cpu(), mine))
                dim_order = mixer.get_hparam("mamba_head_dim").importance
                order_checks.append(
                    torch.equal(
                        dim_order.cpu(), torch.argsort(out["mamba_channels"][n], descending=True)
                    )
                )
                continue
            attn = getattr(layer, "self_attention", None)
            if attn is not None and getattr(attn, "_activations", None) is not None:
                kv = attn.config.kv_channels
                # _estimate_head_ranking: sqrt, then L2 over each head's kv channels
                scores = torch.linalg.vector_norm(
                    attn._activations.pow(0.5).view(-1, kv), ord=2, dim=1
                )
                out["attention_heads"][n] = scores
                order = attn.get_hparam("num_attention_heads").importance
                order_checks.append(
                    torch.equal(
                        order.cpu(), _group_order(scores, attn.num_query_groups_per_partition)
                    )
                )
            mlp = getattr(layer, "mlp", None)
            if isinstance(mlp, MoELayer):
                out["experts"][n] = mlp.experts.get_hparam("num_local_experts").importance
                if mlp.shared_experts is not None:
                    out["shared_ffn"][n] = mlp.shared_experts.get_hparam(
                        "moe_shared_expert_intermediate_size"
                    ).importance
            elif mlp is not None and hasattr(mlp, "hparam_name"):
                out["ffn"][n] = mlp.get_hparam("ffn_hidden_size").importance
        layer_scores = registry.get_layer_scores()
    finally:
        registry.cleanup()
    extras = {
        "loss": loss,
        "order_checks_passed": f"{sum(order_checks)}/{len(order_checks)}",
        "redirected_norm_hooks": registry.redirected,
        "layer_scores": {int(k): float(v) for k, v in layer_scores.items()},
    }
    return {k: v for k, v in out.items() if v}, extras


def _group_order(scores: torch.Tensor, groups: int) -> torch.Tensor:
    """ModelOpt's group-aware order: heads sorted within each group, groups kept in place."""
    per_group = scores.view(groups, -1)
    within = per_group.argsort(dim=1, descending=True)
    return (within + torch.arange(groups)[:, None] * per_group.shape[1]).flatten()


# --------------------------------------------------------------------------------- report
def compare(ours: dict, theirs: dict, model_cfg) -> list[dict[str, Any]]:
    rows = []
    groups = {"attention_heads": model_cfg.query_groups, "mamba_heads": model_cfg.mamba_num_groups}
    for axis in NOTES:
        if axis not in ours or axis not in theirs:
            continue
        layers = sorted(set(ours[axis]) & set(theirs[axis]))
        if set(ours[axis]) != set(theirs[axis]):
            raise RuntimeError(
                f"{axis}: layers differ, ours {sorted(ours[axis])} vs "
                f"ModelOpt {sorted(theirs[axis])}"
            )
        rho = [spearman(ours[axis][n], theirs[axis][n]) for n in layers]
        top = [top_overlap(ours[axis][n], theirs[axis][n]) for n in layers]
        row = {
            "axis": axis,
            "layers": layers if layers != [0] else "model",
            "units": int(ours[axis][layers[0]].numel()),
            "spearman_mean": sum(rho) / len(rho),
            "spearman_min": min(rho),
            "top50_overlap_mean": sum(top) / len(top),
            "top50_overlap_min": min(top),
        }
        if axis in groups:
            agree = [
                in_group_agreement(ours[axis][n], theirs[axis][n], groups[axis]) for n in layers
            ]
            row["in_group_same_order"] = sum(a for a, _ in agree) / len(agree)
            row["in_group_top50_overlap"] = sum(k for _, k in agree) / len(agree)
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'axis':<16} {'layers':<8} {'units':>5} {'rho mean':>9} {'rho min':>8} "
        f"{'top50 mean':>10} {'top50 min':>9} {'grp order':>9} {'grp top50':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        layers = r["layers"] if isinstance(r["layers"], str) else ",".join(map(str, r["layers"]))
        order = f"{r['in_group_same_order']:.2f}" if "in_group_same_order" in r else "-"
        kept = f"{r['in_group_top50_overlap']:.2f}" if "in_group_top50_overlap" in r else "-"
        print(
            f"{r['axis']:<16} {layers:<8} {r['units']:>5} {r['spearman_mean']:>9.4f} "
            f"{r['spearman_min']:>8.4f} {r['top50_overlap_mean']:>10.2f} "
            f"{r['top50_overlap_min']:>9.2f} {order:>9} {kept:>9}"
        )
    print("\nDefinitions (where they differ):")
    for r in rows:
        print(f"- {r['axis']}: {NOTES[r['axis']]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="model config (no --ckpt)")
    p.add_argument("--ckpt", default=None, help="Megatron dist checkpoint dir (elastic_meta.json)")
    p.add_argument("--data", default=None, help="prepared data dir (else random tokens)")
    p.add_argument("--num-batches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None, help="also write the rows and extras here")
    args = p.parse_args(argv)
    for name in ("num_batches", "micro_batch_size", "seq_length"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    for name in ("ckpt", "data"):
        value = getattr(args, name)
        if value is not None and not Path(value).is_dir():
            p.error(f"--{name} {value}: no such directory")
    if not args.ckpt and not Path(args.config).is_file():
        p.error(f"--config {args.config}: no such file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import modelopt.torch  # noqa: F401
    except ImportError as err:
        print(
            f"nvidia-modelopt is needed for this comparison ({err}); install it with "
            "`pip install --no-deps nvidia-modelopt` plus requests, omegaconf, pydantic, "
            "'pulp<4', scipy, regex",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.parallel import init_distributed

    enable_cpu_megatron()
    init_distributed()
    start = time.perf_counter()
    model, cfg, meta = build_model(args)
    batches = calibration_batches(args, cfg.model.vocab_size)
    seq, mbs = args.seq_length, args.micro_batch_size
    loss_plain = mean_loss(model, batches, seq, mbs)
    capture = RawCapture(model)
    try:
        ours = our_scores(model, batches, seq, mbs)
    finally:
        capture.remove()
    theirs, extras = modelopt_scores(model, batches, seq, mbs)
    rows = compare(ours, theirs, cfg.model)
    ours_re, mo_re = recompute(capture, cfg.model)
    del capture
    checks = [
        {
            "axis": axis,
            "ours_recomputed_vs_collected": max_rel_diff(ours_re[axis], ours[axis], False),
            "modelopt_recomputed_vs_collected": max_rel_diff(mo_re[axis], theirs[axis], True),
        }
        for axis in NOTES
        if axis in ours_re and axis in theirs
    ]
    checks.append(
        {
            "axis": "experts",
            "ours_vs_modelopt_normalized": max_rel_diff(ours["experts"], theirs["experts"], True),
        }
    )
    ablation = compare(
        {"embedding": ours_re["embedding_no_final_norm"]},
        {"embedding": mo_re["embedding_no_final_norm"]},
        cfg.model,
    )[0]
    import modelopt

    print(
        f"model: {'checkpoint ' + args.ckpt if args.ckpt else 'random init (seed ' + str(args.seed) + ')'}"
        f"; data: {args.data or 'random tokens'}; {args.num_batches} x {mbs} x {seq} tokens; "
        f"modelopt {modelopt.__version__}"
    )
    print(
        f"LM loss: plain model {loss_plain:.6f}, ModelOpt-converted model {extras['loss']:.6f}; "
        f"ModelOpt estimator orders reproduced: {extras['order_checks_passed']}; "
        f"norm hooks moved off fused TE linears: {extras['redirected_norm_hooks']}"
    )
    print()
    print_table(rows)
    print("\nFormula check (max relative difference, scores scaled to max 1 for ModelOpt):")
    for c in checks:
        print(
            "  "
            + c["axis"]
            + ": "
            + ", ".join(f"{k.replace('_', ' ')} {v:.1e}" for k, v in c.items() if k != "axis")
        )
    for n, ratio in ours_re.get("_mamba_ratio", {}).items():
        spread = ours["mamba_heads"][n]
        print(
            f"Mamba layer {n}: per-head mean|s|/RMS(s) {float(ratio.min()):.3f}..{float(ratio.max()):.3f} "
            f"(x{float(ratio.max() / ratio.min()):.2f}) vs our head-score spread "
            f"x{float(spread.max() / spread.min()):.2f}"
        )
    print(
        f"Ablation - embedding without the final norm in ours (ModelOpt never hooks it): "
        f"rho {ablation['spearman_mean']:.4f}, top-50% overlap {ablation['top50_overlap_mean']:.2f}"
    )
    print(
        f"\nModelOpt-only: depth scores (1 - cos(in, out)) {extras['layer_scores']}; per-expert "
        f"moe_ffn_hidden_size neuron scores (we have no expert-neuron axis). "
        f"[{time.perf_counter() - start:.1f} s]"
    )
    problems = _self_check_problems(loss_plain, extras, checks)
    for problem in problems:
        print(f"SELF-CHECK FAILED: {problem}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "rows": rows,
                    "extras": extras,
                    "checks": checks,
                    "ablation_embedding_no_final_norm": ablation,
                    "args": vars(args),
                },
                indent=2,
                default=str,
            )
        )
    return 1 if problems else 0


def _self_check_problems(
    loss_plain: float, extras: dict, checks: list[dict], tol: float = 1e-4
) -> list[str]:
    """What would make the comparison untrustworthy: a changed forward, an estimator order we
    do not reproduce, or a definition in NOTES that does not recompute what a scorer produced."""
    problems = []
    if not math.isclose(loss_plain, extras["loss"], rel_tol=1e-6):
        problems.append(f"ModelOpt conversion changed the loss ({loss_plain} -> {extras['loss']})")
    done, total = map(int, extras["order_checks_passed"].split("/"))
    if done != total:
        problems.append(f"only {done}/{total} ModelOpt head/channel orders reproduced")
    for check in checks:
        for key, value in check.items():
            if key != "axis" and (value > tol or math.isnan(value)):
                problems.append(f"{check['axis']}: {key} = {value:.2e} > {tol:g}")
    return problems


if __name__ == "__main__":
    sys.exit(main())
