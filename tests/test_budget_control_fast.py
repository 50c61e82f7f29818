"""The fast decode step (``inference.fast_decode.DecodePlan``) against the reference step
(``steps.extend`` with one token, which tests/test_inference_generate.py checks against
Megatron's own full forward), on real Megatron-Core modules: the tiny_model hybrid model (Mamba-2,
GQA attention, MoE with a shared expert, MLP), its nested model, and variants (RoPE, SwiGLU with
softmax routing); logits, caches and generated tokens."""

from __future__ import annotations

import pytest
import torch

from tests.support.inference_cases import random_prompts, tiny_inference_model

# the tiny_model model's nested choice, and the one-intra-op-thread fixture, of the generation tests
from tests.test_inference_generate import SMALL, one_thread  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")

TOL = 2e-5


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_inference_model(seed=1)


def _steps_agree(model, batch: int, steps: int = 5, seed: int = 0, tol: float = TOL) -> None:
    """Ragged prompts prefilled into two caches; then decode steps through the reference path
    and the plan, alternating all rows and a subset: logits and every cache tensor agree."""
    from elastic_plugin.inference import InferenceCache, extend, extend_ragged
    from elastic_plugin.inference.fast_decode import decode_plan

    vocab = int(model.vocab_size)
    prompts = random_prompts([3 + (i * 5) % 11 for i in range(batch)], vocab, seed=seed)
    ref_cache = InferenceCache.allocate(model, batch, 32)
    fast_cache = InferenceCache.allocate(model, batch, 32)
    for cache in (ref_cache, fast_cache):
        extend_ragged(model, cache, prompts, list(range(batch)))
    plan = decode_plan(model)
    assert plan.reference_layers == []  # every layer of these models runs the fast path
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        rows = None if step % 2 == 0 or batch == 1 else torch.arange(batch - 1, -1, -2)
        tokens = torch.randint(0, vocab, (batch if rows is None else rows.numel(),), generator=gen)
        expected = extend(model, ref_cache, tokens[:, None], rows=rows, last_only=True)[:, -1]
        with torch.no_grad():
            got = plan(fast_cache, tokens, rows)
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    assert torch.equal(fast_cache.lengths, ref_cache.lengths)
    for table in ("keys", "values", "conv", "ssm"):
        for index, tensor in getattr(ref_cache, table).items():
            torch.testing.assert_close(
                getattr(fast_cache, table)[index], tensor, atol=tol, rtol=tol
            )


@pytest.mark.parametrize("batch", [1, 3, 9])  # 1: the token's experts; 3, 9: grouped experts
def test_fast_step_equals_reference_step(tiny_model, batch):
    model, _ = tiny_model
    _steps_agree(model, batch, seed=batch)


def test_fast_step_on_the_nested_model_and_generation(tiny_model):
    """The nested model (fewer experts, narrower everything) too; greedy generation gives the
    same tokens by either path, at batch 1 and for a ragged batch."""
    from elastic_plugin.inference import generate
    from elastic_plugin.nested.model import nested_model

    model, cfg = tiny_model
    small, _ = nested_model(model, cfg, SMALL)
    _steps_agree(small, 4, seed=7)
    for prompts in (
        random_prompts([9], cfg.vocab_size, seed=2),
        random_prompts([4, 13, 1, 8, 6], cfg.vocab_size, seed=3),
    ):
        for m in (model, small):
            fast = generate(m, prompts, 12)
            assert fast.tokens == generate(m, prompts, 12, fast=False).tokens


@pytest.mark.parametrize(
    "overrides",
    [
        dict(position_embedding_type="rope"),
        dict(
            activation="swiglu",
            moe_router_score_function="softmax",
            moe_router_enable_expert_bias=False,
        ),
    ],
    ids=["rope", "swiglu-softmax"],
)
def test_fast_step_variants(overrides):
    model, _ = tiny_inference_model(seed=5, **overrides)
    _steps_agree(model, 1, seed=1)
    _steps_agree(model, 6, seed=2)


def test_plan_is_rebuilt_when_weights_change(tiny_model):
    """The plan keeps stacked copies of the expert weights: writing a parameter in place makes
    the next ``decode_plan`` a new plan that sees the new weights."""
    from elastic_plugin.inference.fast_decode import decode_plan

    model, _ = tiny_model
    plan = decode_plan(model)
    assert decode_plan(model) is plan
    expert = model.decoder.layers[2].mlp.experts.local_experts[0].linear_fc1.weight
    with torch.no_grad():
        expert.mul_(1.0)
    rebuilt = decode_plan(model)
    assert rebuilt is not plan
    _steps_agree(model, 3, steps=2, seed=11)


