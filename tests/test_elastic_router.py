"""Budget router (Gumbel-Softmax, masks, encoding, init, learning) and the budget sampler / curriculum."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from elastic_plugin.elastic.config import CurriculumStage
from elastic_plugin.elastic.router import (
    AnnealSchedule,
    BudgetRouter,
    budget_encoding,
    expected_sizes,
    gumbel_softmax,
    hard_sizes,
    prefix_masks,
)
from elastic_plugin.elastic.sampling import BudgetSampler
from elastic_plugin.models.config import ConfigError

BUDGETS = (1.0, 0.75, 0.5)
CANDIDATES = (8, 6, 4)  # descending; fractions 1.0, 0.75, 0.5 of FULL
FULL = 8


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- gumbel_softmax
def test_gumbel_hard_is_one_hot_with_soft_gradient():
    logits = torch.randn(4, 5, generator=_gen(0), requires_grad=True)
    weights = torch.randn(4, 5, generator=_gen(1))
    hard = gumbel_softmax(logits, 0.7, 2.0, True, _gen(3))
    assert torch.equal(hard.sum(-1), torch.ones(4))
    assert set(hard.detach().unique().tolist()) <= {0.0, 1.0}
    (g_hard,) = torch.autograd.grad((hard * weights).sum(), logits)

    soft = gumbel_softmax(logits, 0.7, 2.0, False, _gen(3))  # same noise
    assert torch.equal(hard.detach().argmax(-1), soft.detach().argmax(-1))
    (g_soft,) = torch.autograd.grad((soft * weights).sum(), logits)
    assert g_hard.abs().sum() > 0
    torch.testing.assert_close(g_hard, g_soft, rtol=0, atol=0)


def test_gumbel_formula_and_noise_reproducible():
    logits = torch.randn(3, 4, generator=_gen(5))
    a = gumbel_softmax(logits, 0.5, 3.0, False, _gen(11))
    b = gumbel_softmax(logits, 0.5, 3.0, False, _gen(11))
    c = gumbel_softmax(logits, 0.5, 3.0, False, _gen(12))
    assert torch.equal(a, b) and not torch.allclose(a, c)
    # reference: same CPU float64 Gumbel draw, written out
    u = torch.rand(3, 4, generator=_gen(11), dtype=torch.float64)
    g = (-torch.log(-torch.log(u))).float()
    torch.testing.assert_close(a, torch.softmax((3.0 * logits + g) / 0.5, -1))
    # float64 logits get the same noise (drawn on CPU in float64 whatever the logits' dtype)
    a64 = gumbel_softmax(logits.double(), 0.5, 3.0, False, _gen(11))
    torch.testing.assert_close(a64.float(), a, atol=1e-5, rtol=0)


def test_gumbel_low_temperature_and_no_noise():
    logits = torch.tensor([[0.1, 0.5, 0.3], [2.0, -1.0, 1.9]])
    cold = gumbel_softmax(logits, 1e-3, 1.0, False, _gen(0))
    assert (cold.max(-1).values > 0.999).all()
    soft = gumbel_softmax(logits, 1.0, 1.0, False, None)
    torch.testing.assert_close(soft, torch.softmax(logits, -1))
    hard = gumbel_softmax(logits, 1.0, 1.0, True, None)
    assert hard.argmax(-1).tolist() == [1, 0] and torch.equal(hard.sum(-1), torch.ones(2))
    with pytest.raises(ConfigError, match="temperature"):
        gumbel_softmax(logits, 0.0, 1.0, False, None)


def test_gumbel_sample_frequencies_follow_softmax():
    logits = torch.tensor([[1.0, 0.0, -1.0]])
    gen = _gen(7)
    counts = Counter(int(gumbel_softmax(logits, 1.0, 1.0, True, gen).argmax()) for _ in range(6000))
    expected = torch.softmax(logits, -1)[0].tolist()
    for i, p in enumerate(expected):
        assert abs(counts[i] / 6000 - p) < 0.025


# ----------------------------------------------------------------------------- masks and sizes
def test_prefix_masks_match_loop():
    probs = torch.softmax(torch.randn(3, 3, generator=_gen(2)), -1)
    masks = prefix_masks(probs, CANDIDATES, FULL)
    ref = torch.zeros(3, FULL)
    for layer in range(3):
        for j in range(FULL):
            ref[layer, j] = sum(probs[layer, c] for c in range(3) if j < CANDIDATES[c])
    torch.testing.assert_close(masks, ref)
    one_hot = torch.tensor([[0.0, 1.0, 0.0]])
    assert prefix_masks(one_hot, CANDIDATES, FULL).tolist() == [[1.0] * 6 + [0.0] * 2]
    torch.testing.assert_close(
        expected_sizes(probs, CANDIDATES), probs @ torch.tensor([8.0, 6.0, 4.0])
    )
    assert hard_sizes(probs, CANDIDATES) == [CANDIDATES[i] for i in probs.argmax(-1).tolist()]
    with pytest.raises(ConfigError, match="full=8"):
        prefix_masks(probs, (9, 6, 4), FULL)
    with pytest.raises(ConfigError, match="candidates"):
        expected_sizes(probs, (8, 4))


@pytest.mark.parametrize("hard", [False, True])
def test_gradients_reach_router_through_masks_and_sizes(hard):
    router = BudgetRouter(BUDGETS, {"ffn": (3, 2)}, hidden_size=16)
    probs = router(router.encode(0.75), 1.0, 1.0, hard, _gen(0))["ffn"]
    target = torch.linspace(0, 1, FULL)
    loss = (prefix_masks(probs, CANDIDATES, FULL) * target).sum() + expected_sizes(
        probs, CANDIDATES
    ).pow(2).sum()
    loss.backward()
    for name, p in router.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


# ----------------------------------------------------------------------------- budget encoding
def test_budget_encoding():
    assert budget_encoding(0.75, BUDGETS).tolist() == [0.0, 1.0, 0.0]
    assert budget_encoding(0.5 + 1e-7, BUDGETS).tolist() == [0.0, 0.0, 1.0]
    enc = budget_encoding(0.6, BUDGETS, interpolate=True)
    torch.testing.assert_close(enc, torch.tensor([0.0, 0.4, 0.6]))
    enc = budget_encoding(0.9, (0.5, 1.0, 0.75), interpolate=True)  # unsorted budgets
    torch.testing.assert_close(enc, torch.tensor([0.0, 0.6, 0.4]))
    with pytest.raises(ConfigError, match=r"budget 0.6 is not a trained budget .*interpolate=True"):
        budget_encoding(0.6, BUDGETS)
    with pytest.raises(ConfigError, match=r"budget 0.3 is outside the trained range \[0.5, 1\]"):
        budget_encoding(0.3, BUDGETS, interpolate=True)
    with pytest.raises(ConfigError, match="outside the trained range"):
        budget_encoding(1.2, BUDGETS, interpolate=True)
    with pytest.raises(ConfigError, match="distinct"):
        budget_encoding(0.5, (0.5, 0.5))


# ----------------------------------------------------------------------------- router
def test_router_shapes_homogeneous_and_heterogeneous():
    router = BudgetRouter(BUDGETS, {"hidden": (3, 1), "ffn": (4, 5)}, hidden_size=32)
    logits = router.logits(router.encode(1.0))
    assert logits["hidden"].shape == (1, 3) and logits["ffn"].shape == (5, 4)
    probs = router(router.encode(0.5), 1.0, 1.0, False, _gen(0))
    assert probs["ffn"].shape == (5, 4)
    torch.testing.assert_close(probs["ffn"].sum(-1), torch.ones(5))
    choice = router.choose(0.5)
    assert len(choice["hidden"]) == 1 and len(choice["ffn"]) == 5
    assert choice == {
        k: v.argmax(-1).tolist() for k, v in router.logits(router.encode(0.5)).items()
    }
    with pytest.raises(ConfigError, match="not a trained budget"):
        router.choose(0.6)
    mixed = router.logits(router.encode(0.6, interpolate=True))
    assert router.choose(0.6, interpolate=True) == {
        k: v.argmax(-1).tolist() for k, v in mixed.items()
    }
    with pytest.raises(ConfigError, match="shape"):
        router.logits(torch.ones(2))
    with pytest.raises(ConfigError, match="num_candidates"):
        BudgetRouter(BUDGETS, {"ffn": (0, 1)})


def test_router_deterministic_across_instances():
    axes = {"hidden": (3, 1), "ffn": (3, 4)}
    a, b = BudgetRouter(BUDGETS, axes), BudgetRouter(BUDGETS, axes)
    torch.manual_seed(123)  # a private seed does not depend on the global RNG
    c = BudgetRouter(BUDGETS, axes)
    for other in (b, c):
        for (n, p), (_, q) in zip(a.named_parameters(), other.named_parameters()):
            assert torch.equal(p, q), n
    assert not torch.equal(
        a.routers["ffn"].fc1.weight, BudgetRouter(BUDGETS, axes, seed=1).routers["ffn"].fc1.weight
    )
    torch.manual_seed(5)
    d = BudgetRouter(BUDGETS, axes, seed=None)
    torch.manual_seed(5)
    e = BudgetRouter(BUDGETS, axes, seed=None)
    assert all(torch.equal(p, q) for p, q in zip(d.parameters(), e.parameters()))
    enc = a.encode(0.75)
    sa = a(enc, 0.5, 2.0, True, _gen(9))
    sb = b(enc, 0.5, 2.0, True, _gen(9))
    assert all(torch.equal(sa[k], sb[k]) for k in axes)


def test_router_init_prefers_plausible_candidates():
    fractions = {"ffn": [c / FULL for c in CANDIDATES], "heads": [1.0, 0.5]}
    router = BudgetRouter(
        BUDGETS, {"ffn": (3, 4), "heads": (2, 1), "experts": (3, 1)}, candidate_fractions=fractions
    )
    assert router.choose(1.0) == {"ffn": [0] * 4, "heads": [0], "experts": [0]}
    assert router.choose(0.75) == {
        "ffn": [1] * 4,
        "heads": [0],
        "experts": [1],
    }  # heads: tie -> larger
    assert router.choose(0.5) == {"ffn": [2] * 4, "heads": [1], "experts": [2]}
    logits = router.logits(router.encode(0.75))["ffn"]
    torch.testing.assert_close(logits, torch.tensor([[0.0, 2.0, 0.0]] * 4), atol=1e-4, rtol=0)
    uniform = BudgetRouter(BUDGETS, {"ffn": (3, 2)}, init_bias_to_budget=False)
    for b in BUDGETS:
        assert torch.equal(uniform.logits(uniform.encode(b))["ffn"], torch.zeros(2, 3))


def test_router_learns_budget_to_size():
    """200 Adam steps on E_sample[(size/full - budget)^2] from a uniform start pick the right candidate."""
    router = BudgetRouter(BUDGETS, {"ffn": (3, 2)}, hidden_size=32, init_bias_to_budget=False)
    frac = torch.tensor(CANDIDATES, dtype=torch.float32) / FULL
    opt = torch.optim.Adam(router.parameters(), lr=1e-2)
    gen = _gen(0)
    assert router.choose(0.5)["ffn"] == [0, 0]  # uniform start: argmax ties -> index 0
    for _ in range(200):
        opt.zero_grad()
        loss = sum(
            (router(router.encode(b), 1.0, 1.0, False, gen)["ffn"] @ (frac - b).pow(2)).sum()
            for b in BUDGETS
        )
        loss.backward()
        opt.step()
    assert router.choose(1.0)["ffn"] == [0, 0]
    assert router.choose(0.75)["ffn"] == [1, 1]
    assert router.choose(0.5)["ffn"] == [2, 2]


def test_router_learns_with_straight_through_budget_loss():
    """The method's budget loss |size(hard)/(b·full) - 1| with straight-through samples also learns."""
    router = BudgetRouter(BUDGETS, {"ffn": (3, 1)}, hidden_size=32, init_bias_to_budget=False)
    opt = torch.optim.Adam(router.parameters(), lr=1e-2)
    temp = AnnealSchedule(1.0, 0.1, 300)
    gen = _gen(1)
    for it in range(300):
        opt.zero_grad()
        loss = 0.0
        for b in BUDGETS:
            probs = router(router.encode(b), temp.value(it), 1.0, True, gen)["ffn"]
            loss = loss + (expected_sizes(probs, CANDIDATES) / (b * FULL) - 1).abs().sum()
        loss.backward()
        opt.step()
    assert [router.choose(b)["ffn"] for b in BUDGETS] == [[0], [1], [2]]


