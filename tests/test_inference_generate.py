"""Incremental generation with KV / conv / SSM caches on the tiny_model hybrid model (Mamba-2,
attention, MoE, MLP layers), checked against Megatron's own full forward.

The reference everywhere is ``model(input_ids, position_ids, None)`` (the training forward) over
the whole sequence; greedy generation is compared with generation by full recompute, batches
with single prompts, nested models of an elastic model with the elastic forward at that choice.
"""

from __future__ import annotations

import pytest
import torch

from elastic_plugin.models.config import ConfigError
from tests.support.inference_cases import random_prompts, tiny_inference_model

pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")

TOL = 1e-5
LENGTHS = [5, 17, 1, 33]
NEW = 12
SIZES = {
    "embedding": [128, 96, 64],
    "ffn": [256, 128],
    "shared_ffn": [128, 64],
    "attention_heads": [4, 2],
    "mamba_heads": [8, 4],
    "mamba_head_dim": [16, 8],
    "experts": [8, 4],
}
SMALL = {
    "embedding": 64,
    "ffn": 128,
    "shared_ffn": 64,
    "attention_heads": 2,
    "mamba_heads": 4,
    "mamba_head_dim": 8,
    "experts": 4,
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """2-core machines shared with other jobs: one intra-op thread avoids spin-wait stalls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_inference_model(seed=1)


@pytest.fixture(scope="module")
def greedy_ref(tiny_model):
    """Greedy tokens of the test prompts by full recompute (the slow reference, computed once)."""
    from elastic_plugin.inference import recompute_generate

    model, cfg = tiny_model
    prompts = random_prompts(LENGTHS, cfg.vocab_size, seed=3)
    return prompts, recompute_generate(model, prompts, NEW)


def _full(model, tokens):
    from elastic_plugin.inference import full_logits

    return full_logits(model, tokens)


# ------------------------------------------------------------------------------ logits
@pytest.mark.parametrize("position_embedding", ["none", "rope"])
def test_cached_logits_equal_full_forward(tiny_model, position_embedding):
    """Prefill + every decode step == the full forward at every position; so do a prefill in
    chunks and rows of different lengths decoded in one batch."""
    from elastic_plugin.inference import InferenceCache, decode_step, extend, prefill

    model, cfg = (
        tiny_model
        if position_embedding == "none"
        else tiny_inference_model(seed=2, position_embedding_type="rope")
    )
    kinds = {type(layer).__name__ for layer in model.decoder.layers}
    assert kinds == {"MambaLayer", "TransformerLayer", "MoETransformerLayer", "MLPLayer"}
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (3, 45), generator=gen)
    full = _full(model, tokens)

    logits, cache = prefill(model, tokens[:, :37], max_length=64)
    steps = [decode_step(model, cache, tokens[:, t]) for t in range(37, 45)]
    cached = torch.cat([logits, torch.stack(steps, dim=1)], dim=1)
    diff = (cached - full).abs().max().item()
    print(
        f"[{position_embedding}] max |cached - full| = {diff:.2e} "
        f"(logits up to {full.abs().max():.2f})"
    )
    assert diff <= TOL
    assert cache.lengths.tolist() == [45, 45, 45]

    chunked = InferenceCache.allocate(model, 3, 64)
    parts = [extend(model, chunked, tokens[:, a:b]) for a, b in ((0, 5), (5, 6), (6, 45))]
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= TOL

    ragged = InferenceCache.allocate(model, 3, 64)
    for row, length in enumerate((10, 3, 1)):
        extend(model, ragged, tokens[row : row + 1, :length], rows=[row])
    step = decode_step(model, ragged, torch.stack([tokens[0, 10], tokens[1, 3], tokens[2, 1]]))
    expected = torch.stack([full[0, 10], full[1, 3], full[2, 1]])
    assert (step - expected).abs().max().item() <= TOL
    # a subset of rows advances alone; the others are untouched
    before = {i: t.clone() for i, t in ragged.ssm.items()}
    step = decode_step(model, ragged, tokens[1, 4:5], rows=[1])
    assert (step[0] - full[1, 4]).abs().max().item() <= TOL
    assert ragged.lengths.tolist() == [11, 5, 2]
    for index, state in ragged.ssm.items():
        assert torch.equal(state[[0, 2]], before[index][[0, 2]])
        assert not torch.equal(state[1], before[index][1])


@pytest.mark.parametrize("padded", [True, False])
def test_ragged_prefill_equals_full_forward(tiny_model, padded):
    """extend_ragged: rows of different lengths in one padded forward (``padded``), or
    advancing together up to each distinct length (one forward per distinct length, not per
    row); every row's last logits equal the full forward's and rows end exactly at their own
    length. A second ragged extend continues."""
    from elastic_plugin.inference import InferenceCache, extend_ragged, steps

    model, cfg = tiny_model
    gen = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, cfg.vocab_size, (5, 40), generator=gen)
    full = _full(model, tokens)
    lengths = [7, 1, 19, 7, 30]
    cache = InferenceCache.allocate(model, 6, 64)  # row 5 stays empty
    calls = []
    original = steps.extend

    def counting(*args, **kwargs):
        calls.append(kwargs.get("rows"))
        return original(*args, **kwargs)

    steps.extend = counting
    try:
        last = extend_ragged(
            model,
            cache,
            [tokens[i, :n].tolist() for i, n in enumerate(lengths)],
            rows=[0, 1, 2, 3, 4],
            padded=padded,
        )
    finally:
        steps.extend = original
    if padded:
        assert calls == [[0, 1, 2, 3, 4]]
    else:
        assert len(calls) == len(set(lengths)) == 4
        assert calls[0] == [0, 1, 2, 3, 4] and calls[-1] == [4]
    expected = torch.stack([full[i, n - 1] for i, n in enumerate(lengths)])
    assert (last - expected).abs().max().item() <= TOL
    assert cache.lengths.tolist() == lengths + [0]
    # level rows continue with a second ragged feed
    more = extend_ragged(
        model,
        cache,
        [tokens[0, 7:9].tolist(), tokens[3, 7:20].tolist()],
        rows=[0, 3],
        padded=padded,
    )
    assert (more - torch.stack([full[0, 8], full[3, 19]])).abs().max().item() <= TOL
    with pytest.raises(ConfigError, match=r"rows \[0, 2\] hold different numbers of tokens"):
        extend_ragged(model, cache, [[1], [2]], rows=[0, 2])
    with pytest.raises(ConfigError, match="2 sequences for 1 rows"):
        extend_ragged(model, cache, [[1], [2]], rows=[5])


def test_cache_shapes(tiny_model):
    from elastic_plugin.inference import InferenceCache

    model, cfg = tiny_model
    cache = InferenceCache.allocate(model, 2, 16)
    assert sorted(cache.keys) == [1, 5] and sorted(cache.ssm) == [0, 4]
    assert cache.keys[1].shape == (2, 16, cfg.query_groups, cfg.head_dim)
    conv_channels = (
        cfg.mamba_num_heads * cfg.mamba_head_dim + 2 * cfg.mamba_num_groups * cfg.mamba_state_dim
    )
    assert cache.conv[0].shape == (2, conv_channels, cfg.mamba_conv_kernel - 1)
    assert cache.ssm[0].shape == (2, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_dim)
    assert cache.ssm[0].dtype == torch.float32


# ------------------------------------------------------------------------------ generation
def test_greedy_equals_full_recompute_and_single_prompts(tiny_model, greedy_ref):
    from elastic_plugin.inference import generate

    model, _ = tiny_model
    prompts, reference = greedy_ref
    result = generate(model, prompts, NEW)
    assert result.tokens == reference.tokens
    assert result.stop_reasons == ["max_new_tokens"] * len(prompts)
    assert result.num_generated == [NEW] * len(prompts)
    assert result.sequences[2] == prompts[2] + result.tokens[2]
    assert result.prefill_s > 0 and result.decode_s > 0 and result.tokens_per_s > 0
    assert len({tuple(t) for t in result.tokens}) == len(prompts)  # not one constant output
    for prompt, tokens in zip(prompts, result.tokens):
        assert generate(model, [prompt], NEW).tokens == [tokens]


def test_stop_tokens_and_max_length(tiny_model, greedy_ref):
    """Each row stops right after its own first stop token; the others go on."""
    from elastic_plugin.inference import generate

    model, _ = tiny_model
    prompts, reference = greedy_ref
    stop = reference.tokens[1][3]
    result = generate(model, prompts, NEW, stop_tokens=[stop])
    for row, full in enumerate(reference.tokens):
        if stop in full:
            cut = full.index(stop) + 1
            assert result.tokens[row] == full[:cut] and result.stop_reasons[row] == "stop_token"
        else:
            assert result.tokens[row] == full and result.stop_reasons[row] == "max_new_tokens"
    assert result.stop_reasons[1] == "stop_token" and len(result.tokens[1]) <= 4

    capped = generate(model, prompts, NEW, max_length=36)
    assert [len(p) + n for p, n in zip(prompts, capped.num_generated)] == [
        min(len(p) + NEW, 36) for p in prompts
    ]
    assert capped.stop_reasons[3] == "max_length"
    assert capped.tokens[3] == reference.tokens[3][:3]


def test_sampling_is_seeded(tiny_model, greedy_ref):
    from elastic_plugin.inference import generate, recompute_generate

    model, _ = tiny_model
    prompts, reference = greedy_ref
    first = generate(model, prompts, NEW, greedy=False, temperature=1.5, seed=11)
    again = generate(model, prompts, NEW, greedy=False, temperature=1.5, seed=11)
    other = generate(model, prompts, NEW, greedy=False, temperature=1.5, seed=12)
    assert first.tokens == again.tokens
    assert first.tokens != other.tokens
    assert first.tokens != reference.tokens
    # the same draws in the same order as the cache-free reference
    assert (
        recompute_generate(model, prompts, NEW, greedy=False, temperature=1.5, seed=11).tokens
        == first.tokens
    )
    assert generate(model, prompts, NEW, greedy=False, top_k=1, seed=3).tokens == reference.tokens
    top_p = generate(model, prompts, NEW, greedy=False, top_p=1e-6, seed=3)
    assert top_p.tokens == reference.tokens


def test_sampler_support():
    """top_k / top_p keep exactly the expected tokens; frequencies follow the probabilities."""
    from elastic_plugin.inference import Sampler

    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(4000, 4)
    gen = torch.Generator().manual_seed(0)
    assert set(Sampler(False, top_k=2).check(4)(logits, gen).tolist()) == {1, 3}
    assert set(Sampler(False, top_p=0.7).check(4)(logits, gen).tolist()) == {1, 3}
    assert set(Sampler(False, top_p=0.81).check(4)(logits, gen).tolist()) == {1, 2, 3}
    counts = torch.bincount(Sampler(False).check(4)(logits, gen), minlength=4) / 4000
    assert (counts - probs).abs().max() < 0.03
    assert torch.equal(Sampler().check(4)(logits[:2], None), torch.tensor([1, 1]))


# ------------------------------------------------------------------------------ elastic
@pytest.fixture(scope="module")
def elastic():
    from tests.support.elastic_model import make_elastic

    model, cfg = tiny_inference_model(seed=4)
    state, _ = make_elastic(model, cfg, SIZES)
    return model, cfg, state


def test_nested_model_generates_like_the_elastic_forward(elastic):
    from elastic_plugin.inference import generate, recompute_generate
    from elastic_plugin.nested.model import nested_model

    model, cfg, state = elastic
    prompts = random_prompts([6, 20, 2], cfg.vocab_size, seed=8)
    state.clear()
    small, small_cfg = nested_model(model, cfg, SMALL)
    assert small_cfg.hidden_size == 64 and small.decoder.layers[0].mixer.nheads_local_tp == 4
    cached = generate(small, prompts, 10)
    state.set_sizes(SMALL)
    try:
        with pytest.raises(ConfigError, match="nested_model"):
            generate(model, prompts, 2)
        elastic_ref = recompute_generate(model, prompts, 10)
    finally:
        state.clear()
    assert cached.tokens == elastic_ref.tokens
    full = generate(model, prompts, 10)  # state cleared: the full model runs cached
    assert full.tokens == recompute_generate(model, prompts, 10).tokens
    assert full.tokens != cached.tokens  # the choice really changed the model


def test_load_nested_model_from_checkpoint(elastic, tmp_path):
    """An elastic checkpoint's stored choice for a budget == ``nested_model`` in memory; untrained
    budgets and a budget for a non-elastic checkpoint are refused."""
    from dataclasses import asdict

    from elastic_plugin.checkpoint.io import save_checkpoint
    from elastic_plugin.inference import generate
    from elastic_plugin.models.config import load_config
    from elastic_plugin.nested.model import load_nested_model, nested_model
    from elastic_plugin.parallel import Layout
    from tests.support.inference_cases import TINY_CONFIG

    model, cfg, state = elastic
    state.clear()
    prompts = random_prompts([4, 9], cfg.vocab_size, seed=9)
    expected = generate(nested_model(model, cfg, SMALL)[0], prompts, 6).tokens
    experiment = load_config(TINY_CONFIG)
    experiment_dict = {**experiment.to_dict(), "elastic": {"budgets": [1.0, 0.5], "sizes": SIZES}}
    full_choice = {axis: sizes[0] for axis, sizes in SIZES.items()}
    meta = {
        "kind": "elastic",
        "config": experiment_dict,
        "layout": asdict(Layout()),
        "elastic": {"budgets": [1.0, 0.5], "choices": {"1": full_choice, "0.5": SMALL}},
    }
    save_checkpoint([model], tmp_path / "elastic", meta)
    plain_meta = {"kind": "extracted", "config": experiment.to_dict(), "layout": asdict(Layout())}
    save_checkpoint([model], tmp_path / "plain", plain_meta)

    with pytest.raises(ConfigError, match=r"--budget 0\.7 .*trained budgets: 1, 0\.5"):
        load_nested_model(tmp_path / "elastic", 0.7)
    with pytest.raises(ConfigError, match="--budget"):
        load_nested_model(tmp_path / "elastic")
    with pytest.raises(ConfigError, match="not an elastic one"):
        load_nested_model(tmp_path / "plain", 0.5)
    with pytest.raises(ConfigError, match="--ckpt"):
        load_nested_model(tmp_path / "missing", 0.5)
    small, small_cfg = load_nested_model(tmp_path / "elastic", 0.5)
    assert small_cfg.hidden_size == 64
    assert generate(small, prompts, 6).tokens == expected
    plain, plain_cfg = load_nested_model(tmp_path / "plain")
    assert plain_cfg.hidden_size == cfg.hidden_size
    assert generate(plain, prompts, 6).tokens == generate(model, prompts, 6).tokens


def test_budget_control_thinks_small_and_answers_full(elastic):
    """Thinking = the small model's greedy tokens up to its first ``</think>`` (or forced after
    the thinking budget); the answer = the full model's greedy continuation of prompt +
    thinking, computed here by full recompute."""
    from elastic_plugin.inference import budget_control_generate, generate, recompute_generate
    from elastic_plugin.nested.model import nested_model

    model, cfg, state = elastic
    state.clear()
    small, _ = nested_model(model, cfg, SMALL)
    prompts = random_prompts([6, 11, 3], cfg.vocab_size, seed=21)
    free = generate(small, prompts, 8).tokens
    close = free[0][2]
    result = budget_control_generate(small, model, prompts, close, 8, 5)
    for row, tokens in enumerate(free):
        if close in tokens:
            expected, forced = tokens[: tokens.index(close) + 1], False
        else:
            expected, forced = tokens + [close], True
        assert result.thinking[row] == expected and result.think_forced[row] == forced
    assert result.thinking[0] == free[0][:3] and not result.think_forced[0]
    assert any(result.think_forced)
    answers = recompute_generate(model, [p + t for p, t in zip(prompts, result.thinking)], 5)
    assert result.answers == answers.tokens
    assert result.sequences[1] == prompts[1] + result.thinking[1] + result.answers[1]
    with pytest.raises(ConfigError, match="think_close=128"):
        budget_control_generate(small, model, prompts, 128, 8, 5)


def test_capped_thinking_forces_close_and_continues_on_the_same_cache(tiny_model):
    """The standard baseline: a row that has not closed its thinking after ``cap`` tokens emits
    ``</think>`` instead, then continues greedily; by full recompute of prompt + forced
    sequence, every later token is the argmax (the cache was not disturbed)."""
    from elastic_plugin.inference import capped_thinking_generate, generate, recompute_generate

    model, cfg = tiny_model
    prompts = random_prompts([6, 11, 3], cfg.vocab_size, seed=21)
    free = generate(model, prompts, 10).tokens
    close = free[0][2]  # row 0 closes by itself at its third token
    cap = 5
    result = capped_thinking_generate(model, prompts, close, cap, 4)
    for row, tokens in enumerate(result.tokens):
        if close in free[row][:cap]:
            end = free[row].index(close) + 1
            assert tokens[:end] == free[row][:end]
        else:
            assert tokens[:cap] == free[row][:cap] and tokens[cap] == close
            end = cap + 1
        assert len(tokens) - end <= 4
        rest = recompute_generate(model, [prompts[row] + tokens[:end]], len(tokens) - end)
        assert tokens[end:] == rest.tokens[0]
    assert any(close not in free[row][:cap] for row in range(3))
    with pytest.raises(ConfigError, match="max_think_tokens=0"):
        capped_thinking_generate(model, prompts, close, 0, 4)


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"prompts": [[1, 2], [3] * 256]},
            r"prompts\[1\] has 256 tokens.*max_sequence_length is 256",
        ),
        ({"prompts": [[1, 2], [3] * 300]}, r"prompts\[1\] has 300 tokens"),
        (
            {"prompts": [[1] * 10], "max_length": 8},
            r"prompts\[0\] has 10 tokens.*max_length .* is 8",
        ),
        ({"max_length": 257}, r"max_length=257.*\[2, 256\]"),
        ({"stop_tokens": [5, 128]}, r"stop_tokens: \[128\] are outside the vocabulary \[0, 128\)"),
        ({"stop_tokens": [-1]}, r"stop_tokens"),
        ({"prompts": [[1], []]}, r"prompts\[1\] is empty"),
        ({"prompts": []}, r"prompts: must be a non-empty list"),
        ({"prompts": [[1, 999]]}, r"prompts\[0\]: token ids \[999\]"),
        ({"max_new_tokens": 0}, r"max_new_tokens=0"),
        ({"top_k": 5}, r"greedy=False"),
        ({"greedy": False, "top_k": 0}, r"top_k=0"),
        ({"greedy": False, "top_p": 0.0}, r"top_p=0.0"),
        ({"greedy": False, "temperature": 0.0}, r"temperature=0.0"),
    ],
)
def test_bad_input(tiny_model, kwargs, match):
    from elastic_plugin.inference import generate

    model, _ = tiny_model
    args = {"prompts": [[1, 2, 3]], "max_new_tokens": 4, **kwargs}
    with pytest.raises(ConfigError, match=match):
        generate(model, **args)


def test_bad_cache_use(tiny_model):
    from elastic_plugin.inference import InferenceCache, decode_step, extend, prefill

    model, _ = tiny_model
    with pytest.raises(ConfigError, match="longer than max_length 4"):
        prefill(model, torch.zeros(1, 5, dtype=torch.long), max_length=4)
    with pytest.raises(ConfigError, match=r"max_length=300"):
        InferenceCache.allocate(model, 1, 300)
    _, cache = prefill(model, torch.zeros(2, 4, dtype=torch.long), max_length=4)
    with pytest.raises(ConfigError, match="do not fit"):
        decode_step(model, cache, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ConfigError, match="rows"):
        extend(model, cache, torch.zeros(1, 1, dtype=torch.long), rows=[2])


def test_bench_quickest_run():
    """``bench/bench_generate.py`` runs (both generators agree on every repetition) and its
    ratios are the ratios of its columns. Behaviour, not speed."""
    import math

    from bench.bench_generate import run

    rows = run(quick=True, reps=1)
    assert [r["name"] for r in rows] == ["generate/b1/p64+8", "generate/b8/p64+8"]
    for r in rows:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in r if k != "name")
        assert r["decode_speedup"] == pytest.approx(r["cached_tok/s"] / r["recompute_tok/s"])