def test_uncovered_layer_runs_the_reference_step(tiny_model, monkeypatch):
    """A layer the plan cannot reproduce (here: every MoE layer, as if its config used a
    capacity factor) runs through the reference step, and the results still agree."""
    from elastic_plugin.inference import fast_decode

    model, _ = tiny_model
    monkeypatch.setattr(fast_decode, "_moe", lambda moe: None)
    plan = fast_decode.DecodePlan(model)
    assert plan.reference_layers == [2, 6]
    from elastic_plugin.inference import InferenceCache, extend

    prompts = torch.tensor(random_prompts([5, 5], int(model.vocab_size), seed=4))
    ref, fast = (InferenceCache.allocate(model, 2, 16) for _ in range(2))
    extend(model, ref, prompts)
    extend(model, fast, prompts)
    tokens = prompts[:, 0]
    expected = extend(model, ref, tokens[:, None], last_only=True)[:, -1]
    with torch.no_grad():
        got = plan(fast, tokens, None)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=TOL)


def test_padded_ragged_prefill_equals_level_by_level(tiny_model):
    """The switch's re-prefill in one padded forward == rows advancing level by level (the
    previous path, itself checked against the full forward): logits, lengths, the states the
    next tokens see, and the decode steps after it."""
    from elastic_plugin.inference import InferenceCache, extend, extend_ragged
    from elastic_plugin.nested.model import nested_model

    model, cfg = tiny_model
    small, _ = nested_model(model, cfg, SMALL)
    for m in (model, small):
        sequences = random_prompts([7, 1, 19, 3, 12, 19], cfg.vocab_size, seed=9)
        rows = [4, 0, 2, 5, 1, 3]
        caches = [InferenceCache.allocate(m, 6, 40) for _ in range(2)]
        for cache in caches:  # rows already hold 2 tokens each
            extend(m, cache, torch.tensor(random_prompts([2] * 6, cfg.vocab_size, seed=1)))
        padded = extend_ragged(m, caches[0], sequences, rows)
        level = extend_ragged(m, caches[1], sequences, rows, padded=False)
        torch.testing.assert_close(padded, level, atol=TOL, rtol=TOL)
        assert torch.equal(caches[0].lengths, caches[1].lengths)
        for table in ("conv", "ssm"):
            for index, tensor in getattr(caches[1], table).items():
                torch.testing.assert_close(
                    getattr(caches[0], table)[index], tensor, atol=TOL, rtol=TOL
                )
        for index, tensor in caches[1].keys.items():  # K/V up to each row's length
            for row, n in enumerate(caches[1].lengths.tolist()):
                torch.testing.assert_close(caches[0].keys[index][row, :n], tensor[row, :n])
        tokens = torch.tensor([[5]] * 6)
        after = [extend(m, c, tokens, last_only=True) for c in caches]
        torch.testing.assert_close(after[0], after[1], atol=TOL, rtol=TOL)


def test_padded_extend_refuses_bad_counts(tiny_model):
    from elastic_plugin.inference import InferenceCache, extend
    from elastic_plugin.models.config import ConfigError

    model, _ = tiny_model
    cache = InferenceCache.allocate(model, 2, 8)
    with pytest.raises(ConfigError, match=r"real_tokens=\[0, 3\]: one count in \[1, 3\]"):
        extend(model, cache, torch.zeros(2, 3, dtype=torch.long), real_tokens=[0, 3])
    assert cache.lengths.tolist() == [0, 0]  # nothing was fed


def test_fast_prefill_equals_reference_prefill(tiny_model):
    """``extend(fast=True)``: the MLP / MoE layers of a chunk (here a padded ragged batch) run as
    the decode plan runs them; logits and states equal the reference layer modules'."""
    from elastic_plugin.inference import InferenceCache, extend_ragged

    model, cfg = tiny_model
    sequences = random_prompts([12, 3, 25, 1, 9], cfg.vocab_size, seed=12)
    caches = [InferenceCache.allocate(model, 5, 32) for _ in range(2)]
    fast = extend_ragged(model, caches[0], sequences, list(range(5)), fast=True)
    ref = extend_ragged(model, caches[1], sequences, list(range(5)))
    torch.testing.assert_close(fast, ref, atol=TOL, rtol=TOL)
    for index, tensor in caches[1].ssm.items():
        torch.testing.assert_close(caches[0].ssm[index], tensor, atol=TOL, rtol=TOL)


