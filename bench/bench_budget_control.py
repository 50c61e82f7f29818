"""Where elastic budget control pays off: a nested model's decode cost, and think-small /
answer-full vs the full model thinking, side by side, as the model widens and the batch grows;
the reference path (Megatron's layer modules, one forward per distinct length) and the fast
path (``inference.fast_decode``: plain ops, routed experts only; one padded re-prefill) in the
same run.

For the tiny hybrid model at width multipliers ``WIDTHS`` (hidden, FFN, expert FFN, heads and
Mamba heads all scaled) and batch sizes ``BATCHES``, with random weights (timings do not depend
on the values): the full model and its nested model at the demo's 0.4 choice (embedding 3/4,
FFN 1/2, shared FFN 1/2, attention heads 1/2, Mamba head dim 1/2, experts 1/2). Each row, with
interleaved repetitions (medians):

* ``active_ratio``: nested / full active parameters (the ideal step ratio of a memory- or
  compute-bound step);
* ``step_ratio_ref`` / ``step_ratio_fast``: one decode step of the nested model / one of the
  full model, by the reference and by the fast path (1.0 = no saving);
* ``fast_step_speedup``: the full model's reference step / its fast step;
* ``control_speedup_ref`` / ``control_speedup_fast``: the full model generating ``THINK +
  ANSWER`` tokens / budget control (the nested model generates ``THINK`` tokens, the full model
  re-prefills prompt + thinking and generates ``ANSWER``), each path against itself. ``THINK`` /
  ``ANSWER`` are the products demo's mean token counts;
* ``reprefill_speedup``: the switch's re-prefill of the batch's prompt + thinking (lengths
  spread like the demo's) level by level with the layer modules / one padded fast forward;
* ``switch_in_steps``: that fast re-prefill in full-model fast decode steps (what the switch
  costs against the ``THINK`` steps it saves a fraction of);
* ``arithmetic_ratio`` (computed, not timed): the control's tokens x active parameters over
  the full model's (the nested model reads prompt + thinking, the full model re-reads both and
  answers). It is above 1: the switch costs more arithmetic than the cheaper thinking saves,
  so the control can only win where a decode step is bound by *reading the weights* and a
  re-prefilled token costs a fraction of a decode step;
* ``full_weights_mb``: the full model's parameter bytes.

``LARGE_WIDTHS`` add batch-1 rows (fast path only) at widths whose weights outgrow the CPU
caches: there the decode step streams the weights, its cost follows the active parameters,
and the re-prefill costs a few steps, which is the regime of a real model (and of a GPU).

Times are CPU seconds of this process (``time.process_time``, one intra-op thread by default),
so a neighbour's load does not stretch them as it stretches wall time.

On a 2-core CPU a tiny model's batch-1 step is dispatch-bound, so its ``step_ratio`` stays
well above ``active_ratio``; the fast path removes most of the per-layer overhead, so the
ratio falls toward ``active_ratio`` as the width grows. Run: ``python
bench/bench_budget_control.py [--quick] [--reps N]`` or ``python bench/run_all.py --only
budget_control``.
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WIDTHS = (1, 2, 4)
BATCHES = (1, 32)
# batch 1 only, fast path only: widths whose weights no longer fit the CPU caches, so a decode
# step is bound by reading them (the regime of a real model on any hardware)
LARGE_WIDTHS = (8, 16)
THINK, ANSWER = 20, 4  # products demo: 20.3 thinking / 3.8 answer tokens per problem
PROMPT = 8
STEPS = 10  # decode steps per timed sample (one step is too short to time on a busy machine)
SMALL = {
    "embedding": 0.75,
    "ffn": 0.5,
    "shared_ffn": 0.5,
    "attention_heads": 0.5,
    "mamba_heads": 1.0,
    "mamba_head_dim": 0.5,
    "experts": 0.5,
}


def _models(width: int):
    from elastic_plugin.models.axes import model_for_choice
    from elastic_plugin.models.counting import count_parameters
    from elastic_plugin.nested.model import nested_model
    from tests.support.inference_cases import tiny_config, tiny_inference_model

    base = tiny_config()
    overrides = dict(
        hidden_size=base.hidden_size * width,
        ffn_hidden_size=base.ffn_hidden_size * width,
        moe_ffn_hidden_size=base.moe_ffn_hidden_size * width,
        moe_shared_expert_intermediate_size=(base.moe_shared_expert_intermediate_size * width),
        mamba_num_heads=base.mamba_num_heads * width,
        num_attention_heads=base.num_attention_heads * width,
        num_query_groups=base.num_query_groups * width,
    )
    full, cfg = tiny_inference_model(seed=1, **overrides)
    full_sizes = {
        "embedding": cfg.hidden_size,
        "ffn": cfg.ffn_hidden_size,
        "shared_ffn": cfg.moe_shared_expert_intermediate_size,
        "attention_heads": cfg.num_attention_heads,
        "mamba_heads": cfg.mamba_num_heads,
        "mamba_head_dim": cfg.mamba_head_dim,
        "experts": cfg.num_moe_experts,
    }
    choice = {axis: int(full_sizes[axis] * f) for axis, f in SMALL.items()}
    small, _ = nested_model(full, cfg, choice)
    active = count_parameters(model_for_choice(cfg, choice)).active / count_parameters(cfg).active
    return full, small, cfg, active


def _weight_mb(model: torch.nn.Module) -> float:
    """The model's parameter bytes in MB (what a weight-read-bound step must stream)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def _timed(fn) -> float:
    """CPU seconds of this process spent in ``fn``: on a shared machine, other jobs' load
    stretches wall time but not this (one intra-op thread: the work is on this thread)."""
    began = time.process_time()
    fn()
    return time.process_time() - began


