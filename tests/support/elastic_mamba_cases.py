"""Rank-pool cases for ``elastic_plugin.elastic.layers.mamba``: a real Megatron ``MambaMixer`` (built
from the hybrid layer spec) run through ``elastic_mamba_forward`` and compared with Megatron's
own forward, with masked mode, with a genuinely smaller mixer, with finite differences, and
under TP=2 + sequence parallelism against the single-rank result. Every case returns plain
numbers (max differences) that the tests assert on."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from elastic_plugin.elastic.layers.mamba import elastic_mamba_forward
from elastic_plugin.models.builder import stack_spec_for, transformer_config
from elastic_plugin.models.config import ConfigError, ModelConfig
from elastic_plugin.models.prefix import Index, mamba_active_rows
from elastic_plugin.parallel import Layout, initialize_layout
from tests.support.equivalence import tiny_model

SEQ, BATCH = 40, 2  # 40: not a multiple of tiny's Mamba chunk (32)


# ------------------------------------------------------------------------------ building
def mamba_model(config_path: str, **overrides: Any) -> ModelConfig:
    """The config's model as a single Mamba layer (pattern "M"), optionally resized."""
    return tiny_model(config_path, "M", overrides)


def build_mixer(
    cfg: ModelConfig,
    layout: Layout,
    dtype: torch.dtype = torch.float32,
    mixer_params: dict[str, Any] | None = None,
    **config_overrides: Any,
):
    """A ``MambaMixer`` built exactly as ``MambaLayer`` builds it from our hybrid spec."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    tconf = transformer_config(cfg, layout, torch.float32, **config_overrides)
    spec = stack_spec_for(cfg).submodules.mamba_layer.submodules.mixer
    mixer = build_module(
        spec,
        tconf,
        d_model=tconf.hidden_size,
        layer_number=1,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        **(mixer_params or {}),
    )
    return mixer.to(dtype)


@torch.no_grad()
def randomize_(mixer, seed: int) -> None:
    """Deterministic, well-scaled weights (non-trivial D and norm weight; O(1) activations)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(t: torch.Tensor, scale: float, shift: float = 0.0) -> torch.Tensor:
        values = torch.randn(t.shape, generator=gen, dtype=torch.float64) * scale + shift
        return values.to(t.dtype)

    h = mixer.d_model
    mixer.in_proj.weight.copy_(rnd(mixer.in_proj.weight, 1.0 / h**0.5))
    mixer.conv1d_weight.copy_(rnd(mixer.conv1d_weight, 0.5))
    mixer.conv1d_bias.copy_(rnd(mixer.conv1d_bias, 0.2))
    mixer.dt_bias.copy_(rnd(mixer.dt_bias, 0.5, -1.0))
    a = torch.rand(mixer.A_log.shape, generator=gen) * 3 + 1  # A in [1, 4]
    mixer.A_log.copy_(torch.log(a).to(mixer.A_log.dtype))
    mixer.D.copy_(rnd(mixer.D, 1.0))
    mixer.norm.weight.copy_(rnd(mixer.norm.weight, 0.2, 1.0))
    mixer.out_proj.weight.copy_(rnd(mixer.out_proj.weight, 1.0 / mixer.d_inner**0.5))


