"""Importance scores: REAP equals its formula, every axis is collected, and the scores (hence
rankings) under TP=2 (+SP), PP=2 and EP=2 equal the single-rank ones."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml")
CASES = "tests.support.importance_cases"
ALL_AXES = ["embedding", "ffn", "shared_ffn", "attention_heads", "mamba", "experts"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, rank_pools):
    work = tmp_path_factory.mktemp("importance")
    pool = rank_pools.get(1)
    (info,) = pool.run(f"{CASES}:reference_importance", config_path=CONFIG, workdir=str(work))
    return str(work), info


def test_every_axis_is_collected(reference):
    _, info = reference
    assert info["axes"] == ALL_AXES
    assert info["tokens"] > 0


def test_reap_matches_direct_formula(reference):
    _, info = reference
    assert set(info["direct_reap"]) == set(info["collected_reap"])
    for layer, direct in info["direct_reap"].items():
        assert info["collected_reap"][layer] == pytest.approx(direct, rel=1e-6, abs=1e-9)
        assert max(direct) > 0


@pytest.mark.integration
@pytest.mark.parametrize(
    "layout",
    [
        {"tp": 2, "sequence_parallel": True},
        {"pp": 2},
        {"ep": 2},
        {"cp": 2},
    ],
    ids=["tp2-sp", "pp2", "ep2", "cp2"],
)
def test_scores_and_rankings_independent_of_layout(reference, layout, rank_pools):
    workdir, info = reference
    pool = rank_pools.get(2)
    reports = pool.run(f"{CASES}:layout_importance", config_path=CONFIG, workdir=workdir, **layout)
    for report in reports:
        assert report["axes"] == ALL_AXES
        assert report["tokens"] == info["tokens"]  # each token counted once (CP: per chunk)
        assert "mamba_out" in report["max_rel_diff"]
        assert {"embedding_in", "attention_heads_out", "mamba_weight", "experts_weight"} <= set(
            report["max_rel_diff"]
        )
        for axis, diff in report["max_rel_diff"].items():
            assert diff < 1e-5, (axis, diff, layout)
        assert all(report["rankings_agree"].values()), report["rankings_agree"]


REORDER = "tests.support.reorder_cases"


@pytest.mark.integration
@pytest.mark.parametrize(
    "world,layout",
    [
        (1, {}),
        (2, {"tp": 2, "sequence_parallel": True}),
        (2, {"pp": 2}),
        (2, {"ep": 2}),
    ],
    ids=["tp1", "tp2-sp", "pp2", "ep2"],
)
def test_reorder_preserves_logits(reference, world, layout, rank_pools):
    workdir, _ = reference
    reports = rank_pools.get(world).run(
        f"{REORDER}:logits_preserved", config_path=CONFIG, workdir=workdir, **layout
    )
    assert any(r["max_abs_diff"] is not None for r in reports)
    for r in reports:
        assert r["params_moved"] >= r["num_params"] // 2, r  # the reorder really moved weights
        if r["max_abs_diff"] is not None:
            assert r["max_abs_diff"] <= 1e-5 * max(1.0, r["logit_scale"]), r


@pytest.mark.integration
def test_reorder_is_layout_independent(reference, rank_pools):
    """Reorder under TP=2 x EP=2 (4 ranks), save: the same checkpoint as reordering on one rank."""
    workdir, _ = reference
    pool = rank_pools.get(1)
    pool.run(
        f"{REORDER}:reorder_and_save", config_path=CONFIG, workdir=workdir, name="reordered_tp1"
    )
    pool = rank_pools.get(4)
    reports = pool.run(
        f"{REORDER}:reorder_and_save",
        config_path=CONFIG,
        workdir=workdir,
        name="reordered_tp2ep2",
        tp=2,
        ep=2,
        sequence_parallel=True,
    )
    assert all(r["strided_prefix_ok"] for r in reports), reports
    pool = rank_pools.get(1)
    (cmp,) = pool.run(
        f"{REORDER}:compare_saved",
        config_path=CONFIG,
        workdir=workdir,
        first="reordered_tp1",
        second="reordered_tp2ep2",
    )
    assert cmp["num_params"] > 20
    assert cmp["mismatched"] == [], cmp["mismatched"]


def test_collection_resumes_after_interruption(reference, rank_pools):
    workdir, _ = reference
    pool = rank_pools.get(1)
    (r,) = pool.run(f"{CASES}:resume_after_interruption", config_path=CONFIG, workdir=workdir)
    assert r["interrupted"] and r["partial_files"] == ["partial_rank00000.safetensors"]
    assert r["equal"] and r["tokens"][0] == r["tokens"][1]
    assert r["left_after"] == [] and r["hooks_left"] == 0


def test_bad_axes_and_short_calibration_are_rejected(rank_pools):
    pool = rank_pools.get(1)
    (messages,) = pool.run(f"{CASES}:bad_axis_errors", config_path=CONFIG)
    assert "'experts' is not in this model" in messages[0]
    assert "'bogus' is unknown" in messages[1]
    assert "ran out after 4 samples; asked for 8" in messages[2]


def test_check_calibration_messages():
    from elastic_plugin.importance import CalibrationError, check_calibration

    assert check_calibration(100, 64, 8) == 8
    with pytest.raises(CalibrationError, match="empty"):
        check_calibration(0, 8, 8)
    with pytest.raises(CalibrationError, match="has 10 samples, fewer than num_samples=16"):
        check_calibration(10, 16, 8)
    with pytest.raises(CalibrationError, match="multiple of micro_batch_size"):
        check_calibration(None, 10, 4)


@pytest.mark.integration
def test_depth_scores_match_formula_and_layouts(reference, rank_pools):
    workdir, _ = reference
    pool = rank_pools.get(1)
    (single,) = pool.run(f"{CASES}:depth_check", config_path=CONFIG, workdir=workdir)
    scores = single["scores"]
    assert sorted(scores) == list(range(1, 9)) and min(scores.values()) > 0
    assert scores[3] == pytest.approx(single["direct_layer3"], rel=1e-6)
    pool = rank_pools.get(2)
    for layout in ({"pp": 2}, {"tp": 2, "sequence_parallel": True}):
        for r in pool.run(f"{CASES}:depth_check", config_path=CONFIG, workdir=workdir, **layout):
            assert r["scores"] == pytest.approx(scores, rel=1e-4), layout


def test_prune_masks_are_exact_and_effective(reference, rank_pools):
    workdir, _ = reference
    pool = rank_pools.get(1)
    (r,) = pool.run(f"{CASES}:prune_masks", config_path=CONFIG, workdir=workdir)
    assert all(v < 1e-6 for v in r["identity"].values()), r["identity"]
    assert all(v > 1e-4 for v in r["changed"].values()), r["changed"]
    assert r["ffn_mask_vs_slice"] < 1e-5


def test_alternative_statistics_match_formulas(reference, rank_pools):
    """Each statistic ``--method`` can select, against its formula computed in the case from
    captured activations and the real projection modules."""
    workdir, _ = reference
    (r,) = rank_pools.get(1).run(f"{CASES}:variant_statistics", config_path=CONFIG, workdir=workdir)
    weights = ["embedding_weight", "ffn_weight", "shared_ffn_weight", "attention_heads_weight"]
    assert r["variants"] == sorted(
        ["embedding_in", "embedding_sq", "ffn_sq", "shared_ffn_sq"]
        + ["attention_heads_out", "mamba_heads_out"]
        + weights
        + ["mamba_weight", "experts_weight"]
    )
    kinds = {key.split("/")[0] for key in r["rel_diff"]}
    assert kinds == set(r["variants"]), kinds
    for key, diff in r["rel_diff"].items():
        assert diff < 1e-5, (key, diff)


def test_ablation_compares_every_order_and_holds_the_pruning(reference, rank_pools):
    workdir, _ = reference
    (r,) = rank_pools.get(1).run(f"{CASES}:ablation_smoke", config_path=CONFIG, workdir=workdir)
    ffn = r["results"]["ffn"]["methods"]
    assert set(ffn) == {"abs", "l2", "magnitude", "random"}
    assert r["results"]["ffn"]["overlap"]["abs"] == 1.0

    assert ffn["random"]["zero_shot"]["n"] == 2 and ffn["random"]["zero_shot"]["std"] > 0
    for entry in ffn.values():  # recovery trained: the loss moved from the zero-shot one
        assert entry["recovered"]["mean"] != entry["zero_shot"]["mean"]
    assert set(r["results"]["experts"]["methods"]) == {
        "reap",
        "reap_sum",
        "frequency",
        "magnitude",
        "random",
    }
    assert r["restored"] and r["dropped_still_zero"] and r["kept_moved"] > 0


def test_method_flag_parsing():
    from elastic_plugin.importance.methods import DEFAULTS, PUBLISHED, STATISTICS, parse_methods

    assert parse_methods(["embedding=residual_l2", "experts=frequency"]) == {
        "embedding": "residual_l2",
        "experts": "frequency",
    }
    assert all(PUBLISHED[a] in STATISTICS[a] and DEFAULTS[a] in STATISTICS[a] for a in STATISTICS)
    with pytest.raises(
        ValueError, match="experts statistics are reap, reap_sum, frequency, magnitude"
    ):
        parse_methods(["experts=bogus"])
    with pytest.raises(ValueError, match="expected AXIS=STATISTIC"):
        parse_methods(["ffn"])


def test_random_order_is_a_seeded_baseline_for_every_axis():
    """``--method AXIS=random``: scores shaped like the published statistic's, the same in every
    call (seeded by axis and layer), different across layers, accepted for every axis."""
    import torch

    from elastic_plugin.importance import ImportanceScores
    from elastic_plugin.importance.methods import STATISTICS, axis_scores, parse_methods

    assert parse_methods([f"{a}=random" for a in STATISTICS]) == dict.fromkeys(STATISTICS, "random")
    scores = ImportanceScores(ffn={0: torch.arange(8.0), 3: torch.arange(8.0)})
    first, again = axis_scores(scores, "ffn", "random"), axis_scores(scores, "ffn", "random")
    assert set(first) == {0, 3} and first[0].shape == (8,)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first[0], first[3])
    with pytest.raises(ValueError, match="ffn=bogus is not a statistic; allowed: .*ffn=random"):
        axis_scores(scores, "ffn", "bogus")


def test_old_scores_files_fall_back_to_the_published_statistic():
    import torch

    from elastic_plugin.importance import ImportanceScores
    from elastic_plugin.importance.methods import DEFAULTS, PUBLISHED, resolve_methods

    old = ImportanceScores(embedding=torch.tensor([3.0, 1.0, 2.0]))  # no variants recorded
    assert DEFAULTS["embedding"] != PUBLISHED["embedding"]
    with pytest.warns(UserWarning, match="no 'embedding_weight' statistic"):
        chosen = resolve_methods(old, None)
    assert chosen["embedding"] == PUBLISHED["embedding"]
    with pytest.raises(ValueError, match="collect the scores again"):
        from elastic_plugin.importance.reorder import Permutations

        Permutations.from_scores(old, 1, 1, methods={"embedding": "residual_l2"})


def test_kept_overlap_counts_heads_per_group():
    import torch

    from elastic_plugin.importance.ablation import kept_overlap

    a = {1: torch.tensor([1, 0, 2, 3])}  # 2 groups of 2 heads: keeps 1 and 2
    b = {1: torch.tensor([0, 1, 2, 3])}  # keeps 0 and 2
    assert kept_overlap(a, b, 0.5, groups=2) == 0.5
    assert kept_overlap(a, b, 0.5) == 1.0  # ungrouped: the first half {0, 1} of both


def test_package_names_resolve_lazily():
    """``elastic_plugin.importance`` resolves its names on first use (so parsing the CLI imports
    no torch through it): every exported name resolves, and no other does."""
    import elastic_plugin.importance as importance

    assert sorted(importance.__all__) == sorted(importance._EXPORTS)
    for name in importance.__all__:
        assert getattr(importance, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        importance.nope  # noqa: B018