# ----------------------------------------------------------------------------- annealing
@pytest.mark.parametrize("kind", ["exponential", "linear"])
def test_anneal_schedule(kind):
    temp = AnnealSchedule(1.0, 0.05, 100, kind)
    scale = AnnealSchedule(1.0, 10.0, 100, kind)
    assert temp.value(0) == 1.0 and temp.value(100) == 0.05 and temp.value(1000) == 0.05
    assert scale.value(0) == 1.0 and scale.value(100) == 10.0
    t = [temp.value(i) for i in range(101)]
    s = [scale.value(i) for i in range(101)]
    assert all(x > y for x, y in zip(t, t[1:])) and all(x < y for x, y in zip(s, s[1:]))
    mid = math.sqrt(0.05) if kind == "exponential" else 0.525
    assert temp.value(50) == pytest.approx(mid)
    assert AnnealSchedule(2.0, 3.0, 0, kind).value(0) == 3.0
    with pytest.raises(ConfigError, match="anneal kind"):
        AnnealSchedule(1.0, 0.1, 10, "cosine")
    with pytest.raises(ConfigError, match="start > 0"):
        AnnealSchedule(0.0, 0.1, 10, "exponential")


# ----------------------------------------------------------------------------- sampler
def test_sampler_deterministic_and_varied():
    a = BudgetSampler(BUDGETS, None, seed=3, total_iters=100)
    b = BudgetSampler(BUDGETS, None, seed=3, total_iters=100)
    draws = [a.budget_index(it, mb) for it in range(1, 21) for mb in range(8)]
    assert draws == [b.budget_index(it, mb) for it in range(1, 21) for mb in range(8)]
    assert draws == [a.budget_index(it, mb) for it in range(1, 21) for mb in range(8)]  # stateless
    assert len(set(draws)) == 3
    assert [a.budget_index(1, mb) for mb in range(30)] != [
        a.budget_index(2, mb) for mb in range(30)
    ]
    other = BudgetSampler(BUDGETS, None, seed=4, total_iters=100)
    assert draws != [other.budget_index(it, mb) for it in range(1, 21) for mb in range(8)]
    # noise generators: reproducible, distinct per micro-batch
    x = torch.rand(4, generator=a.noise_generator(5, 2))
    assert torch.equal(x, torch.rand(4, generator=b.noise_generator(5, 2)))
    assert not torch.equal(x, torch.rand(4, generator=a.noise_generator(5, 3)))
    assert not torch.equal(x, torch.rand(4, generator=a.noise_generator(6, 2)))
    assert a.budget(1, 0) == BUDGETS[a.budget_index(1, 0)]