def random_like(
    shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def run(
    mixer,
    x: torch.Tensor,
    w: torch.Tensor,
    fn: Callable | None = None,
    extra: tuple = (),
    **kwargs: Any,
) -> dict[str, Any]:
    """Forward (Megatron's ``mixer(x)`` when ``fn`` is None, else ``fn(mixer, x, **kwargs)``),
    then the gradient of ``sum(out * w)`` w.r.t. ``x``, every parameter and ``extra``."""
    mixer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out, bias = mixer(x) if fn is None else fn(mixer, x, **kwargs)
    assert bias is None
    params = dict(mixer.named_parameters())
    grads = torch.autograd.grad((out * w).sum(), [x, *params.values(), *extra], allow_unused=True)
    pg = {
        n: (torch.zeros_like(p) if g is None else g)
        for (n, p), g in zip(params.items(), grads[1 : 1 + len(params)])
    }
    return {
        "out": out.detach(),
        "x_grad": grads[0],
        "param_grads": pg,
        "extra_grads": list(grads[1 + len(params) :]),
    }


# ----------------------------------------------------------------- 1. full == Megatron
def full_matches_megatron(config_path: str, mem_eff: bool = True, seed: int = 3) -> dict[str, Any]:
    cfg = mamba_model(config_path)
    initialize_layout(Layout())
    mixer = build_mixer(cfg, Layout(), use_mamba_mem_eff_path=mem_eff)
    randomize_(mixer, seed)
    x = random_like((SEQ, BATCH, cfg.hidden_size), seed + 1)
    w = random_like((SEQ, BATCH, cfg.hidden_size), seed + 2)
    ref = run(mixer, x, w)
    ours = run(mixer, x, w, elastic_mamba_forward)
    explicit = run(
        mixer,
        x,
        w,
        elastic_mamba_forward,
        hidden_active=cfg.hidden_size,
        heads_per_group=cfg.mamba_num_heads // cfg.mamba_num_groups,
        head_dim=cfg.mamba_head_dim,
    )
    from megatron.core.inference.utils import InferenceMode

    with InferenceMode.active(), torch.no_grad():  # no cache: Megatron's prefill path
        inference = rel(elastic_mamba_forward(mixer, x)[0], mixer(x)[0])
    packed = packed_changes = None
    if mem_eff:  # packed sequences (THD): the state must reset at each sequence start
        from megatron.core.packed_seq_params import PackedSeqParams

        starts = torch.tensor([0, 15, 27], dtype=torch.int32)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=starts, total_tokens=SEQ)
        xp = x[:, :1]
        with torch.no_grad():
            ref_packed = mixer(xp, packed_seq_params=psp)[0]
            packed = rel(elastic_mamba_forward(mixer, xp, packed_seq_params=psp)[0], ref_packed)
            packed_changes = rel(mixer(xp)[0], ref_packed)
    return {
        "out": rel(ours["out"], ref["out"]),
        "inference_no_cache": inference,
        "packed": packed,
        "packed_vs_unpacked": packed_changes,
        "out_explicit_sizes": rel(explicit["out"], ref["out"]),
        "x_grad": rel(ours["x_grad"], ref["x_grad"]),
        "param_grads": {n: rel(g, ref["param_grads"][n]) for n, g in ours["param_grads"].items()},
        "min_param_grad": min(g.abs().max().item() for g in ref["param_grads"].values()),
        "out_scale": ref["out"].abs().max().item(),
    }


# ------------------------------------------------------------ 2. sliced == hard masks
def _hard_masks(cfg: ModelConfig, k: int, p: int, h: int) -> tuple[torch.Tensor, ...]:
    per_group = cfg.mamba_num_heads // cfg.mamba_num_groups
    return (
        (torch.arange(per_group) < k).float(),
        (torch.arange(cfg.mamba_head_dim) < p).float(),
        (torch.arange(cfg.hidden_size) < h).float(),
    )


def _active_block(mixer, k: int, p: int, h: int) -> dict[str, tuple[torch.Tensor, Index]]:
    """Per parameter: (row index, column count) of the active block (None = all columns)."""
    rows = mamba_active_rows(mixer, k, p)
    return {
        "in_proj.weight": (rows["in_proj"], h),
        "conv1d_weight": (rows["conv"], None),
        "conv1d_bias": (rows["conv"], None),
        "dt_bias": (rows["heads"], None),
        "A_log": (rows["heads"], None),
        "D": (rows["channels"] if mixer.D_has_hdim else rows["heads"], None),
        "norm.weight": (rows["channels"], None),
        "out_proj.weight": (torch.arange(h), rows["channels"]),
    }


def _block(t: torch.Tensor, rows: torch.Tensor, cols) -> torch.Tensor:
    t = t.index_select(0, rows)
    if cols is None:
        return t
    return t[:, :cols] if isinstance(cols, int) else t.index_select(1, cols)


