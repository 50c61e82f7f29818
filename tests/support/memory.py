"""Peak memory of a step, and the elastic training iteration whose memory and time the runtime
settings (BF16, activation recomputation) change: shared by the recompute memory test
(``tests/test_recompute_memory.py``) and the benchmarks (``bench/bench_attention.py``,
``bench/bench_training_runtime.py``).

``peak_bytes``: on a GPU ``torch.cuda.max_memory_allocated``; on a CPU the profiler's
allocation events (``profile_memory=True``: every allocation and free of the CPU allocator, in
time order, independent of malloc's caching), replayed to their running maximum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ElasticIteration",
    "clear_megatron_buffer",
    "elastic_iteration",
    "peak_bytes",
    "recompute_memory",
    "saved_activations",
    "synthetic_batches",
]


def clear_megatron_buffer() -> None:
    """Empty Megatron's persistent global memory buffer (the unfused attention's scores), so
    that a measured step allocates it as the first step of training does."""
    from megatron.core import parallel_state

    parallel_state.get_global_memory_buffer().buffer.clear()


def peak_bytes(fn: Callable[[], object], device: torch.device) -> tuple[int, object]:
    """Peak bytes allocated on ``device`` while ``fn`` runs, above what was allocated before;
    and ``fn``'s result. Megatron's fused element-wise functions run compiled here, as on a GPU
    (what the planner models): on CPU the plugin runs them uncompiled (compat/cpu.py), which
    keeps each operation's intermediate (the PP2 in-flight test measured a higher peak so)."""
    from elastic_plugin.compat import deferred_compile

    eager = deferred_compile.run_eagerly(False)
    try:
        return _peak_bytes(fn, device)
    finally:
        deferred_compile.run_eagerly(eager)


def _peak_bytes(fn: Callable[[], object], device: torch.device) -> tuple[int, object]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, result
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [
        e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    ]  # one per allocation (+bytes) and free (-bytes)
    running = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    return peak, result