def _chi_square(counts: Counter, probs, n: int) -> float:
    return sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs) if p > 0)


def test_sampler_stages_and_frequencies():
    stages = [
        CurriculumStage(10, None, 512),
        CurriculumStage(20, (0.5, 0.3, 0.2), 1024),
        CurriculumStage(5, (0.0, 0.0, 1.0), None),
    ]
    s = BudgetSampler(BUDGETS, stages, seed=0, total_iters=100)
    assert s.stage(1)[0] == 0 and s.stage(10)[0] == 0 and s.stage(11)[0] == 1
    assert (
        s.stage(30)[0] == 1 and s.stage(31)[0] == 2 and s.stage(500)[0] == 2
    )  # last stage continues
    assert s.seq_length(5) == 512 and s.seq_length(11) == 1024 and s.seq_length(99) is None
    assert {s.budget_index(it, mb) for it in range(31, 60) for mb in range(10)} == {2}

    n = 20000
    # stage 1: uniform; chi-square with 2 degrees of freedom, 18.4 = p < 1e-4
    uniform = Counter(s.budget_index(1 + i % 10, i // 10) for i in range(n))
    assert _chi_square(uniform, [1 / 3] * 3, n) < 18.4
    skewed = Counter(s.budget_index(11 + i % 20, i // 20) for i in range(n))
    assert _chi_square(skewed, [0.5, 0.3, 0.2], n) < 18.4
    assert _chi_square(skewed, [1 / 3] * 3, n) > 100  # the test can tell the two apart


def test_sampler_validation():
    # one stage type (elastic.config.CurriculumStage): the sampler checks it against its budgets
    with pytest.raises(
        ConfigError, match=r"curriculum\[0\]\.budget_probs=\[0.5, 0.5\] has 2 entries"
    ):
        BudgetSampler(BUDGETS, [CurriculumStage(5, (0.5, 0.5), None)], 0, 10)
    with pytest.raises(ConfigError, match=r"budget_probs=\[0.5, 0.3, 0.3\] sums to 1.1"):
        BudgetSampler(
            BUDGETS,
            [CurriculumStage(5, None, None), CurriculumStage(5, (0.5, 0.3, 0.3), None)],
            0,
            10,
        )
    with pytest.raises(ConfigError, match="iters"):
        BudgetSampler(BUDGETS, [CurriculumStage(0, None, None)], 0, 10)
    with pytest.raises(ConfigError, match="1-based"):
        BudgetSampler(BUDGETS, None, 0, 10).stage(0)
    token_stage = CurriculumStage(tokens=512.0, seq_length=16)
    with pytest.raises(ConfigError, match=r"curriculum\[0\] is given in tokens \(512\)"):
        BudgetSampler(BUDGETS, [token_stage], 0, 10)
    counted = BudgetSampler(BUDGETS, [token_stage.in_iterations(8, 64)], 0, 10)
    assert counted.stage(4)[0] == 0 and counted.stages[0].iters == 4  # 512 / (8 x 16)


def _opinionated_router(tiny):
    """(resolved config, router, cost) over a 3 x 2 x 2 x 2 grid (and default axes), the
    router perturbed so it has opinions (not the near-uniform init)."""
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.cost import ElasticCost
    from elastic_plugin.elastic.router import make_router

    resolved = ElasticConfig.from_dict(
        {
            "budgets": [1.0, 0.77, 0.4],
            "sizes": {
                "embedding": [1.0, 0.75, 0.5],
                "ffn": [1.0, 0.5],
                "experts": [1.0, 0.5],
                "mamba_heads": [1.0, 0.5],
            },
        }
    ).resolve(tiny)
    router, cost = make_router(resolved, seed=3), ElasticCost(tiny, resolved)
    with torch.no_grad():
        for p in router.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return resolved, router, cost


def test_frozen_choice_is_the_most_likely_one_within_budget(tiny):
    """At freeze, each budget gets the highest joint-probability homogeneous choice whose cost
    is within 5% of the budget (checked here by an independent scan of every choice); with no
    tolerance it falls back to the choice closest to the budget."""
    import itertools

    from elastic_plugin.elastic.freeze import constrained_choice, constrained_table

    resolved, router, cost = _opinionated_router(tiny)
    table = constrained_table(router, resolved, cost)
    names = list(resolved.axes)
    for budget in resolved.budgets:
        with torch.no_grad():
            logits = router.logits(router.encode(budget))
        scored = []
        for sizes in itertools.product(*(resolved.axes[n].candidates for n in names)):
            choice = dict(zip(names, sizes))
            fraction = cost.of_choice(choice) / cost.full
            logp = sum(
                torch.log_softmax(logits[n][0].double(), -1)[
                    resolved.axes[n].candidates.index(s)
                ].item()
                for n, s in choice.items()
            )
            scored.append((abs(fraction / budget - 1), logp, choice))
        feasible = [s for s in scored if s[0] <= 0.05]
        assert feasible, budget
        assert table[f"{budget:g}"] == max(feasible, key=lambda s: s[1])[2]
        nearest = min(scored, key=lambda s: s[0])[2]
        assert (
            constrained_choice(router, resolved, cost, budget, tolerance=0.0) == nearest
            or abs(cost.of_choice(nearest) / cost.full / budget - 1) == 0.0
        )


def test_loss_selected_freeze_keeps_the_lowest_loss_among_the_likeliest(tiny):
    """freeze_select=loss: per budget, the router's N most likely feasible choices (all when
    None) are measured and the lowest loss wins; with N=1 it is the likelihood freeze; the
    record names the winner's loss, the router's own pick's loss and the cost fraction."""
    from elastic_plugin.elastic.freeze import (
        by_likelihood,
        constrained_table,
        feasible_choices,
        loss_selected_table,
    )

    resolved, router, cost = _opinionated_router(tiny)

    def fake_loss(choice):  # an arbitrary fixed value per choice (no ties)
        import random

        return random.Random(repr(sorted(choice.items()))).random()

    measured = []

    def evaluate(table):
        measured.append(dict(table))
        return {key: fake_loss(choice) for key, choice in table.items()}

    table, search = loss_selected_table(router, resolved, cost, evaluate)
    assert len(measured) == len(resolved.budgets)
    for budget in resolved.budgets:
        label = f"{budget:g}"
        feasible = feasible_choices(resolved, cost, budget)
        assert all(abs(cost.of_choice(c) / cost.full / budget - 1) <= 0.05 for c in feasible)
        assert table[label] == min(feasible, key=fake_loss)
        ranked = by_likelihood(router, resolved, budget, feasible)
        assert search[label]["candidates"] == len(feasible)
        assert search[label]["loss"] == pytest.approx(fake_loss(table[label]))
        assert search[label]["router_choice_loss"] == pytest.approx(fake_loss(ranked[0]))
        assert ranked[search[label]["router_rank_of_choice"]] == table[label]
    some = [b for b in resolved.budgets if len(feasible_choices(resolved, cost, b)) > 2]
    assert some and any(
        table[f"{b:g}"] != constrained_table(router, resolved, cost)[f"{b:g}"] for b in some
    )  # the measured pick differs from the likeliest somewhere

    top2, _ = loss_selected_table(router, resolved, cost, evaluate, candidates=2)
    one, _ = loss_selected_table(router, resolved, cost, evaluate, candidates=1)
    assert one == constrained_table(router, resolved, cost)
    for budget in resolved.budgets:
        ranked = by_likelihood(router, resolved, budget, feasible_choices(resolved, cost, budget))
        assert top2[f"{budget:g}"] == min(ranked[:2], key=fake_loss)
    with pytest.raises(RuntimeError, match="no validation loss came back for budget 1"):
        loss_selected_table(router, resolved, cost, lambda table: {k: None for k in table})