def sliced_matches_masked(
    config_path: str, k: int, p: int, h: int, mem_eff: bool = True, seed: int = 5
) -> dict[str, Any]:
    cfg = mamba_model(config_path)
    initialize_layout(Layout())
    mixer = build_mixer(cfg, Layout(), use_mamba_mem_eff_path=mem_eff)
    randomize_(mixer, seed)
    x = random_like((SEQ, BATCH, cfg.hidden_size), seed + 1)
    x[..., h:] = 0  # the residual stream is masked beyond h' too
    w = random_like((SEQ, BATCH, cfg.hidden_size), seed + 2)
    hm, cm, hidm = _hard_masks(cfg, k, p, h)
    masked = run(
        mixer, x, w, elastic_mamba_forward, head_mask=hm, channel_mask=cm, hidden_mask=hidm
    )
    sliced = run(
        mixer,
        x[..., :h],
        w[..., :h],
        elastic_mamba_forward,
        hidden_active=h,
        heads_per_group=k,
        head_dim=p,
    )
    blocks = _active_block(mixer, k, p, h)
    outside, inside_min = {}, {}
    for name, g in sliced["param_grads"].items():
        rows, cols = blocks[name]
        rest = g.clone()
        if cols is None:
            rest[rows] = 0
        elif isinstance(cols, int):
            rest[rows, :cols] = 0
        else:
            rest[rows.unsqueeze(1), cols.unsqueeze(0)] = 0
        outside[name] = rest.abs().max().item()
        inside_min[name] = _block(g, rows, cols).abs().max().item()
    return {
        "out_shape": list(sliced["out"].shape),
        "out": rel(sliced["out"], masked["out"][..., :h]),
        "masked_out_beyond_h": masked["out"][..., h:].abs().max().item(),
        "x_grad": rel(sliced["x_grad"], masked["x_grad"][..., :h]),
        "param_grads": {
            n: rel(g, masked["param_grads"][n]) for n, g in sliced["param_grads"].items()
        },
        "sliced_grad_outside_block": outside,
        "sliced_grad_inside_block": inside_min,
        "out_scale": sliced["out"].abs().max().item(),
    }


# ------------------------------------------------------- 3. sliced == a smaller mixer
def active_blocks(
    tensors: dict[str, torch.Tensor], mixer, k: int, p: int, h: int
) -> dict[str, torch.Tensor]:
    """The active blocks of a mixer's parameter-shaped tensors, derived from Megatron's layout
    with reshapes (independently of ``mamba_active_rows``): the parameters of the smaller mixer.

    in_proj rows are ``[z | x | B | C | dt]``, z/x/D/norm/out_proj channels ``(group, head,
    channel)``-major, heads ``(group, head)``-major, conv channels ``[x | B | C]``.
    """
    groups, state, hd = mixer.ngroups_local_tp, mixer.d_state, mixer.headdim
    per_group = mixer.nheads_local_tp // groups
    d_inner = mixer.d_inner_local_tp

    def channels(t: torch.Tensor) -> torch.Tensor:  # [d_inner, ...] -> [groups*k*p, ...]
        rest = t.shape[1:]
        return t.reshape(groups, per_group, hd, *rest)[:, :k, :p].reshape(-1, *rest)

    def heads(t: torch.Tensor) -> torch.Tensor:  # [heads, ...] -> [groups*k, ...]
        return t.reshape(groups, per_group, *t.shape[1:])[:, :k].reshape(-1, *t.shape[1:])

    bc = 2 * groups * state
    z, x, b_c, dt = tensors["in_proj.weight"].split([d_inner, d_inner, bc, per_group * groups])
    conv_w, conv_wbc = tensors["conv1d_weight"].split([d_inner, bc])
    conv_b, conv_bbc = tensors["conv1d_bias"].split([d_inner, bc])
    return {
        "in_proj.weight": torch.cat([channels(z), channels(x), b_c, heads(dt)])[:, :h],
        "conv1d_weight": torch.cat([channels(conv_w), conv_wbc]),
        "conv1d_bias": torch.cat([channels(conv_b), conv_bbc]),
        "dt_bias": heads(tensors["dt_bias"]),
        "A_log": heads(tensors["A_log"]),
        "D": channels(tensors["D"]) if mixer.D_has_hdim else heads(tensors["D"]),
        "norm.weight": channels(tensors["norm.weight"]),
        "out_proj.weight": channels(tensors["out_proj.weight"].t()).t()[:h],
    }


@torch.no_grad()
def copy_active_block_(small, big, k: int, p: int, h: int) -> None:
    """``small``'s weights := the active blocks of ``big`` (the extraction of a nested model)."""
    blocks = active_blocks(dict(big.named_parameters()), big, k, p, h)
    for name, param in small.named_parameters():
        param.copy_(blocks[name])


