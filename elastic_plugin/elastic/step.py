"""One elastic training step through Megatron-Core's pipeline schedules.

Per micro-batch, inside the student's schedule: (1) the teacher (the frozen original model, or
the model itself at full budget) runs forward-only on this stage; under PP its hidden states
travel with the student's through the same p2p tensor (``[2, s, b, h]``: student, teacher; the
shape set by Megatron's ``adjust_tensor_shapes_fn``), so the last stage holds the teacher's
logits of one micro-batch, never the whole iteration's; (2) the student: every stage draws the micro-batch's budget and router noise from
``BudgetSampler`` (a pure function of seed, iteration and micro-batch index, so all ranks agree
without talking; data-parallel replicas share the draw, which expert parallelism requires), activates the router's choice, and the last stage computes
``KL(teacher || student)`` + the budget loss (+ CE at budget 1.0). Megatron's schedule runs it
(1F1B under PP) and ``finalize_router_grads`` completes the router's gradients.
``teacher_in_schedule=False`` (or an interleaved / variable-length schedule, which has no shape
hook) runs the teacher first, forward-only over every micro-batch, keeping all their logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from elastic_plugin.checkpoint.meta import budget_label, is_full_budget
from elastic_plugin.elastic.cost import ElasticCost
from elastic_plugin.elastic.layers.fp8 import fp8_gemm
from elastic_plugin.elastic.layers.state import SLICED, ElasticState
from elastic_plugin.elastic.losses import budget_loss, vocab_parallel_kl
from elastic_plugin.elastic.model import finalize_router_grads, router_of
from elastic_plugin.elastic.router import AnnealSchedule, budget_encoding, expected_sizes
from elastic_plugin.elastic.sampling import BudgetSampler
from elastic_plugin.models.context_parallel import loss_scale as cp_loss_scale
from elastic_plugin.models.logits import batch_major_logits
from elastic_plugin.training.step import get_batch, run_schedule, train_step


class Replay:
    """Serve a recorded list of micro-batches (both passes of an iteration see the same data)."""

    def __init__(self, batches: list[dict]) -> None:
        self._it = iter(batches)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return next(self._it)


def truncate_batch(batch: dict, seq_length: int | None) -> dict:
    """Curriculum stages may train on a prefix of each sequence."""
    if not seq_length:
        return batch
    out = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and key == "attention_mask":
            out[key] = value[..., :seq_length, :seq_length]
        elif torch.is_tensor(value) and value.dim() >= 2:
            out[key] = value[:, :seq_length]
        else:
            out[key] = value
    return out


@dataclass
class ElasticStep:
    """Everything a micro-batch needs to know; one instance per training run."""

    state: ElasticState
    sampler: BudgetSampler
    cost: ElasticCost
    temperature: AnnealSchedule
    logit_scale: AnnealSchedule
    num_microbatches: int
    teacher_chunks: list[torch.nn.Module] | None = None  # None: the model at full budget
    iteration: int = 1
    trace: list | None = (
        None  # when a list: (iteration, global micro-batch, budget, choice) per route
    )
    frozen: dict[int, dict[str, torch.Tensor]] | None = None  # budget index -> fixed one-hot choice
    recompute: bool = False  # full activation recomputation: a 4th pass per layer
    flops: float = 0.0  # model FLOPs this DP replica ran since the last ``take_flops``
    _mb: int = 0
    _shape: tuple[int, int] = (0, 0)  # (sequence length, micro-batch size) of this iteration
    _flop_cache: dict = field(default_factory=dict)
    _teacher_logits: Any = field(default_factory=list)  # micro-batch index -> teacher logits
    teacher_in_schedule: bool = True  # the teacher runs micro-batch by micro-batch (see above)
    teacher_logit_peak: int = 0  # most bytes of teacher logits this rank held at once (measured)
    _carry: bool = False  # this step's teacher runs inside the student's schedule
    _stage_input: Any = None  # the p2p tensor Megatron handed this stage: [2, s, b, h] or None

    @property
    def cfg(self):
        return self.state.resolved.config

    # ------------------------------------------------------------------- choices
    def global_microbatch(self, local: int) -> int:
        """The draw key. Every data-parallel replica uses the same budget for its i-th micro-batch:
        expert parallelism exchanges tokens between DP ranks, which only works at one width."""
        return local

    def budget_index(self, local: int) -> int:
        return self.sampler.budget_index(self.iteration, self.global_microbatch(local))

    def route(self, model, local: int) -> tuple[int, dict[str, torch.Tensor]]:
        """The router's (noisy, annealed) choice for micro-batch ``local``; activates it."""
        index = self.budget_index(local)
        budget = self.sampler.budgets[index]
        if is_full_budget(budget):  # the parent itself: Megatron's own forward, no router
            probs = self.full_probs(model)
            self.state.clear()
            self._record(local, index, probs)
            return index, probs
        if self.frozen is not None:  # the router is frozen: a fixed nested model per budget
            device = next(model.parameters()).device
            probs = {name: p.to(device) for name, p in self.frozen[index].items()}
        else:
            router = router_of(model)
            encoding = budget_encoding(budget, router.budgets)
            generator = self.sampler.noise_generator(self.iteration, self.global_microbatch(local))
            hard = self.cfg.router.hard or self.cfg.mode == SLICED
            probs = router(
                encoding,
                self.temperature.value(self.iteration - 1),
                self.logit_scale.value(self.iteration - 1),
                hard,
                generator,
            )
        self.state.set_choice(probs, self.cfg.mode, with_masks=True)
        self._record(local, index, probs)
        return index, probs

    def choice_probs(self, sizes: dict[str, Any]) -> dict[str, torch.Tensor]:
        """A fixed choice (axis -> size, or one size per layer) as the constant one-hot rows
        the router would give (no router gradient)."""
        resolved = self.state.resolved
        probs = {}
        for name, spec in resolved.axes.items():
            value = sizes[name]
            rows = len(spec.layers) if resolved.per_layer(name) else 1
            values = value if isinstance(value, list) else [value] * rows
            picks = torch.tensor([spec.candidates.index(v) for v in values])
            probs[name] = torch.nn.functional.one_hot(picks, len(spec.candidates)).float()
        return probs

    def full_probs(self, model) -> dict[str, torch.Tensor]:
        """The full size of every axis (budget 1.0, the parent) on the model's device."""
        device = next(model.parameters()).device
        full = self.choice_probs(self.state.resolved.full_choice())
        return {name: p.to(device) for name, p in full.items()}

    def _record(self, local: int, index: int, probs: dict[str, torch.Tensor]) -> None:
        if self.trace is not None:
            self.trace.append(
                (
                    self.iteration,
                    self.global_microbatch(local),
                    index,
                    {k: v.detach().argmax(-1).tolist() for k, v in probs.items()},
                )
            )

    def freeze(self, table: dict[str, dict[str, Any]]) -> None:
        """Route every budget to its fixed choice from now on (``table``: budget label -> axis
        -> size, per layer when heterogeneous): no noise, no router gradient."""
        self.frozen = {
            index: self.choice_probs(table[budget_label(budget)])
            for index, budget in enumerate(self.state.resolved.budgets)
        }

    # ------------------------------------------------------------------ teacher
    def _teacher_forward_step(self, data_iterator, model):
        batch = get_batch(data_iterator)
        tokens = batch.get("tokens")
        with batch_major_logits(model):
            output = model(tokens, batch.get("position_ids"), batch.get("attention_mask"))

        def keep(output_tensor):
            self._teacher_logits.append(output_tensor.detach())
            return output_tensor.sum() * 0.0, {}

        return output, keep

    @torch.no_grad()
    def teacher_pass(
        self, student_chunks, batches: list[dict] | None, seq_length: int, micro_batch_size: int
    ) -> None:
        """The teacher forward-only over every micro-batch first (``teacher_in_schedule=False``):
        the last stage keeps all their logits until the student pass has used them."""
        self._teacher_logits = []
        chunks = self.teacher_chunks
        if chunks is None:
            chunks = student_chunks
            self.state.clear()
        run_schedule(
            chunks,
            Replay(batches) if batches is not None else None,
            self.num_microbatches,
            seq_length,
            micro_batch_size,
            forward_only=True,
            forward_step_func=self._teacher_forward_step,
        )
        self._note_teacher_bytes()

    def _note_teacher_bytes(self) -> None:
        held = self._teacher_logits
        tensors = held.values() if isinstance(held, dict) else held
        total = sum(t.numel() * t.element_size() for t in tensors)
        self.teacher_logit_peak = max(self.teacher_logit_peak, total)

    # ------------------------------------------------------- teacher inside the schedule
    @torch.no_grad()
    def _teacher_in_step(self, student_model, batch: dict, teacher_input) -> torch.Tensor:
        """This stage's teacher forward on one micro-batch: the frozen teacher's chunk, or the
        student at full budget; under PP fed the teacher half of the received p2p tensor."""
        if self.teacher_chunks is None:
            teacher = student_model
            self.state.clear()
        else:
            teacher = self.teacher_chunks[0]
        if _pipeline_size() > 1:
            set_model_input(teacher, teacher_input)
        with batch_major_logits(teacher):
            out = teacher(
                batch.get("tokens"), batch.get("position_ids"), batch.get("attention_mask")
            )
        return out.detach()

    @contextmanager
    def _capturing_stage_input(self, chunks):
        """Megatron hands each stage its received p2p tensor through ``set_input_tensor``; keep
        it whole (student and teacher halves) for the forward step to split."""
        inner = inner_model(chunks[0])

        def capture(input_tensor) -> None:
            tensors = input_tensor if isinstance(input_tensor, list) else [input_tensor]
            self._stage_input = tensors[0]

        inner.set_input_tensor = capture
        try:
            yield
        finally:
            del inner.set_input_tensor  # the class's method again
            self._stage_input = None

    def _can_carry_teacher(self, chunks) -> bool:
        """Megatron's shape hook exists in the non-interleaved 1F1B schedule with fixed shapes."""
        if not self.teacher_in_schedule:
            return False
        if _pipeline_size() == 1:
            return True
        return len(chunks) == 1 and not getattr(chunks[0].config, "variable_seq_lengths", False)

    # ------------------------------------------------------------------ student
    def _loss(self, local: int, budget_index: int, probs, batch: dict, output_tensor):
        cfg = self.cfg
        budget = self.sampler.budgets[budget_index]
        loss_mask = batch["loss_mask"].float()
        kd = vocab_parallel_kl(
            output_tensor,
            self._teacher_logits[local],
            cfg.kd_temperature,
            chunk_tokens=cfg.kd_chunk_tokens,
        )
        num_tokens = loss_mask.sum()
        kd_sum = (kd * loss_mask).sum()
        total = kd_sum
        ce_sum = torch.zeros((), device=kd_sum.device)
        if cfg.ce_weight_full > 0 and budget == max(self.sampler.budgets):
            from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

            ce = vocab_parallel_cross_entropy(
                output_tensor.float().transpose(0, 1).contiguous(),
                batch["labels"].transpose(0, 1).contiguous(),
            )
            ce_sum = (ce.transpose(0, 1) * loss_mask).sum()
            total = total + cfg.ce_weight_full * ce_sum
        sizes = {}
        for name, spec in self.state.resolved.axes.items():
            exp = expected_sizes(probs[name], list(spec.candidates))
            sizes[name] = exp if self.state.resolved.per_layer(name) else exp[0]
        cost = self.cost(sizes)
        b_loss = budget_loss(cost, budget, self.cost.full).to(kd_sum.dtype)
        total = total + cfg.budget_loss_weight * b_loss * num_tokens.detach()
        total = total * cp_loss_scale(num_tokens)  # CP: this rank's share of the sequence mean
        report = torch.stack(
            [
                kd_sum.detach(),
                num_tokens.detach(),
                b_loss.detach(),
                ce_sum.detach(),
                torch.tensor(float(budget_index), device=kd_sum.device),
            ]
        )
        return total, num_tokens.to(torch.int), {"elastic": report}

    # ------------------------------------------------------------------ throughput
    def choice_flops(self, probs: dict[str, torch.Tensor] | None, train: bool = True) -> int:
        """Model FLOPs of one micro-batch of the nested model that ``probs`` activates (None:
        the full model), as it runs: training (3 passes, 4 with full recomputation) or a
        forward only. Masked mode computes the full widths."""
        from elastic_plugin.models.flops import forward_flops, training_flops

        resolved = self.state.resolved
        choice: dict[str, Any] = {}
        if probs is not None and self.cfg.mode == SLICED:
            for name, spec in resolved.axes.items():
                sizes = [spec.candidates[int(i)] for i in probs[name].argmax(-1).tolist()]
                choice[name] = sizes if resolved.per_layer(name) else sizes[0]
        seq, mbs = self._shape
        key = (train, seq, mbs, tuple((k, str(v)) for k, v in sorted(choice.items())))
        if key not in self._flop_cache:
            args = (resolved.model, seq, mbs, choice or None)
            count = (
                training_flops(*args, recompute=self.recompute, full_router=True)
                if train
                else forward_flops(*args, full_router=True)
            )
            self._flop_cache[key] = count.total
        return self._flop_cache[key]

    def take_flops(self) -> float:
        """The FLOPs counted since the last call (and reset)."""
        flops, self.flops = self.flops, 0.0
        return flops

    def _student_forward_step(self, data_iterator, model):
        local = self._mb
        self._mb += 1
        batch = get_batch(data_iterator)
        teacher_out = None
        if self._carry:
            pipelined = _pipeline_size() > 1
            received = self._stage_input if pipelined else None
            student_in = None if received is None else received[0]
            teacher_out = self._teacher_in_step(
                model, batch, None if received is None else received[1]
            )
            if pipelined:
                set_model_input(model, student_in)
        index, probs = self.route(model, local)
        if torch.is_grad_enabled():  # a training micro-batch (not a forward-only evaluation)
            self.flops += self.choice_flops(None if not self.state.is_active else probs)
        # fp8: the backward keeps the recipe it was traced with
        with fp8_gemm(self.cfg.fp8_gemm), batch_major_logits(model):
            output = model(
                batch.get("tokens"), batch.get("position_ids"), batch.get("attention_mask")
            )
        if teacher_out is None:
            return output, partial(self._loss, local, index, probs, batch)
        if not _is_last_stage():  # both hidden states to the next stage, in one p2p tensor
            return torch.stack([output, teacher_out]), partial(
                self._loss, local, index, probs, batch
            )
        self._teacher_logits = {local: teacher_out}
        self._note_teacher_bytes()
        return output, partial(self._loss_then_release, local, index, probs, batch)

    def _loss_then_release(self, local: int, index: int, probs, batch: dict, output_tensor):
        """``_loss``, then drop this micro-batch's teacher logits (the loss keeps what its
        backward needs)."""
        try:
            return self._loss(local, index, probs, batch, output_tensor)
        finally:
            self._teacher_logits.pop(local, None)

    def train_step(
        self,
        chunks,
        optimizer,
        data_iterator: Iterator[dict] | None,
        seq_length: int,
        micro_batch_size: int,
        step_optimizer: bool = True,
    ) -> dict[str, Any]:
        """Teacher pass, then Megatron's forward-backward + optimizer step on the student."""
        stage_seq = self.sampler.seq_length(self.iteration) or seq_length
        self._shape = (stage_seq, micro_batch_size)
        # the teacher's forward over every micro-batch is part of the step's work
        self.flops += self.num_microbatches * self.choice_flops(None, train=False)
        batches = None
        if data_iterator is not None:
            batches = [
                truncate_batch(next(data_iterator), stage_seq) for _ in range(self.num_microbatches)
            ]
        self.teacher_logit_peak = 0
        self._carry = self._can_carry_teacher(chunks)
        if not self._carry:
            self.teacher_pass(chunks, batches, stage_seq, micro_batch_size)
        pipelined = self._carry and _pipeline_size() > 1
        self._mb = 0
        try:
            with self._capturing_stage_input(chunks) if pipelined else _nothing():
                result = train_step(
                    chunks,
                    optimizer,
                    Replay(batches) if batches is not None else None,
                    self.num_microbatches,
                    stage_seq,
                    micro_batch_size,
                    step_optimizer=step_optimizer,
                    forward_step_func=self._student_forward_step,
                    finalize_grads_func=finalize_router_grads,
                    reduce_reports=reduce_elastic_reports,
                    adjust_tensor_shapes_fn=with_teacher_shapes if pipelined else None,
                )
        finally:
            self.state.clear()
            self._teacher_logits = []
            self._carry = False
        return result


