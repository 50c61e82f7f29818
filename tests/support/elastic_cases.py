"""Elastic training under TP/PP/EP/DP vs one rank (rank-pool cases).

Protocol (as ``tests.support.equivalence``): ``make_elastic_reference`` (1 rank) writes an initial
"reordered" checkpoint of the tiny model (a random model's order is as good as any importance
order), then runs elastic steps on fixed micro-batches and saves losses per budget, the router's
choice per micro-batch and all gradients (model + router, as a dist checkpoint). ``check_elastic``
(N ranks) loads the same checkpoint into a layout, runs the same steps with the same sampled
budgets and compares. Data: R micro-batches of 4 rows; under DP=d each rank takes
its 4/d rows of every micro-batch, and all DP ranks draw the same budget for micro-batch i.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.support.equivalence import (
    _max_diff,
    load_dist,
    params_replaced_by,
    save_dist,
    tiny_model,
)

MICRO_BATCH = 4  # rows per micro-batch at DP=1; DP rank r of d takes rows r*4/d ...
REF_MICROBATCHES = 2
SEQ_LEN = 32
STEPS = 3
ELASTIC: dict[str, Any] = {  # an elastic config section: budgets, sizes, router
    "budgets": [1.0, 0.77, 0.4],
    "sizes": {
        "embedding": [1.0, 0.75, 0.5],
        "ffn": [1.0, 0.5],
        "shared_ffn": [1.0, 0.5],
        "attention_heads": [1.0, 0.5],
        "mamba_heads": [1.0, 0.5],
        "mamba_head_dim": [1.0, 0.5],
        "experts": [1.0, 0.5],
    },
    "router": {"hidden_size": 32},
}


def _batches(vocab: int, seed: int, count: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        seq = torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN + 1), generator=gen)
        out.append(
            {
                "tokens": seq[:, :-1].contiguous(),
                "labels": seq[:, 1:].contiguous(),
                "loss_mask": torch.ones(MICRO_BATCH, SEQ_LEN),
                "position_ids": torch.arange(SEQ_LEN).expand(MICRO_BATCH, SEQ_LEN),
            }
        )
    return out


def _iteration_batches(vocab: int, iteration: int) -> list[dict[str, torch.Tensor]]:
    """This DP rank's rows of the iteration's micro-batches."""
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = MICRO_BATCH // dp
    return [
        {k: v[rank * rows : (rank + 1) * rows] for k, v in b.items()}
        for b in _batches(vocab, 100 + iteration, REF_MICROBATCHES)
    ]


def _experiment(config_path: str, pattern: str | None):
    from elastic_plugin.models.config import load_config

    cfg = load_config(config_path)
    model = tiny_model(config_path, pattern)
    return cfg.__class__(
        model=model, parallel=cfg.parallel, training=cfg.training, data=cfg.data, source=cfg.source
    )


def _elastic_config(model, mode: str, heterogeneous: bool, fp8_gemm: str = "off"):
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.models.axes import model_axes

    axes = model_axes(model)
    raw = dict(
        ELASTIC,
        mode=mode,
        heterogeneous=heterogeneous,
        fp8_gemm=fp8_gemm,
        sizes={k: v for k, v in ELASTIC["sizes"].items() if k in axes},
    )
    if mode == "masked":
        raw["router"] = {**raw["router"], "hard": False}
    return ElasticConfig.from_dict(raw)


def _setup(
    config_path: str,
    workdir: Path,
    layout,
    pattern,
    mode,
    heterogeneous,
    seed,
    fp8_gemm: str = "off",
    runtime: dict[str, Any] | None = None,
):
    """Elastic student (DDP), frozen teacher, optimizer and step driver for ``layout``;
    ``runtime``: ``models.runtime.Runtime`` fields (BF16, recomputation)."""

    from elastic_plugin.checkpoint.io import build_from_checkpoint
    from elastic_plugin.elastic.cost import ElasticCost
    from elastic_plugin.elastic.model import build_elastic_chunks, router_param_groups
    from elastic_plugin.elastic.router import AnnealSchedule
    from elastic_plugin.elastic.sampling import BudgetSampler
    from elastic_plugin.elastic.step import ElasticStep
    from elastic_plugin.parallel import build_optimizer, initialize_layout

    cfg = _experiment(config_path, pattern)
    ecfg = _elastic_config(cfg.model, mode, heterogeneous, fp8_gemm)
    resolved = ecfg.resolve(cfg.model, layout.tp, layout.ep)
    from elastic_plugin.models.runtime import Runtime

    run = Runtime(**(runtime or {})).check(cfg.model, layout.pp)
    initialize_layout(layout, seed=seed)
    chunks, state, _ = build_elastic_chunks(workdir / "init", layout, resolved, runtime=run)
    teacher, _, _ = build_from_checkpoint(workdir / "init", layout, params_dtype=run.params_dtype)
    for chunk in teacher:
        chunk.requires_grad_(False)
    optimizer = build_optimizer(
        chunks,
        lr=1e-3,
        adam_eps=1e-4,
        distributed_optimizer=layout.distributed_optimizer,
        config_overrides=router_param_groups(1e-3, 1e-3, 10.0),
    )
    step = ElasticStep(
        state=state,
        sampler=BudgetSampler(resolved.budgets, None, seed=5, total_iters=STEPS),
        cost=ElasticCost(cfg.model, resolved),
        temperature=AnnealSchedule(1.0, 0.5, STEPS),
        logit_scale=AnnealSchedule(1.0, 2.0, STEPS),
        num_microbatches=REF_MICROBATCHES,
        teacher_chunks=teacher,
        trace=[],
    )
    return cfg, chunks, optimizer, step


def write_init_checkpoint(cfg, path: Path, seed: int = 1234) -> None:
    """A random tiny model saved as if importance-reordered (its order is as good as any)."""
    from elastic_plugin.checkpoint.io import save_checkpoint
    from elastic_plugin.checkpoint.layout import STRIDED_ATTR
    from elastic_plugin.parallel import Layout, build_model_chunks, initialize_layout

    initialize_layout(Layout(), seed=seed)
    chunks, _ = build_model_chunks(cfg.model, Layout(), wrap_ddp=False)
    setattr(chunks[0], STRIDED_ATTR, True)
    save_checkpoint(
        chunks, path, {"kind": "reordered", "config": cfg.to_dict(), "layout": asdict(Layout())}
    )


def tiny_schedule(
    iters: int, lr: float, warmup: int = 0, global_batch: int = 8, micro_batch: int = 4
):
    """The short schedule the training cases use: LR decays to lr/10, a log line per
    iteration, one validation batch at the end."""
    from elastic_plugin.elastic.schedule import student_schedule

    return student_schedule(
        train_iters=iters,
        lr=lr,
        min_lr=lr / 10,
        lr_warmup_iters=warmup,
        global_batch_size=global_batch,
        micro_batch_size=micro_batch,
        seq_length=SEQ_LEN,
        log_interval=1,
        eval_interval=iters,
        eval_iters=1,
    )


def train_tiny_elastic(
    cfg,
    work: Path,
    iters: int = 2,
    batch: int = 4,
    lr: float = 2e-2,
    choices: dict[str, Any] | None = None,
) -> Path:
    """A briefly trained elastic checkpoint of ``cfg``'s model on synthetic tokens (random init
    saved as reordered, ``iters`` iterations on one rank); ``choices`` (budget label -> sizes)
    overwrite the stored table, as a converged router would have chosen. Returns its path."""
    from elastic_plugin.elastic.train import train_elastic
    from elastic_plugin.parallel import Layout

    write_init_checkpoint(cfg, work / "init")
    sched = tiny_schedule(iters, lr, global_batch=batch, micro_batch=batch)
    run = train_elastic(
        cfg,
        _elastic_config(cfg.model, "sliced", False),
        Layout(),
        work / "init",
        work / "run",
        lambda c: _synthetic_iterator(cfg.model.vocab_size, batch, c),
        None,
        sched,
        progress=False,
    )
    ckpt = Path(run.checkpoint_dir)
    if choices:
        meta = json.loads((ckpt / "elastic_meta.json").read_text())
        meta["elastic"]["choices"].update(choices)
        (ckpt / "elastic_meta.json").write_text(json.dumps(meta))
    return ckpt


def _reads_data() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()


def _run(cfg, chunks, optimizer, step, grads_out: Path | None):
    """STEPS elastic iterations; after the first backward, capture the gradients."""
    from elastic_plugin.checkpoint.layout import canonical_weights

    model = getattr(chunks[0], "module", chunks[0])
    losses: list[dict[int, list[float]]] = []
    grads = None
    for iteration in range(1, STEPS + 1):
        step.iteration = iteration
        data = iter(_iteration_batches(cfg.model.vocab_size, iteration)) if _reads_data() else None
        from megatron.core import parallel_state as ps

        result = step.train_step(
            chunks,
            optimizer,
            data,
            SEQ_LEN,
            MICRO_BATCH // ps.get_data_parallel_world_size(),
            step_optimizer=False,
        )
        table = result["loss"] or {}
        losses.append(
            {
                i: [a["kd_sum"], a["tokens"], a["budget_loss_sum"], a["count"]]
                for i, a in table.items()
            }
        )
        if iteration == 1:
            if grads_out is not None:
                with params_replaced_by(model, "main_grad"):
                    save_dist(model, grads_out)
            else:
                if chunks[0].ddp_config.use_distributed_optimizer:
                    from tests.support.equivalence import gather_sharded_grads

                    gather_sharded_grads(chunks[0])
                with params_replaced_by(model, "main_grad"):
                    with canonical_weights(model):
                        grads = {n: p.data.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
    return losses, grads


def _gather_losses(losses):
    """Sum every rank's per-budget sums (DP ranks hold different micro-batches; TP ranks of the
    last stage hold copies: divide by TP)."""
    from megatron.core import parallel_state as ps

    out = []
    for table in losses:
        packed = torch.zeros(8, 4, dtype=torch.float64)
        if ps.is_pipeline_last_stage():
            for index, row in table.items():
                packed[index] = torch.tensor(row, dtype=torch.float64)
        if dist.get_world_size() > 1:
            dist.all_reduce(packed)
        packed /= ps.get_tensor_model_parallel_world_size()
        out.append({i: (packed[i, 0] / packed[i, 1]).item() for i in range(8) if packed[i, 1] > 0})
    return out


def make_elastic_reference(
    config_path: str,
    workdir: str,
    pattern: str | None = None,
    mode: str = "sliced",
    heterogeneous: bool = False,
    seed: int = 1234,
    fp8_gemm: str = "off",
    runtime: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """1 rank: the initial checkpoint, then the elastic steps' losses, choices and gradients."""
    from elastic_plugin.parallel import Layout

    work = Path(workdir)
    cfg = _experiment(config_path, pattern)
    write_init_checkpoint(cfg, work / "init", seed)
    cfg, chunks, optimizer, step = _setup(
        config_path, work, Layout(), pattern, mode, heterogeneous, seed, fp8_gemm, runtime
    )
    losses, _ = _run(cfg, chunks, optimizer, step, work / "grads")
    result = {"losses": _gather_losses(losses), "trace": step.trace}
    (work / "reference.json").write_text(json.dumps(result))
    return result