def sliced_matches_smaller_mixer(
    config_path: str,
    k: int,
    p: int,
    h: int,
    mem_eff: bool = True,
    d_has_hdim: bool = False,
    seed: int = 7,
) -> dict[str, Any]:
    cfg = mamba_model(config_path)
    small_cfg = replace(
        cfg, hidden_size=h, mamba_num_heads=k * cfg.mamba_num_groups, mamba_head_dim=p
    ).validate()
    initialize_layout(Layout())
    params = {"D_has_hdim": d_has_hdim}
    big = build_mixer(cfg, Layout(), mixer_params=params, use_mamba_mem_eff_path=mem_eff)
    small = build_mixer(small_cfg, Layout(), mixer_params=params, use_mamba_mem_eff_path=mem_eff)
    randomize_(big, seed)
    copy_active_block_(small, big, k, p, h)
    x = random_like((SEQ, BATCH, h), seed + 1)
    w = random_like((SEQ, BATCH, h), seed + 2)
    ref = run(small, x, w)
    ours = run(big, x, w, elastic_mamba_forward, hidden_active=h, heads_per_group=k, head_dim=p)
    ours_blocks = active_blocks(ours["param_grads"], big, k, p, h)
    grads = {n: rel(ours_blocks[n], g) for n, g in ref["param_grads"].items()}
    # the index sets pick exactly the blocks derived above from Megatron's layout
    by_index = {
        n: _block(big.get_parameter(n), rows_, cols)
        for n, (rows_, cols) in _active_block(big, k, p, h).items()
    }
    by_view = active_blocks(dict(big.named_parameters()), big, k, p, h)
    rows = mamba_active_rows(big, k, p)
    return {
        "shapes": {
            "small_in_proj": list(small.in_proj.weight.shape),
            "small_heads": small.nheads,
            "small_groups": small.ngroups,
            "active_in_proj_rows": int(rows["in_proj"].numel()),
        },
        "cached": mamba_active_rows(big, k, p) is rows,
        "index_sets_match_layout": all(torch.equal(by_index[n], by_view[n]) for n in by_view),
        "out": rel(ours["out"], ref["out"]),
        "x_grad": rel(ours["x_grad"], ref["x_grad"]),
        "param_grads": grads,
        "out_scale": ref["out"].abs().max().item(),
    }


# ------------------------------------------------- 4. mask gradients vs finite differences
def mask_gradients_match_finite_differences(
    config_path: str, k: int, p: int, h: int, eps: float = 1e-6, seed: int = 11
) -> dict[str, Any]:
    """Soft masks at sliced widths, float64: autograd vs central differences, every element."""
    cfg = mamba_model(config_path)
    initialize_layout(Layout())
    mixer = build_mixer(cfg, Layout(), dtype=torch.float64)
    randomize_(mixer, seed)
    x = random_like((24, BATCH, h), seed + 1, torch.float64)
    w = random_like((24, BATCH, h), seed + 2, torch.float64)
    gen = torch.Generator().manual_seed(seed + 3)
    masks = [torch.rand(n, generator=gen, dtype=torch.float64) * 0.8 + 0.2 for n in (k, p, h)]

    def loss(hm: torch.Tensor, cm: torch.Tensor, hidm: torch.Tensor) -> torch.Tensor:
        out, _ = elastic_mamba_forward(
            mixer,
            x,
            hidden_active=h,
            heads_per_group=k,
            head_dim=p,
            head_mask=hm,
            channel_mask=cm,
            hidden_mask=hidm,
        )
        return (out * w).sum()

    leaves = [m.clone().requires_grad_(True) for m in masks]
    auto = torch.autograd.grad(loss(*leaves), leaves)
    result = {}
    with torch.no_grad():
        for which, name in enumerate(("head_mask", "channel_mask", "hidden_mask")):
            numeric = torch.zeros_like(masks[which])
            for i in range(masks[which].numel()):
                plus = [m.clone() for m in masks]
                minus = [m.clone() for m in masks]
                plus[which][i] += eps
                minus[which][i] -= eps
                numeric[i] = (loss(*plus) - loss(*minus)) / (2 * eps)
            result[name] = {"rel": rel(auto[which], numeric), "scale": numeric.abs().max().item()}
    return result