def _pipeline_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size()


def _is_last_stage() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage()


def inner_model(module):
    """The Megatron model inside DDP / Float16Module wrappers (it owns ``set_input_tensor``)."""
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module
    return module


def set_model_input(module, tensor) -> None:
    """The model's own ``set_input_tensor`` (not the capture ``train_step`` installs)."""
    inner = inner_model(module)
    type(inner).set_input_tensor(inner, [tensor])


def with_teacher_shapes(recv_shapes: list, send_shapes: list) -> tuple[list, list]:
    """Megatron's ``adjust_tensor_shapes_fn``: every p2p tensor carries the student's and the
    teacher's hidden states stacked, ``[2, s, b, h]``."""
    return [(2, *shape) for shape in recv_shapes], [(2, *shape) for shape in send_shapes]


@contextmanager
def _nothing():
    yield


def reduce_elastic_reports(reports: list[dict]) -> dict[int, dict[str, float]] | None:
    """Per budget index: token-mean KD loss, mean budget loss, micro-batch count (this rank)."""
    if not reports:
        return None
    out: dict[int, dict[str, float]] = {}
    for rep in reports:
        kd_sum, tokens, b_loss, ce_sum, index = (float(x) for x in rep["elastic"])
        agg = out.setdefault(
            int(index),
            {"kd_sum": 0.0, "tokens": 0.0, "budget_loss_sum": 0.0, "ce_sum": 0.0, "count": 0.0},
        )
        agg["kd_sum"] += kd_sum
        agg["tokens"] += tokens
        agg["budget_loss_sum"] += b_loss
        agg["ce_sum"] += ce_sum
        agg["count"] += 1
    return out