def reference_losses(workdir: str) -> list[dict[int, float]]:
    """The per-budget losses ``make_elastic_reference`` recorded in ``workdir``."""
    reference = json.loads((Path(workdir) / "reference.json").read_text())
    return [{int(k): v for k, v in t.items()} for t in reference["losses"]]


def check_elastic(
    config_path: str,
    workdir: str,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
    distributed_optimizer: bool = False,
    pattern: str | None = None,
    mode: str = "sliced",
    heterogeneous: bool = False,
    seed: int = 1234,
    fp8_gemm: str = "off",
    runtime: dict[str, Any] | None = None,
    cp: int = 1,
) -> dict[str, Any]:
    """N ranks: the same elastic steps under a layout; differences vs the reference
    (``runtime``: this run's BF16 / recomputation, which the reference need not share)."""
    from elastic_plugin.checkpoint.io import build_from_checkpoint
    from elastic_plugin.elastic.model import attach_elastic
    from elastic_plugin.parallel import Layout

    work = Path(workdir)
    layout = Layout(tp, pp, ep, sequence_parallel, distributed_optimizer, cp)
    cfg, chunks, optimizer, step = _setup(
        config_path, work, layout, pattern, mode, heterogeneous, seed + 17, fp8_gemm, runtime
    )
    losses, grads = _run(cfg, chunks, optimizer, step, None)
    # the reference gradients, loaded into this layout (canonical order, contiguous shards)
    ref_chunks, _, _ = build_from_checkpoint(work / "init", layout)
    ref_model = ref_chunks[0]
    attach_elastic(ref_model, step.state.resolved, layout.sequence_parallel and tp > 1)
    load_dist(ref_model, work / "grads")
    ref_grads = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    grad_diff, grad_where = _max_diff(grads, ref_grads)
    router_keys = [n for n in grads if "elastic_router" in n]
    router_diff, _ = _max_diff(
        {k: grads[k] for k in router_keys}, {k: ref_grads[k] for k in router_keys}
    )
    reference = json.loads((work / "reference.json").read_text())
    return {
        "rank": dist.get_rank(),
        "losses": _gather_losses(losses),
        "ref_losses": reference_losses(workdir),
        "trace": step.trace,
        "ref_trace": reference["trace"],
        "grad_max_abs_diff": grad_diff,
        "grad_worst_param": grad_where,
        "grad_max_abs": max(v.abs().max().item() for v in ref_grads.values()),
        "router_grad_max_abs_diff": router_diff,
        "router_grad_max_abs": max(
            (ref_grads[k].abs().max().item() for k in router_keys), default=0.0
        ),
        "num_router_params": len(router_keys),
    }