# --------------------------------------------------------------------- bad arguments
def bad_arguments_raise(config_path: str) -> dict[str, str]:
    """Each bad call's error type and message (the test checks them)."""
    from megatron.core.inference.utils import InferenceMode

    cfg = mamba_model(config_path)
    initialize_layout(Layout())
    mixer = build_mixer(cfg, Layout())
    x = torch.randn(8, 1, cfg.hidden_size)
    calls: dict[str, dict[str, Any]] = {
        "heads_per_group": dict(heads_per_group=cfg.mamba_num_heads),  # > heads per group
        "head_dim": dict(head_dim=0),
        "hidden_active": dict(hidden_active=cfg.hidden_size // 2),  # x is full width
        "head_mask": dict(heads_per_group=2, head_mask=torch.ones(3)),
    }
    messages = {}
    for name, kwargs in calls.items():
        try:
            elastic_mamba_forward(mixer, x, **kwargs)
            messages[name] = "no error"
        except ConfigError as err:
            messages[name] = f"ConfigError: {err}"
    try:
        with InferenceMode.active():
            elastic_mamba_forward(mixer, x, inference_context=object())
        messages["inference"] = "no error"
    except NotImplementedError as err:
        messages["inference"] = f"NotImplementedError: {err}"
    return messages


# ----------------------------------------------------- 5. TP=2 + SP vs the TP=1 result
def _tp_shard(name: str, full: torch.Tensor, mixer, rank: int, size: int) -> torch.Tensor:
    """This TP rank's part of a TP=1 parameter, following MambaMixer's per-part sharding."""
    heads, groups, state = mixer.nheads, mixer.ngroups, mixer.d_state
    d_inner = mixer.d_inner

    def parts(t: torch.Tensor, sizes: list[int], dim: int = 0) -> torch.Tensor:
        return torch.cat([c.chunk(size, dim)[rank] for c in t.split(sizes, dim)], dim)

    if name == "in_proj.weight":
        return parts(full, [d_inner, d_inner, groups * state, groups * state, heads])
    if name in ("conv1d_weight", "conv1d_bias"):
        return parts(full, [d_inner, groups * state, groups * state])
    if name == "out_proj.weight":
        return full.chunk(size, 1)[rank]
    return full.chunk(size, 0)[rank]  # A_log, dt_bias, D, norm.weight


def _sliced_runs(
    mixer,
    x: torch.Tensor,
    w: torch.Tensor,
    k: int,
    p: int,
    h: int,
    masks: list[torch.Tensor],
    wrap: Callable[[torch.Tensor, bool], torch.Tensor],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(sliced without masks, sliced with soft masks) runs; ``wrap`` prepares each mask as
    ``ElasticState`` does (TP gradient completion)."""
    plain = run(mixer, x, w, elastic_mamba_forward, hidden_active=h, heads_per_group=k, head_dim=p)
    leaves = [m.clone().requires_grad_(True) for m in masks]

    def with_masks(m, xx, **kw):
        return elastic_mamba_forward(
            m,
            xx,
            hidden_active=h,
            heads_per_group=k,
            head_dim=p,
            head_mask=wrap(leaves[0], False),
            channel_mask=wrap(leaves[1], False),
            hidden_mask=wrap(leaves[2], True),
        )

    masked = run(mixer, x, w, with_masks, extra=tuple(leaves))
    return plain, masked


def tp_sp_matches_single_rank(
    config_path: str, k: int, p: int, h: int, tp: int = 2, seed: int = 13
) -> dict[str, Any]:
    """Every rank: the TP=1 result from the full weights, then the same under TP=``tp`` + SP
    from those weights sharded per part; returns this rank's max differences."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    cfg = mamba_model(config_path)
    seq = 2 * SEQ  # divisible by tp
    x = random_like((seq, BATCH, cfg.hidden_size), seed + 1)
    w = random_like((seq, BATCH, cfg.hidden_size), seed + 2)
    gen = torch.Generator().manual_seed(seed + 3)
    masks = [torch.rand(n, generator=gen) * 0.8 + 0.2 for n in (k, p, h)]

    initialize_layout(Layout())
    ref = build_mixer(cfg, Layout())
    randomize_(ref, seed)
    full_weights = {n: t.detach().clone() for n, t in ref.named_parameters()}
    ref_full = run(ref, x, w)
    ref_plain, ref_masked = _sliced_runs(
        ref, x[..., :h], w[..., :h], k, p, h, masks, lambda m, hidden: m
    )

    layout = Layout(tp=tp, sequence_parallel=True)
    initialize_layout(layout)
    rank = parallel_state.get_tensor_model_parallel_rank()
    mixer = build_mixer(cfg, layout)
    assert mixer.config.sequence_parallel and mixer.in_proj.sequence_parallel
    with torch.no_grad():
        for name, param in mixer.named_parameters():
            param.copy_(_tp_shard(name, full_weights[name], ref, rank, tp))
    # explicit weight check: gather every shard back and rebuild the full tensors
    weights_equal = True
    for name, param in mixer.named_parameters():
        shards = [torch.empty_like(param) for _ in range(tp)]
        dist.all_gather(
            shards,
            param.detach().contiguous(),
            group=parallel_state.get_tensor_model_parallel_group(),
        )
        rebuilt = [_tp_shard(name, full_weights[name], ref, r, tp) for r in range(tp)]
        weights_equal &= all(torch.equal(a, b) for a, b in zip(shards, rebuilt))

    rows = slice(rank * seq // tp, (rank + 1) * seq // tp)  # this rank's sequence chunk (SP)

    def wrap(mask: torch.Tensor, hidden: bool) -> torch.Tensor:
        # as ElasticState: head/channel masks always, the hidden mask only under SP
        if hidden and not layout.sequence_parallel:
            return mask
        return copy_to_tensor_model_parallel_region(mask)

    full = run(mixer, x[rows], w[rows])
    plain, masked = _sliced_runs(mixer, x[rows, :, :h], w[rows, :, :h], k, p, h, masks, wrap)

    def grads_vs(ours: dict[str, Any], refr: dict[str, Any]) -> dict[str, float]:
        return {
            n: rel(g, _tp_shard(n, refr["param_grads"][n], ref, rank, tp))
            for n, g in ours["param_grads"].items()
        }

    return {
        "rank": rank,
        "weights_equal": bool(weights_equal),
        "megatron_full_out": rel(full["out"], ref_full["out"][rows]),
        "megatron_full_grads": max(grads_vs(full, ref_full).values()),
        "sliced_out": rel(plain["out"], ref_plain["out"][rows]),
        "sliced_x_grad": rel(plain["x_grad"], ref_plain["x_grad"][rows]),
        "sliced_param_grads": grads_vs(plain, ref_plain),
        "masked_out": rel(masked["out"], ref_masked["out"][rows]),
        "mask_grads": [rel(a, b) for a, b in zip(masked["extra_grads"], ref_masked["extra_grads"])],
        "out_shape": list(plain["out"].shape),
    }


# ------------------------------------------------------------------------------ timing
def timing(config_path: str, reps: int = 10, seed: int = 17) -> dict[str, float]:
    """Forward+backward wall time (best of ``reps``, interleaved): full mixer, elastic sliced
    at half heads per group and half head dim, and a plain smaller mixer of that size."""
    cfg = mamba_model(
        config_path,
        hidden_size=256,
        mamba_num_heads=16,
        mamba_head_dim=32,
        mamba_state_dim=32,
        mamba_chunk_size=64,
    )
    k, p = cfg.mamba_num_heads // cfg.mamba_num_groups // 2, cfg.mamba_head_dim // 2
    small_cfg = replace(cfg, mamba_num_heads=k * cfg.mamba_num_groups, mamba_head_dim=p).validate()
    initialize_layout(Layout())
    big = build_mixer(cfg, Layout())
    small = build_mixer(small_cfg, Layout())
    randomize_(big, seed)
    copy_active_block_(small, big, k, p, cfg.hidden_size)
    x = torch.randn(256, 4, cfg.hidden_size)

    def step(fn: Callable) -> Callable[[], None]:
        def go() -> None:
            xx = x.clone().requires_grad_(True)
            out, _ = fn(xx)
            out.square().mean().backward()

        return go

    fns = {
        "full": step(lambda xx: big(xx)),
        "sliced": step(lambda xx: elastic_mamba_forward(big, xx, heads_per_group=k, head_dim=p)),
        "small": step(lambda xx: small(xx)),
    }
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {
        **{f"{n}_ms": t * 1e3 for n, t in best.items()},
        "sliced_over_full": best["sliced"] / best["full"],
        "small_over_full": best["small"] / best["full"],
        "sliced_over_small": best["sliced"] / best["small"],
    }
