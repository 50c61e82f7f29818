"""Elastic nested training inside a user's own Megatron-LM script (``pretrain_mamba.py`` style).

Four lines turn a script of Megatron-LM's structure (model provider, ``get_batch``, forward
step, dataset provider, ``pretrain``) into an elastic run (README, "Inside your Megatron-LM
pipeline")::

    from elastic_plugin.elastic import megatron_lm_pretrain as elastic

    elastic.install()
    model_provider = elastic.wrap_model_provider(model_provider)
    forward_step = elastic.elastic_forward_step(get_batch)
    extra_args_provider = elastic.wrap_extra_args(extra_args_provider)

* ``wrap_model_provider``: the user's provider builds the student (its spec, its flags); the
  wrapper checks the flags against ``--elastic-ckpt`` first, loads the checkpoint into it, adds
  the budget router, and builds the frozen teacher with the same provider (kept here, outside
  Megatron's model list, optimizer and checkpoints).
* ``elastic_forward_step``: reads the user's batch, draws this micro-batch's budget, routes,
  runs the student and distils from the teacher's logits; evaluation runs every budget's nested
  model in turn (``lm loss <budget>``).
* ``install``: CPU adaptations (a no-op with CUDA), ``--save``/``--load`` in the elastic layout
  (``elastic.megatron_lm``), the ``elastic |`` log line (``elastic.megatron_lm_log``), the
  router's parameter group in Megatron-LM's optimizer.

Where the whole model is on one pipeline stage, the teacher's logits are computed inline in the
forward step. Under pipeline parallelism each stage holds its part of the teacher (the provider
builds it with the stage's ``pre_process`` / ``post_process``), and ``install`` wraps Megatron-LM's
``train_step``: it reads the iteration's micro-batches once, runs the teacher forward-only through
Megatron's pipeline schedule (logits kept on the last stage), then runs the student's 1F1B on the
same micro-batches, as ``elastic-plugin elastic-train`` does (``bench/bench_pretrain_pp.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from elastic_plugin.elastic.megatron_lm import unwrap_chunk
from elastic_plugin.elastic.megatron_lm_args import (
    add_pretrain_elastic_args,
    align_rotary,
    check_built_vocab,
    elastic_setup,
)
from elastic_plugin.models.config import ConfigError

__all__ = [
    "ElasticSession",
    "checkpoint_meta_for_save",
    "elastic_forward_step",
    "install",
    "session",
    "wrap_extra_args",
    "wrap_model_provider",
]

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
"""The order of Megatron-LM's ``get_batch`` tuple (``get_batch_on_this_tp_rank``'s dict)."""


@dataclass
class ElasticSession:
    """What the forward step needs and Megatron's model does not hold: the frozen teacher and the
    budget sampling / routing / loss state (``elastic.step.ElasticStep``)."""

    step: Any  # ElasticStep
    teacher: Any  # torch.nn.Module, frozen, outside the optimizer and the checkpoint
    resolved: Any  # ResolvedElastic
    train_iters: int
    cfg: Any  # ExperimentConfig of --elastic-ckpt
    ecfg: Any  # ElasticConfig (the checkpoint's elastic: section, then the --elastic-* flags)
    source_meta: dict  # --elastic-ckpt's metadata (its data and tokenizer, for our tools)
    pipelined: bool = False  # PP > 1: the teacher runs in the schedule (wrapped train_step)
    carry: bool = False  # this step's p2p tensors carry the teacher's hidden states too
    stage_input: Any = None  # the p2p tensor Megatron handed this stage ([2, s, b, h] or None)
    log: Any = None  # ElasticLog: per-budget losses, choices, throughput
    _iteration: int = -1
    _local: int = 0
    _eval_local: int = 0


_SESSION: ElasticSession | None = None


def session() -> ElasticSession:
    if _SESSION is None:
        raise RuntimeError("elastic_plugin: the wrapped model provider has not run yet")
    return _SESSION


def reset_session() -> None:
    """Forget the run (tests building several models in one process)."""
    global _SESSION
    _SESSION = None


def exit_on_config_error(fn: Callable) -> Callable:
    """Bad flags stop every rank with ``<script>: error: ...`` and exit status 2, as argparse
    does, instead of a traceback per rank inside Megatron's loop."""

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError as exc:
            print(f"{Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)

    return run


# ------------------------------------------------------------------------------ model provider
def wrap_model_provider(build: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron model provider around the user's: the student starts from ``--elastic-ckpt``,
    gets the budget router, and a frozen teacher is built by the same provider."""

    @exit_on_config_error
    def model_provider(*args: Any, **kwargs: Any):
        from megatron.training import get_args

        margs = get_args()
        cfg, ecfg, resolved, source_meta = elastic_setup(margs)  # before anything is built
        model = build(*args, **kwargs)
        check_built_vocab(unwrap_chunk(model), cfg.model, margs.elastic_ckpt)
        align_rotary(unwrap_chunk(model), cfg.model)  # Megatron-LM's hybrid builder: no scaling
        teacher_dir = margs.elastic_teacher_ckpt or margs.elastic_ckpt
        teacher = build(*args, **kwargs)
        align_rotary(unwrap_chunk(teacher), cfg.model)
        _start_session(margs, model, teacher, teacher_dir, cfg, ecfg, resolved, source_meta)
        return model

    return model_provider


def _start_session(margs, model, teacher, teacher_dir, cfg, ecfg, resolved, source_meta) -> None:
    global _SESSION
    import torch

    from elastic_plugin.checkpoint.io import load_checkpoint
    from elastic_plugin.elastic.cost import ElasticCost
    from elastic_plugin.elastic.model import attach_elastic, finalize_router_grads
    from elastic_plugin.elastic.router import AnnealSchedule
    from elastic_plugin.elastic.sampling import BudgetSampler
    from elastic_plugin.elastic.step import ElasticStep

    load_checkpoint([model], margs.elastic_ckpt)
    state = attach_elastic(
        model,
        resolved,
        bool(margs.sequence_parallel) and margs.tensor_model_parallel_size > 1,
        router_seed=margs.seed,
    )
    # Megatron-LM keeps a finalize hook the model's config already carries: the router's
    # gradients are summed over pipeline stages before Megatron's own reduction
    model.config.finalize_model_grads_func = finalize_router_grads
    load_checkpoint([teacher], teacher_dir)
    teacher.requires_grad_(False)
    teacher.eval()
    if torch.cuda.is_available():
        teacher.cuda(torch.cuda.current_device())
    if getattr(margs, "bf16", False) or getattr(margs, "fp16", False):
        from megatron.core.transformer.module import Float16Module

        teacher = Float16Module(teacher.config, teacher)
    total = margs.train_iters or max(1, (margs.train_samples or 1) // margs.global_batch_size)
    anneal = ecfg.router.anneal_iters or total
    stages = ecfg.curriculum_in_iterations(margs.global_batch_size, margs.seq_length)
    step = ElasticStep(
        state=state,
        sampler=BudgetSampler(resolved.budgets, stages, margs.seed, total),
        cost=ElasticCost(cfg.model, resolved),
        temperature=AnnealSchedule(ecfg.router.temperature[0], ecfg.router.temperature[1], anneal),
        logit_scale=AnnealSchedule(ecfg.router.logit_scale[0], ecfg.router.logit_scale[1], anneal),
        num_microbatches=1,  # the forward step sets Megatron's current number
        teacher_chunks=[teacher],
    )
    pipelined = (margs.pipeline_model_parallel_size or 1) > 1
    _SESSION = ElasticSession(step, teacher, resolved, total, cfg, ecfg, source_meta, pipelined)
    _SESSION.log = _elastic_log(model, step, resolved)


def _elastic_log(model, step, resolved):
    """The ``elastic |`` log line's accumulator (``elastic.megatron_lm_log``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from elastic_plugin.elastic.megatron_lm_log import ElasticLog
    from elastic_plugin.elastic.model import router_of
    from elastic_plugin.elastic.train import choice_table

    return ElasticLog(
        list(resolved.budgets),
        {name: spec.full for name, spec in resolved.axes.items()},
        lambda: choice_table(router_of(model), resolved),
        step.take_flops,
        world=dist.get_world_size(),
        data_parallel=ps.get_data_parallel_world_size(),
        # the per-budget sums over every rank that holds tokens of the step: under context
        # parallelism each sequence's tokens are spread over the CP ranks (as Megatron reduces
        # its own losses)
        group=ps.get_data_parallel_group(with_context_parallel=True),
    )


# ------------------------------------------------------------------------------ forward step
def as_batch(got: Any) -> dict[str, Any]:
    """The user's ``get_batch`` result as a dict: a dict, or Megatron-LM's tuple (or
    ``dict.values()``) of tokens, labels, loss_mask, attention_mask, position_ids."""
    if isinstance(got, dict):
        return got
    values = tuple(got)
    if len(values) != len(BATCH_KEYS):
        raise ValueError(
            f"get_batch returned {len(values)} values; the elastic forward step expects a dict "
            f"or ({', '.join(BATCH_KEYS)})"
        )
    return dict(zip(BATCH_KEYS, values, strict=True))


def _position_ids(batch: dict) -> Any:
    import torch

    tokens = batch.get("tokens")
    if batch.get("position_ids") is not None or tokens is None:  # None: a middle stage
        return batch.get("position_ids")
    return torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)


def _train_loss(step, teacher_index: int | None, index: int, probs, batch: dict, output_tensor):
    """``ElasticStep._loss`` (KD + budget loss) reported the way Megatron's loop logs losses
    (all budgets together; per budget in the ``elastic |`` line, ``session().log``).
    ``teacher_index``: this micro-batch's logits in the teacher pass; None: computed inline."""
    import torch

    try:
        local = 0 if teacher_index is None else teacher_index
        total, num_tokens, report = step._loss(local, index, probs, batch, output_tensor)
    finally:
        if teacher_index is None:
            step._teacher_logits = []
    session().log.add(report["elastic"])
    kd_sum, tokens, b_loss = (report["elastic"][i].to(total.device) for i in range(3))
    return (
        total,
        num_tokens,
        {
            "kd loss": torch.stack([kd_sum, tokens]).float(),
            "budget loss": torch.stack([b_loss * tokens, tokens]).float(),
        },
    )


def _eval_loss(labels_budget: list[str], current: str, loss_mask, output_tensor):
    """Per-token LM loss of the budget this micro-batch evaluated; zeros for the others, so
    Megatron's evaluation (sums over all micro-batches) yields one mean per budget."""
    import torch

    mask = loss_mask.float()
    loss_sum = (output_tensor.float() * mask).sum()
    tokens = mask.sum()
    zero = torch.zeros(2, device=loss_sum.device)
    report = {
        f"lm loss {label}": (torch.stack([loss_sum.detach(), tokens]) if label == current else zero)
        for label in labels_budget
    }
    return loss_sum, tokens.to(torch.int), report


def elastic_forward_step(get_batch: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    """Megatron forward step on the user's ``get_batch(data_iterator)``. Training: draw this
    micro-batch's budget, route, run the student, distil from the teacher's logits computed
    here. Evaluation: each budget's nested model (the router's hard choice) in turn."""

    def forward_step(data_iterator, model):
        import torch
        from megatron.core import parallel_state
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training import get_args

        from elastic_plugin.elastic.model import router_of
        from elastic_plugin.elastic.step import set_model_input, truncate_batch
        from elastic_plugin.elastic.train import choice_table

        run = session()
        step = run.step
        inner = unwrap_chunk(model)
        batch = as_batch(get_batch(data_iterator))
        if not inner.training:
            table = choice_table(router_of(inner), run.resolved)
            labels = list(table)
            current = labels[run._eval_local % len(labels)]
            run._eval_local += 1
            step.state.set_sizes(table[current])
            output = model(
                batch["tokens"],
                _position_ids(batch),
                batch.get("attention_mask"),
                labels=batch["labels"],
            )
            return output, partial(_eval_loss, labels, current, batch["loss_mask"])
        iteration = int(getattr(get_args(), "curr_iteration", 0) or 0) + 1
        if iteration != run._iteration:
            run._iteration, run._local = iteration, 0
            run.log.iteration_started()
        step.iteration = iteration
        step.num_microbatches = get_num_microbatches()
        local = run._local
        run._local += 1
        batch = truncate_batch(batch, step.sampler.seq_length(iteration))
        step._shape = tuple(batch["tokens"].shape[::-1])  # (sequence length, micro-batch size)
        teacher_out = None
        if not run.pipelined or run.carry:  # else the wrapped train_step's teacher pass has run
            received = run.stage_input if run.carry else None
            with torch.no_grad():
                if run.carry:
                    set_model_input(run.teacher, None if received is None else received[1])
                teacher_out = run.teacher(
                    batch.get("tokens"), _position_ids(batch), batch.get("attention_mask")
                ).detach()
            if run.carry:
                set_model_input(inner, None if received is None else received[0])
            step._teacher_logits = [teacher_out]
        index, probs = step.route(inner, local)
        active = step.state.is_active
        step.flops += step.choice_flops(probs if active else None) + step.choice_flops(None, False)
        output = model(batch.get("tokens"), _position_ids(batch), batch.get("attention_mask"))
        teacher_index = local if run.pipelined and not run.carry else None
        if run.carry and not parallel_state.is_pipeline_last_stage():
            step._teacher_logits = []  # hidden states, sent on with the student's
            output = torch.stack([output, teacher_out])
        return output, partial(_train_loss, step, teacher_index, index, probs, batch)

    forward_step.elastic_get_batch = get_batch  # type: ignore[attr-defined]  # the teacher pass
    return forward_step


def _teacher_pass(run: ElasticSession, get_batch, items, num_microbatches, seq_length, mbs):
    """The frozen teacher forward-only through Megatron's pipeline schedule over the iteration's
    micro-batches; the last stage keeps each micro-batch's logits for the student's loss."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from elastic_plugin.elastic.step import Replay, truncate_batch

    logits: list[Any] = []

    def teacher_step(data_iterator, model):
        batch = truncate_batch(as_batch(get_batch(data_iterator)), seq_length)
        output = model(batch.get("tokens"), _position_ids(batch), batch.get("attention_mask"))

        def keep(output_tensor):
            logits.append(output_tensor.detach())
            return output_tensor.sum() * 0.0, {}

        return output, keep

    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=teacher_step,
            data_iterator=None if items is None else Replay(items),
            model=[run.teacher],
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=mbs,
            forward_only=True,
        )
    run.step._teacher_logits = logits


def _carrying_teacher(run: ElasticSession, model: list, args: tuple, kwargs: dict):
    """Megatron-LM's ``train_step`` arguments with a ``forward_backward_func`` whose p2p tensors
    carry the teacher's hidden states with the student's (``elastic.step.with_teacher_shapes``),
    and the stage's received tensor captured for the forward step to split; None where the
    schedule has no shape hook (an interleaved schedule) or the teacher pass is asked for."""
    import contextlib

    from elastic_plugin.elastic.step import inner_model, with_teacher_shapes

    if not run.step.teacher_in_schedule or len(model) != 1:
        return None
    position = 3  # train_step(fs, it, model, optimizer, scheduler, config, forward_backward_func)
    func = kwargs.get("forward_backward_func", args[position] if len(args) > position else None)
    if func is None:
        return None

    def forward_backward(*a: Any, **kw: Any) -> Any:
        kw["adjust_tensor_shapes_fn"] = with_teacher_shapes
        return func(*a, **kw)

    if "forward_backward_func" in kwargs:
        kwargs = {**kwargs, "forward_backward_func": forward_backward}
    else:
        args = (*args[:position], forward_backward, *args[position + 1 :])
    inner = inner_model(model[0])

    def capture(input_tensor: Any) -> None:
        tensors = input_tensor if isinstance(input_tensor, list) else [input_tensor]
        run.stage_input = tensors[0]

    @contextlib.contextmanager
    def carrying():
        inner.set_input_tensor = capture
        run.carry = True
        try:
            yield
        finally:
            del inner.set_input_tensor
            run.carry, run.stage_input = False, None

    return args, kwargs, carrying()


def _wrap_train_step(orig: Callable) -> Callable:
    """Megatron-LM's ``train_step`` under PP with the teacher inside the schedule (its hidden
    states in the student's p2p tensors, ``_carrying_teacher``), or, where that cannot be, the
    teacher pass first; the student's schedule runs at the curriculum's sequence length."""
    import functools

    @functools.wraps(orig)
    def train_step(forward_step_func, data_iterator, model, *args: Any, **kwargs: Any):
        run = _SESSION
        get_batch = getattr(forward_step_func, "elastic_get_batch", None)
        if run is None or get_batch is None or not run.pipelined:
            return orig(forward_step_func, data_iterator, model, *args, **kwargs)
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training import get_args

        margs = get_args()
        iteration = int(getattr(margs, "curr_iteration", 0) or 0) + 1
        seq_length = run.step.sampler.seq_length(iteration) or margs.seq_length
        carried = _carrying_teacher(run, model, args, kwargs)
        if carried is not None:
            args, kwargs, carrying = carried
            full_length, margs.seq_length = margs.seq_length, seq_length  # the p2p tensor shapes
            try:
                with carrying:
                    return orig(forward_step_func, data_iterator, model, *args, **kwargs)
            finally:
                margs.seq_length = full_length
                run.step._teacher_logits = []
        count = get_num_microbatches()
        items = None
        if data_iterator is not None:
            items = [next(data_iterator) for _ in range(count)]
        _teacher_pass(run, get_batch, items, count, seq_length, margs.micro_batch_size)
        full_length, margs.seq_length = margs.seq_length, seq_length  # the p2p tensor shapes
        try:
            # Megatron-LM's rerun state machine replays what it was given: its own wrapper
            from megatron.core.rerun_state_machine import RerunDataIterator

            from elastic_plugin.elastic.step import Replay

            replay = None if items is None else RerunDataIterator(Replay(items))
            return orig(forward_step_func, replay, model, *args, **kwargs)
        finally:
            margs.seq_length = full_length
            run.step._teacher_logits = []

    train_step._elastic = True  # type: ignore[attr-defined]
    return train_step


# ------------------------------------------------------------------------------ checkpoints
def checkpoint_meta_for_save(iteration: int, chunks: list) -> dict[str, Any]:
    """What Megatron-LM's ``--save`` directories carry for our tools (``elastic.megatron_lm``):
    the elastic checkpoint metadata ``elastic-train`` writes, from the router's choices now."""
    from megatron.training import get_args

    from elastic_plugin.elastic.model import router_of
    from elastic_plugin.elastic.train import checkpoint_meta, choice_table
    from elastic_plugin.parallel import Layout

    args, run = get_args(), session()
    layout = Layout(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.expert_model_parallel_size,
        bool(args.sequence_parallel),
        bool(args.use_distributed_optimizer),
        int(getattr(args, "context_parallel_size", 1) or 1),
    )
    training = dataclasses.replace(run.cfg.training, bf16=bool(getattr(args, "bf16", False)))
    meta = checkpoint_meta(
        dataclasses.replace(run.cfg, training=training),
        run.ecfg,
        layout,
        run.resolved,
        choice_table(router_of(unwrap_chunk(chunks[0])), run.resolved),
        iteration,
        int(getattr(args, "consumed_train_samples", 0) or 0),
        None,
    )
    source = {k: run.source_meta.get(k) for k in ("data", "tokenizer") if k in run.source_meta}
    return {**meta, **source, "megatron_lm": {"ckpt_format": args.ckpt_format}}


# ------------------------------------------------------------------------------ launch
def wrap_extra_args(
    provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """Megatron ``extra_args_provider``: the user's (if any), then the ``--elastic-*`` flags."""

    def extra_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if provider is not None:
            parser = provider(parser) or parser
        return add_pretrain_elastic_args(parser)

    return extra_args


def with_router_param_group(get_optimizer_config, lr_mult_of):
    """Wrap Megatron-LM's ``get_megatron_optimizer_config(args)``: the router trains at
    ``lr_mult`` x the model's learning rate, in its own parameter group (Megatron-LM has no hook
    for extra parameter groups)."""
    from elastic_plugin.elastic.model import router_param_groups

    def get_config(args):
        config, overrides = get_optimizer_config(args)
        groups = router_param_groups(args.lr, args.min_lr or 0.0, lr_mult_of(args))
        return config, {**(overrides or {}), **groups}

    return get_config


@exit_on_config_error  # Megatron-LM asks while it parses, before anything is initialised
def _router_lr_mult(args) -> float:
    return elastic_setup(args)[1].router.lr_multiplier(args.lr)


def install() -> None:
    """Patch what Megatron-LM's training loop calls by name (idempotent): CPU adaptations (none
    with CUDA), checkpoint hooks, the ``elastic |`` log line, the teacher pass of a pipelined
    ``train_step``, the router's parameter group."""
    import megatron.training.training as megatron_training

    from elastic_plugin.compat.megatron_training import enable_cpu_megatron_training
    from elastic_plugin.elastic.megatron_lm import install_checkpoint_hooks
    from elastic_plugin.elastic.megatron_lm_log import install_log_hook

    enable_cpu_megatron_training()  # CPU + gloo (--distributed-backend gloo); no-op with CUDA
    install_checkpoint_hooks(checkpoint_meta_for_save)  # --save/--load in our layout
    install_log_hook(lambda: _SESSION.log if _SESSION is not None else None)
    if not getattr(megatron_training.train_step, "_elastic", False):
        megatron_training.train_step = _wrap_train_step(megatron_training.train_step)
    optimizer_config = getattr(megatron_training, "get_megatron_optimizer_config", None)
    if optimizer_config is not None and not getattr(optimizer_config, "_elastic", False):
        wrapped = with_router_param_group(optimizer_config, _router_lr_mult)
        wrapped._elastic = True
        megatron_training.get_megatron_optimizer_config = wrapped