def _synthetic_iterator(vocab: int, micro_batch: int, consumed: int):
    """Micro-batches that depend only on the sample index (what a resumed loader gives)."""
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    index = consumed
    while True:
        rows = []
        for _ in range(dp):
            gen = torch.Generator().manual_seed(10_000 + index)
            rows.append(torch.randint(0, vocab, (micro_batch, SEQ_LEN + 1), generator=gen))
            index += micro_batch
        seq = rows[rank]
        yield {
            "tokens": seq[:, :-1].contiguous(),
            "labels": seq[:, 1:].contiguous(),
            "loss_mask": torch.ones(micro_batch, SEQ_LEN),
            "position_ids": torch.arange(SEQ_LEN).expand(micro_batch, SEQ_LEN),
        }


def train_and_resume(
    config_path: str,
    workdir: str,
    iters: int = 6,
    stop: int = 3,
    tp: int = 1,
    pp: int = 1,
    sequence_parallel: bool = False,
    freeze_after: int | None = None,
    freeze_select: str = "likelihood",
    freeze_candidates: int | None = None,
    fp8_gemm: str = "off",
    damage_newest: bool = False,
    preempt: bool = False,
) -> dict[str, Any]:
    """The loss trace of an uninterrupted run vs. a run stopped after ``stop`` iterations and
    resumed from its checkpoint (optimizer, LR schedule, router, data position); with
    ``freeze_after`` the router freezes after that many iterations, picking each budget's model
    by ``freeze_select`` (the frozen choices must survive the resume). ``fp8_gemm``: the
    student's GEMM precision (``elastic.fp8_gemm``). ``damage_newest``: the stopped run saves
    every iteration keeping 2 (history), then its newest save gets flipped bytes; the resume
    must skip it, say so, and continue from the save before, still reproducing the trace.
    ``preempt``: the run is stopped not by ``stop_after`` but by SIGTERM, which rank 0 sends
    itself while drawing iteration ``stop``'s first micro-batch (the step finishes, every rank
    learns of it at the step boundary, saves and stops)."""
    import contextlib
    import dataclasses
    import io

    import torch.distributed as dist

    from elastic_plugin.checkpoint.history import LATEST_FILE, iteration_dirs
    from elastic_plugin.elastic.train import train_elastic
    from elastic_plugin.parallel import Layout
    from tests.support.integrity_cases import flip_middle

    work = Path(workdir)
    cfg = _experiment(config_path, None)
    if not (work / "init" / "elastic_meta.json").is_file():
        write_init_checkpoint(cfg, work / "init")
    ecfg = _elastic_config(cfg.model, "sliced", False, fp8_gemm)
    if freeze_after is not None:
        ecfg = dataclasses.replace(
            ecfg,
            router=dataclasses.replace(
                ecfg.router,
                freeze_after=freeze_after,
                freeze_select=freeze_select,
                freeze_candidates=freeze_candidates,
            ),
        )
    layout = Layout(tp=tp, pp=pp, sequence_parallel=sequence_parallel)
    sched = tiny_schedule(iters, 2e-3, warmup=2)
    make_iter = lambda consumed: _synthetic_iterator(cfg.model.vocab_size, 4, consumed)  # noqa: E731
    valid = lambda: _synthetic_iterator(cfg.model.vocab_size, 4, 10**6)  # noqa: E731
    full = train_elastic(
        cfg, ecfg, layout, work / "init", work / "full", make_iter, valid, sched, progress=False
    )
    part_sched = (
        dataclasses.replace(sched, save_interval=1, keep_last=2) if damage_newest else sched
    )

    def train_part(make_iter=make_iter, **how: Any):
        """The interrupted run: stopped (``stop_after`` or a signal), then continued."""
        return train_elastic(
            cfg, ecfg, layout, work / "init", work / "part", make_iter, valid, part_sched,
            progress=False, **how,
        )  # fmt: skip

    if preempt:
        world = dist.get_world_size() if dist.is_initialized() else 1
        per_iteration = sched.global_batch_size // (4 * (world // (tp * pp)))  # micro-batches
        part = train_part(make_iter=_preempting(make_iter, (stop - 1) * per_iteration))
    else:
        part = train_part(stop_after=stop)
    stage = work / "part" / "checkpoints" / "elastic"
    history: dict[str, Any] = {}
    if damage_newest:
        saves = iteration_dirs(stage)
        history = {
            "saves_after_stop": [p.name for _, p in saves],
            "latest_after_stop": (stage / LATEST_FILE).read_text().strip(),
        }
        if not dist.is_initialized() or dist.get_rank() == 0:
            newest = saves[0][1]
            flip_middle(max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size))
        if dist.is_initialized():
            dist.barrier()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rest = train_part(resume=True)
    if damage_newest:
        history |= {
            "resume_printed": printed.getvalue(),
            "saves_after_resume": [p.name for _, p in iteration_dirs(stage)],
            "latest_after_resume": (stage / LATEST_FILE).read_text().strip(),
        }

    def trace(run):
        return [(h["iteration"], h["train_loss"]) for h in run.history if "train_loss" in h]

    first_resumed = rest.history[0]["iteration"] if rest.history else stop + 1
    return {
        **history,
        "full": trace(full),
        "resumed": [t for t in trace(part) if t[0] < first_resumed] + trace(rest),
        "full_valid": full.final_valid,
        "resumed_valid": rest.final_valid,
        "choices_full": full.choices,
        "choices_resumed": rest.choices,
        "choices_per_iteration": [
            (h["iteration"], h["choices"]) for h in full.history if "choices" in h
        ],
        "frozen_meta": _elastic_meta(work / "full").get("frozen_choices"),
        "freeze_search": _elastic_meta(work / "full").get("freeze_search"),
        "freeze_search_resumed": _elastic_meta(work / "part").get("freeze_search"),
        "fp8_gemm_meta": _read_meta(work / "full" / "checkpoints" / "elastic")["config"]["elastic"][
            "fp8_gemm"
        ],
        "iterations": (part.iterations, rest.iterations),
        "preempted_by": part.preempted_by,
    }