def test_budget_control_same_tokens_either_path(tiny_model):
    """``budget_control_generate`` / ``capped_thinking_generate``: the fast path (fast decode
    step, one padded re-prefill) thinks and answers with the same tokens as the reference."""
    from elastic_plugin.inference import budget_control_generate, capped_thinking_generate
    from elastic_plugin.nested.model import nested_model

    model, cfg = tiny_model
    small, _ = nested_model(model, cfg, SMALL)
    prompts = random_prompts([6, 2, 11], cfg.vocab_size, seed=21)
    close = 7
    runs = [
        budget_control_generate(small, model, prompts, close, 9, 5, fast=fast)
        for fast in (True, False)
    ]
    assert runs[0].thinking == runs[1].thinking and runs[0].answers == runs[1].answers
    assert all(t[-1] == close for t in runs[0].thinking)
    capped = [capped_thinking_generate(model, prompts, close, 4, 3, fast=f) for f in (True, False)]
    assert capped[0].tokens == capped[1].tokens


def test_bench_quickest_run(monkeypatch):
    """``bench/bench_budget_control.py`` runs both paths side by side; its columns are ratios
    of positive times. Behaviour, not speed."""
    import math

    import bench.bench_budget_control as bench

    monkeypatch.setattr(bench, "WIDTHS", (1,))
    monkeypatch.setattr(bench, "BATCHES", (2,))
    monkeypatch.setattr(bench, "LARGE_WIDTHS", (1,))  # the batch-1, fast-only rows
    row, large = bench.run(quick=False, reps=1)
    assert row["name"] == "budget_control/w1/b2" and large["name"] == "budget_control/w1/b1"
    assert 0.4 < row["active_ratio"] < 0.6
    assert all(math.isfinite(row[k]) and row[k] > 0 for k in row if k != "name")
    assert row["fast_step_speedup"] == pytest.approx(
        row["full_step_ms_ref"] / row["full_step_ms_fast"]
    )
    # the control's arithmetic over the full model's: prompt + thinking read twice
    t, a, p = bench.THINK, bench.ANSWER, bench.PROMPT
    assert row["arithmetic_ratio"] == pytest.approx(
        ((p + t) * (row["active_ratio"] + 1) + a) / (p + t + a)
    )
    assert row["full_weights_mb"] == large["full_weights_mb"] > 0
    assert large["step_ratio_ref"] is None and large["control_speedup_ref"] is None
    assert large["step_ratio_fast"] > 0 and large["control_speedup_fast"] > 0


def test_hooked_layers_run_their_modules():
    """Forward hooks (the evaluation's activation quantization is one) only run when a module
    is called: a hooked layer and a hooked output layer run through their modules, and the
    hook's effect is in the logits."""
    from elastic_plugin.inference import InferenceCache, extend
    from elastic_plugin.inference.fast_decode import DecodePlan

    model, _ = tiny_inference_model(seed=6)

    def halve(module, args):
        return (args[0] * 0.5,)

    handles = [
        model.decoder.layers[3].mlp.linear_fc1.register_forward_pre_hook(halve),
        model.output_layer.register_forward_pre_hook(halve),
    ]
    try:
        plan = DecodePlan(model)
        assert plan.reference_layers == [3] and plan.output_hooked
        prompts = torch.tensor(random_prompts([4, 4], int(model.vocab_size), seed=5))
        ref, fast = (InferenceCache.allocate(model, 2, 8) for _ in range(2))
        extend(model, ref, prompts)
        extend(model, fast, prompts)
        expected = extend(model, ref, prompts[:, :1], last_only=True)[:, -1]
        with torch.no_grad():
            got = plan(fast, prompts[:, 0], None)
        torch.testing.assert_close(got, expected, atol=TOL, rtol=TOL)
    finally:
        for handle in handles:
            handle.remove()
    unhooked = DecodePlan(model)
    assert unhooked.reference_layers == [] and not unhooked.output_hooked