# ------------------------------------------------------------------ an elastic iteration
def synthetic_batches(
    vocab: int, micro_batch: int, seq_len: int, count: int, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """``count`` fixed micro-batches of random tokens (shifted labels, every token counted)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        seq = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=gen)
        out.append(
            {
                "tokens": seq[:, :-1].contiguous(),
                "labels": seq[:, 1:].contiguous(),
                "loss_mask": torch.ones(micro_batch, seq_len),
                "position_ids": torch.arange(seq_len).expand(micro_batch, seq_len),
            }
        )
    return out


@dataclass
class ElasticIteration:
    """A sliced elastic student (Megatron DDP), its frozen teacher, optimizer and step driver,
    drawing one fixed budget for every micro-batch, and the batches of one iteration."""

    chunks: list[Any]  # Megatron DDP chunks (untyped)
    optimizer: Any
    step: Any  # elastic.step.ElasticStep
    batches: list[dict[str, torch.Tensor]]
    seq_len: int
    micro_batch: int

    def run(self, step_optimizer: bool = True, teacher: bool = True) -> dict[str, Any]:
        """One iteration: teacher pass (unless ``teacher=False``: the logits of the last
        ``teacher_pass`` are reused), the student's forward/backward, the optimizer step."""
        step = self.step
        if not teacher:  # the teacher pass first (not inside the schedule), replayed
            logits = step._teacher_logits
            step.teacher_pass = lambda *args, **kwargs: setattr(step, "_teacher_logits", logits)
            step.teacher_in_schedule = False
        try:
            return step.train_step(
                self.chunks,
                self.optimizer,
                iter(self.batches),
                self.seq_len,
                self.micro_batch,
                step_optimizer=step_optimizer,
            )
        finally:
            step.__dict__.pop("teacher_pass", None)
            step.teacher_in_schedule = True

    def teacher_pass(self) -> None:
        """The teacher's logits of this iteration's micro-batches (for ``run(teacher=False)``)."""
        self.step.teacher_pass(self.chunks, self.batches, self.seq_len, self.micro_batch)

    def grads(self) -> dict[str, torch.Tensor]:
        """Copies of every parameter's gradient (Megatron DDP's ``main_grad``), router included."""
        model = getattr(self.chunks[0], "module", self.chunks[0])
        return {n: p.main_grad.detach().float().clone() for n, p in model.named_parameters()}

    def freeze_weights(self) -> None:
        """Learning rate 0 in every parameter group: the optimizer step still does all its
        arithmetic, but weights (and the router's choice) stay put, so repeated iterations
        compute the same nested model (MoE expert-bias updates, which are no optimizer step,
        still move a few tokens between experts)."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for group in opt.param_groups:
                group["lr"] = 0.0


def elastic_iteration(
    config_path: str,
    workdir: str | Path,
    runtime: dict[str, Any] | None = None,
    pattern: str | None = None,
    seq_len: int = 128,
    micro_batch: int = 4,
    num_microbatches: int = 1,
    budget: float = 0.77,
    seed: int = 1234,
    cp: int = 1,
) -> ElasticIteration:
    """``elastic_cases._setup`` (sliced; one rank, or ``cp`` context-parallel ones) with ``runtime`` (``Runtime`` fields) from
    ``workdir/init`` (written here when absent), every micro-batch drawing ``budget`` (one of
    ``elastic_cases.ELASTIC``'s budgets). The caller has joined a process group."""
    from elastic_plugin.elastic.config import CurriculumStage
    from elastic_plugin.elastic.sampling import BudgetSampler
    from elastic_plugin.parallel import Layout
    from tests.support.elastic_cases import _experiment, _setup, write_init_checkpoint

    work = Path(workdir)
    if not (work / "init" / "elastic_meta.json").is_file():
        write_init_checkpoint(_experiment(config_path, pattern), work / "init", seed)
    cfg, chunks, optimizer, step = _setup(
        config_path, work, Layout(cp=cp), pattern, "sliced", False, seed, runtime=runtime
    )
    budgets = step.sampler.budgets
    if budget not in budgets:
        raise ValueError(f"budget={budget}; allowed: {', '.join(map(str, budgets))}")
    probs = tuple(1.0 if b == budget else 0.0 for b in budgets)
    step.sampler = BudgetSampler(
        budgets, [CurriculumStage(iters=1, budget_probs=probs)], seed=5, total_iters=1
    )
    step.num_microbatches = num_microbatches
    step.trace = None
    batches = synthetic_batches(cfg.model.vocab_size, micro_batch, seq_len, num_microbatches)
    return ElasticIteration(chunks, optimizer, step, batches, seq_len, micro_batch)


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise ValueError(f"different parameters: {sorted(set(a) ^ set(b))}")
    return max((a[k] - b[k]).abs().max().item() for k in a)


FULL_UNIFORM_1: dict[str, Any] = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
}


@contextmanager
def saved_activations(model: torch.nn.Module) -> Iterator[dict[str, list[int]]]:
    """Bytes autograd saves for the backward pass inside each decoder layer of ``model`` (one
    count per distinct storage) and the bytes of each layer's input, while the block runs;
    yields ``{"saved": [...], "input": [...]}`` per layer, in layer order, filled on exit."""
    layers = list(model.get_submodule("decoder").layers)  # type: ignore[arg-type]  # ModuleList
    out: dict[str, list[int]] = {"saved": [0] * len(layers), "input": [0] * len(layers)}
    current: list[int | None] = [None]
    seen: set[int] = set()

    def enter(index: int):
        def hook(module, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            out["input"][index] = x.numel() * x.element_size()
            current[0] = index

        return hook

    def leave(module, args, output):
        current[0] = None

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if current[0] is not None and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out["saved"][current[0]] += storage.nbytes()
        return tensor

    handles = [
        h
        for i, layer in enumerate(layers)
        for h in (
            layer.register_forward_pre_hook(enter(i), with_kwargs=True),
            layer.register_forward_hook(leave),
        )
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield out
    finally:
        for h in handles:
            h.remove()


def recompute_memory(
    config_path: str,
    workdir: str,
    pattern: str,
    seq_len: int,
    micro_batch: int,
    budget: float = 0.77,
) -> dict[str, Any]:
    """Peak CPU bytes of one elastic student forward+backward (one micro-batch at ``budget``,
    sliced) without recomputation and with full uniform recomputation of every layer. The
    teacher pass runs before the measured step and is not counted (its logits are held in both
    runs). With it: what the run without recomputation saved for the backward pass inside each
    layer, and each layer's input (all that full recomputation keeps of a layer), so the
    expected peak with recomputation is the peak without it, less every layer's saved
    activations, plus every layer's input and the largest layer's activations (the one layer
    recomputed at a time); and the two runs' losses and largest gradient difference.
    A rank-pool case (one rank)."""
    peaks: dict[str, int] = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    losses: dict[str, Any] = {}
    layers: dict[str, list[int]] = {}
    for name, runtime in (("none", None), ("full", FULL_UNIFORM_1)):
        it = elastic_iteration(
            config_path, workdir, runtime, pattern, seq_len, micro_batch, 1, budget
        )
        it.teacher_pass()
        clear_megatron_buffer()
        step = lambda it=it: it.run(step_optimizer=False, teacher=False)  # noqa: E731
        if name == "none":
            with saved_activations(it.chunks[0].module) as layers:
                peak, result = peak_bytes(step, torch.device("cpu"))
        else:
            peak, result = peak_bytes(step, torch.device("cpu"))
        peaks[name] = peak
        grads[name] = it.grads()
        losses[name] = result["loss"]  # type: ignore[index]  # train_step's dict
        del it, step, result
    saved, inputs = layers["saved"], layers["input"]
    return {
        "peak_none": peaks["none"],
        "peak_full": peaks["full"],
        "layer_saved_bytes": saved,
        "layer_input_bytes": inputs,
        "expected_full": peaks["none"] - sum(saved) + sum(inputs) + max(saved),
        "loss_none": losses["none"],
        "loss_full": losses["full"],
        "grad_max_abs": max(g.abs().max().item() for g in grads["none"].values()),
        "grad_max_abs_diff": _max_abs_diff(grads["none"], grads["full"]),
        "num_grads": len(grads["none"]),
    }