def _preempting(make_iter, at_microbatch: int):
    """``make_iter`` whose rank-0 iterator sends this process SIGTERM (as a scheduler and
    torchrun do) when it draws its ``at_microbatch``-th micro-batch (0-based)."""
    import os
    import signal

    import torch.distributed as dist

    def start(consumed: int):
        batches = make_iter(consumed)
        if batches is None or (dist.is_initialized() and dist.get_rank() != 0):
            return batches

        def drawn():
            for index, batch in enumerate(batches):
                if index == at_microbatch:
                    os.kill(os.getpid(), signal.SIGTERM)
                yield batch

        return drawn()

    return start


def _read_meta(ckpt: Path) -> dict[str, Any]:
    from elastic_plugin.checkpoint.meta import read_checkpoint_meta

    return read_checkpoint_meta(ckpt)


def _elastic_meta(run_dir: Path) -> dict[str, Any]:
    return _read_meta(run_dir / "checkpoints" / "elastic")["elastic"]


def route_trace(
    config_path: str,
    workdir: str,
    iters: int = 50,
    tp: int = 1,
    pp: int = 1,
    sequence_parallel: bool = False,
) -> list:
    """Router choices of ``iters`` iterations x micro-batches on this rank (no model compute)."""
    from megatron.core import parallel_state as ps

    from elastic_plugin.parallel import Layout

    work = Path(workdir)
    cfg = _experiment(config_path, None)
    write_init_checkpoint(cfg, work / "init")
    layout = Layout(tp=tp, pp=pp, sequence_parallel=sequence_parallel)
    _, chunks, _, step = _setup(config_path, work, layout, None, "sliced", True, seed=99)
    step.sampler = step.sampler.__class__(step.sampler.budgets, None, seed=5, total_iters=iters)
    for iteration in range(1, iters + 1):
        step.iteration = iteration
        for local in range(step.num_microbatches):
            step.route(chunks[0], local)
    step.state.clear()
    return [ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), step.trace]