def run(quick: bool = False, reps: int | None = None, threads: int = 1) -> list[dict]:
    from elastic_plugin.inference import InferenceCache, extend, extend_ragged, generate
    from elastic_plugin.inference.budget_control import arithmetic_ratio
    from elastic_plugin.inference.fast_decode import decode_plan
    from tests.support.inference_cases import random_prompts

    reps = reps or (2 if quick else 5)
    cases = [(w, b, ("ref", "fast")) for w in (WIDTHS[:2] if quick else WIDTHS) for b in BATCHES]
    if not quick:
        cases += [(w, 1, ("fast",)) for w in LARGE_WIDTHS]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    try:
        built: tuple | None = None
        for width, batch, paths in cases:
            if built is None or built[0] != width:
                built = (width, *_models(width))
            _, full, small, cfg, active = built
            prompts = random_prompts([PROMPT] * batch, cfg.vocab_size, seed=batch)
            thought = random_prompts(
                [PROMPT + THINK - 3 + (i % 7) for i in range(batch)],
                cfg.vocab_size,
                seed=batch + 1,
            )
            first = torch.tensor(prompts)[:, 0]

            def step(model, fast: bool):
                cache = InferenceCache.allocate(model, batch, PROMPT + 2)
                extend(model, cache, torch.tensor(prompts))
                held = cache.lengths.clone()
                plan = decode_plan(model)

                def one() -> None:  # STEPS steps at the same position: fixed-size steps
                    for _ in range(STEPS):
                        cache.lengths.copy_(held)
                        if fast:
                            with torch.no_grad():
                                plan(cache, first, None)
                        else:
                            extend(model, cache, first[:, None], last_only=True)

                return one

            def reprefill(fast: bool):
                cache = InferenceCache.allocate(full, batch, PROMPT + THINK + 8)
                extend_ragged(full, cache, thought, list(range(batch)), padded=fast, fast=fast)

            def control(fast: bool) -> None:
                think = generate(small, prompts, THINK, fast=fast)
                sequences = [p + t for p, t in zip(prompts, think.tokens)]
                generate(full, sequences, ANSWER, fast=fast)

            fns = {}
            for path, fast in (("ref", False), ("fast", True)):
                if path not in paths:
                    continue
                fns[f"full_step_{path}"] = step(full, fast)
                fns[f"small_step_{path}"] = step(small, fast)
                fns[f"full_thinks_{path}"] = partial(
                    generate, full, prompts, THINK + ANSWER, fast=fast
                )
                fns[f"control_{path}"] = partial(control, fast)
                fns[f"reprefill_{path}"] = partial(reprefill, fast)
            times: dict[str, list[float]] = {k: [] for k in fns}
            order = list(fns.items())
            for rep in range(reps + 1):  # the first round warms up
                shift = rep % len(order)
                for name, fn in order[shift:] + order[:shift]:
                    elapsed = _timed(fn)
                    if rep:
                        times[name].append(elapsed)
            med = {k: statistics.median(v) for k, v in times.items()}

            def ratio(a: str, b: str, scale: float = 1.0) -> float | None:
                return med[a] / med[b] * scale if a in med and b in med else None

            rows.append(
                {
                    "name": f"budget_control/w{width}/b{batch}",
                    "full_weights_mb": _weight_mb(full),
                    "active_ratio": active,
                    # computed, not timed (above 1, only a weight-read-bound step lets it win)
                    "arithmetic_ratio": arithmetic_ratio(PROMPT, THINK, ANSWER, active),
                    "full_step_ms_ref": (
                        1e3 * med["full_step_ref"] / STEPS if "full_step_ref" in med else None
                    ),
                    "full_step_ms_fast": 1e3 * med["full_step_fast"] / STEPS,
                    "fast_step_speedup": ratio("full_step_ref", "full_step_fast"),
                    "step_ratio_ref": ratio("small_step_ref", "full_step_ref"),
                    "step_ratio_fast": ratio("small_step_fast", "full_step_fast"),
                    "control_speedup_ref": ratio("full_thinks_ref", "control_ref"),
                    "control_speedup_fast": ratio("full_thinks_fast", "control_fast"),
                    "reprefill_speedup": ratio("reprefill_ref", "reprefill_fast"),
                    "switch_in_steps": ratio("reprefill_fast", "full_step_fast", STEPS),
                }
            )
        return rows
    finally:
        torch.set_num_threads(saved)


def main() -> None:
    from run_all import bench_main

    bench_main(run, __doc__.splitlines()[0], threads=True)


if __name__ == "__main__":
    main()