def test_fast_step_in_bf16():
    """A BF16 model (the evaluation runs BF16 exports): the plan rounds where the reference
    rounds (conv and SSM outputs to the model dtype), so logits agree to BF16 rounding and
    greedy tokens are the same."""
    from elastic_plugin.inference import generate

    model, cfg = tiny_inference_model(seed=1)
    model = model.to(torch.bfloat16)
    _steps_agree(model, 3, seed=4, tol=0.05)
    prompts = random_prompts([5, 9, 3], cfg.vocab_size, seed=1)
    fast = generate(model, prompts, 12).tokens
    reference = generate(model, prompts, 12, fast=False).tokens
    _same_greedy_up_to_bf16_ties(model, prompts, fast, reference, tol=0.05)


def _same_greedy_up_to_bf16_ties(model, prompts, fast, reference, tol: float) -> None:
    """Greedy tokens equal, or the first differing token is a tie within BF16 rounding: the two
    paths' logits agree to ``tol`` (``_steps_agree``), so where the reference's two best logits
    are closer than that, which one wins depends on the CPU's BF16 GEMM (measured: an AVX2 EPYC
    flips one such tie that AVX-512 machines do not). Every token before it must be equal."""
    from elastic_plugin.inference import InferenceCache, extend

    ties = 0
    for prompt, got, want in zip(prompts, fast, reference):
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first is None:
            assert got == want
            continue
        cache = InferenceCache.allocate(model, 1, len(prompt) + first + 1)
        with torch.no_grad():
            logits = extend(model, cache, torch.tensor([prompt + want[:first]]), last_only=True)
        logits = logits[0, -1].float()
        gap = float(logits[want[first]] - logits[got[first]])
        assert 0.0 <= gap <= 2 * tol * max(1.0, float(logits[want[first]].abs())), (first, gap)
        ties += 1
    assert ties < len(prompts)  # at least one row is equal all the way


def test_plans_do_not_keep_models_alive():
    """The plan cache is keyed weakly by model: a model nobody holds is freed with its plan."""
    import gc
    import weakref

    from elastic_plugin.inference import fast_decode, generate

    model, cfg = tiny_inference_model(seed=2)
    generate(model, random_prompts([3], cfg.vocab_size, seed=0), 2)
    assert model in fast_decode._PLANS
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_fast_generation_matches_transformers_nemotron_h(tiny_model, tmp_path):
    """An independent reference: the full and the nested model exported to Hugging Face
    NemotronH and run by stock ``transformers`` (greedy, full recompute, no cache) generate the
    tokens the fast path generates, and budget control's answer continues like it."""
    pytest.importorskip("transformers")
    from elastic_plugin.export.hf import (
        hf_config,
        load_hf_model,
        megatron_to_hf,
        write_hf_checkpoint,
    )
    from elastic_plugin.inference import budget_control_generate, generate
    from elastic_plugin.nested.model import nested_model

    model, cfg = tiny_model
    small, small_cfg = nested_model(model, cfg, SMALL)
    prompts = random_prompts([6, 6], cfg.vocab_size, seed=31)
    hf_models = {}
    for name, m, c in (("full", model, cfg), ("small", small, small_cfg)):
        hf = megatron_to_hf(m.state_dict(), c)
        (tmp_path / name).mkdir()
        write_hf_checkpoint(tmp_path / name, hf, hf_config(hf, c, "fp32"), "fp32")
        hf_models[name] = load_hf_model(tmp_path / name)

    def hf_greedy(hf_model, sequences: list[list[int]], steps: int) -> list[list[int]]:
        tokens = torch.tensor(sequences)
        with torch.no_grad():
            for _ in range(steps):
                step = hf_model(tokens).logits[:, -1].argmax(-1)
                tokens = torch.cat([tokens, step[:, None]], dim=1)
        return tokens[:, len(sequences[0]) :].tolist()

    assert generate(model, prompts, 8).tokens == hf_greedy(hf_models["full"], prompts, 8)
    assert generate(small, prompts, 8).tokens == hf_greedy(hf_models["small"], prompts, 8)
    control = budget_control_generate(small, model, prompts, cfg.vocab_size - 1, 5, 4)
    thought = [p + t for p, t in zip(prompts, control.thinking)]
    assert all(len(t) == 6 for t in control.thinking)  # forced close: equal lengths for HF
    assert control.answers == hf_greedy(hf_models["full"], thought, 4)