def self_teacher_and_param_groups(config_path: str, workdir: str) -> dict[str, Any]:
    """teacher=self: the teacher pass is the model at full budget (so the full choice has zero
    KD loss); the router sits in its own optimizer group at lr x lr_mult."""
    from elastic_plugin.elastic.model import router_of
    from elastic_plugin.parallel import Layout

    work = Path(workdir)
    cfg = _experiment(config_path, None)
    write_init_checkpoint(cfg, work / "init")
    _, chunks, optimizer, step = _setup(config_path, work, Layout(), None, "sliced", False, 1234)
    step.teacher_chunks = None
    full_index = []
    original = step.route

    def route_full_or_drawn(model, local):
        index, probs = original(model, local)
        if local == 0:  # force micro-batch 0 onto the full model: largest candidate everywhere
            for p in probs.values():
                p.data.zero_()
                p.data[..., 0] = 1.0
            step.state.set_choice(probs, "sliced", with_masks=True)
            full_index.append(index)
        return index, probs

    step.route = route_full_or_drawn
    step.iteration = 1
    data = iter(_iteration_batches(cfg.model.vocab_size, 1))
    result = step.train_step(chunks, optimizer, data, SEQ_LEN, MICRO_BATCH, step_optimizer=False)
    reports = result["reports"]
    router_ids = {id(p) for p in router_of(chunks[0]).parameters()}
    groups = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.param_groups:
            has_router = any(
                id(getattr(p, "_model_param", p)) in router_ids
                or getattr(p, "elastic_router", False)
                for p in group["params"]
            )
            groups.append({"router": has_router, "max_lr": group.get("max_lr")})
    return {
        "kd_first": float(reports[0]["elastic"][0]),
        "kd_second": float(reports[1]["elastic"][0]),
        "groups": groups,
    }


def memory_per_parameter(
    config_path: str, workdir: str, distributed_optimizer: bool = False
) -> dict[str, Any]:
    """Bytes per BF16 parameter that a BF16 elastic student really allocates: its weight,
    Megatron DDP's gradient buffer and Megatron's optimizer state (its FP32 main copy and Adam's
    two moments, after one step creates them), next to Megatron-LM's arithmetic
    (``theoretical_memory_usage``: 18 bytes, or 6 + 12 / DP with the distributed optimizer).
    The FP32 parameters (the router; Mamba's ``A_log`` and ``D``, FP32 by Megatron's design)
    are listed apart. ``workdir`` must hold the ``init`` checkpoint."""
    from megatron.core import parallel_state as ps

    from elastic_plugin.elastic.model import build_elastic_chunks
    from elastic_plugin.models.runtime import Runtime
    from elastic_plugin.parallel import Layout, build_optimizer, initialize_layout

    cfg = _experiment(config_path, None)
    layout = Layout(distributed_optimizer=distributed_optimizer)
    resolved = _elastic_config(cfg.model, "sliced", False).resolve(cfg.model)
    initialize_layout(layout)
    chunks, _, _ = build_elastic_chunks(
        Path(workdir) / "init", layout, resolved, runtime=Runtime(bf16=True)
    )
    optimizer = build_optimizer(chunks, lr=1e-3, distributed_optimizer=distributed_optimizer)
    optimizer.zero_grad()
    optimizer.step()  # Adam's moments exist from the first step on
    ddp: Any = chunks[0]  # Megatron's DDP (untyped)
    model: torch.nn.Module = ddp.module
    low = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    fp32 = {n: p.numel() for n, p in model.named_parameters() if p.dtype == torch.float32}
    n = sum(p.numel() for p in low)
    grad_bytes = sum(
        b.grad_data.numel() * b.grad_data.element_size()
        for b in ddp.buffers
        if b.param_dtype == torch.bfloat16
    )
    state_bytes = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        groups = getattr(opt, "shard_fp32_from_float16_groups", None)
        if groups is None:
            groups = opt.fp32_from_float16_groups
        for group in groups:
            for main in group:
                state = opt.optimizer.state.get(main, {})
                state_bytes += main.numel() * main.element_size() + sum(
                    t.numel() * t.element_size()
                    for k, t in state.items()
                    if k in ("exp_avg", "exp_avg_sq")
                )
    dp = ps.get_data_parallel_world_size()
    return {
        "bf16_params": n,
        "fp32_params": fp32,
        "weight_bytes_per_param": sum(p.numel() * p.element_size() for p in low) / n,
        "grad_bytes_per_param": grad_bytes / n,
        "optimizer_bytes_per_param": state_bytes / n,
        "megatron_bytes_per_param": 6 + 12 / dp if distributed_optimizer else 18,
        "dp": dp,
    }


def write_init_checkpoint_at(config_path: str, path: str) -> None:
    """``write_init_checkpoint`` of the tiny model at ``path`` (a rank-pool entry point)."""
    write_init_checkpoint(_experiment(config_path, None), Path(path))


def bf16_and_fp32_traces(config_path: str, workdir: str, iters: int = 20) -> dict[str, Any]:
    """The per-budget KD loss of every iteration of ``train_elastic`` in FP32 and in BF16
    (same data, seed and schedule), and the dtype each run's checkpoint records."""
    import dataclasses

    from elastic_plugin.elastic.train import train_elastic
    from elastic_plugin.parallel import Layout

    work = Path(workdir)
    cfg = _experiment(config_path, None)
    write_init_checkpoint(cfg, work / "init")
    ecfg = _elastic_config(cfg.model, "sliced", False)
    sched = tiny_schedule(iters, 5e-3, warmup=2)
    out: dict[str, Any] = {}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        run_cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, bf16=bf16))
        run = train_elastic(
            run_cfg, ecfg, Layout(), work / "init", work / name,
            lambda c: _synthetic_iterator(cfg.model.vocab_size, 4, c),
            lambda: _synthetic_iterator(cfg.model.vocab_size, 4, 10**6), sched, progress=False,
        )  # fmt: skip
        out[name] = [h["train_loss"] for h in run.history if h.get("train_loss")]
        out[f"{name}_valid"] = run.final_valid
        out[f"{name}_dtype"] = _read_meta(Path(run.checkpoint_dir)).get("params_dtype")
        out[f"{name}_ckpt"] = run.checkpoint_dir
        out[f"{name}_throughput"] = run.history[-1]["throughput"]
    out["cross_load"] = _cross_dtype_loads(Path(out["bf16_ckpt"]), Path(out["fp32_ckpt"]))
    return out


def _cross_dtype_loads(bf16_ckpt: Path, fp32_ckpt: Path) -> dict[str, Any]:
    """A BF16 checkpoint read by an FP32 tool holds exactly the BF16 values; an FP32 one read
    in BF16 holds them rounded to BF16 (max abs differences, 0 expected for both)."""
    from elastic_plugin.checkpoint.io import build_from_checkpoint
    from elastic_plugin.parallel import Layout

    def weights(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        chunks, _, _ = build_from_checkpoint(path, Layout(), params_dtype=dtype)
        return {n: p.detach().clone() for n, p in chunks[0].named_parameters()}

    out: dict[str, Any] = {}
    for label, path, low_first in (
        ("bf16_in_fp32", bf16_ckpt, True),
        ("fp32_in_bf16", fp32_ckpt, False),
    ):
        low, high = weights(path, torch.bfloat16), weights(path, torch.float32)
        out[f"{label}_dtypes"] = sorted(
            {str(t.dtype) for t in (high if low_first else low).values()}
        )
        out[label] = max(
            (high[n].to(torch.bfloat16).float() - low[n].float()).abs().max().item()
            if not low_first
            else (high[n] - low[n].float()).abs().max().item()
            for n in low
        )
    return out


def flops_of_a_step(config_path: str, workdir: str) -> dict[str, Any]:
    """One elastic iteration's counted model FLOPs (``ElasticStep.take_flops``) next to the sum
    the trace implies: ``models.flops.training_flops`` of each micro-batch's routed choice plus
    the teacher's forward of every micro-batch (the full model)."""
    from elastic_plugin.models.flops import forward_flops, training_flops
    from elastic_plugin.parallel import Layout

    work = Path(workdir)
    cfg = _experiment(config_path, None)
    write_init_checkpoint(cfg, work / "init")
    cfg, chunks, optimizer, step = _setup(config_path, work, Layout(), None, "sliced", False, 1234)
    step.iteration = 1
    step.train_step(
        chunks, optimizer, iter(_iteration_batches(cfg.model.vocab_size, 1)), SEQ_LEN,
        MICRO_BATCH, step_optimizer=False,
    )  # fmt: skip
    resolved = step.state.resolved
    expected = REF_MICROBATCHES * forward_flops(cfg.model, SEQ_LEN, MICRO_BATCH).total
    choices = []
    for _, _, _, picks in step.trace or []:
        choice = {n: resolved.axes[n].candidates[picks[n][0]] for n in resolved.axes}
        choices.append(choice)
        expected += training_flops(cfg.model, SEQ_LEN, MICRO_BATCH, choice, full_router=True).total
    return {
        "counted": step.take_flops(),
        "expected": expected,
        "choices": choices,
        "full": resolved.full_choice(),
        "after_take": step.flops,
    }


def save_without_optimizer(config_path: str, workdir: str) -> dict[str, Any]:
    """Two iterations saved with and without the optimizer state (``save_optimizer``,
    ``--no-save-optim``): the bytes each save holds, the flag its metadata keeps, and what a
    ``--resume`` from the model-only save raises."""
    from elastic_plugin.checkpoint.history import iteration_dirs
    from elastic_plugin.checkpoint.meta import read_checkpoint_meta
    from elastic_plugin.elastic.train import train_elastic
    from elastic_plugin.models.config import ConfigError
    from elastic_plugin.parallel import Layout

    work = Path(workdir)
    cfg = _experiment(config_path, None)
    if not (work / "init" / "elastic_meta.json").is_file():
        write_init_checkpoint(cfg, work / "init")
    ecfg = _elastic_config(cfg.model, "sliced", False, "off")
    sched = tiny_schedule(2, 2e-3, warmup=1)
    make_iter = lambda consumed: _synthetic_iterator(cfg.model.vocab_size, 4, consumed)  # noqa: E731
    out: dict[str, Any] = {}
    for name, keep in (("with", True), ("without", False)):
        train_elastic(
            cfg, ecfg, Layout(), work / "init", work / name, make_iter, None, sched,
            progress=False, save_optimizer=keep,
        )  # fmt: skip
        ((_, save),) = iteration_dirs(work / name / "checkpoints" / "elastic")
        out[name] = {
            "bytes": sum(f.stat().st_size for f in save.rglob("*") if f.is_file()),
            "optimizer_saved": read_checkpoint_meta(save).get("optimizer_saved"),
        }
    try:
        train_elastic(
            cfg, ecfg, Layout(), work / "init", work / "without", make_iter, None,
            tiny_schedule(3, 2e-3, warmup=1), progress=False, resume=True,
        )  # fmt: skip
        out["resume_error"] = None
    except ConfigError as exc:
        out["resume_error"] = str(exc)
    return out
