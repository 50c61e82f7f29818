"""Elastic training steps under TP (+SP), PP, EP and DP reproduce one rank: the same budgets and
router choices per micro-batch, the same per-budget losses over several optimizer steps, and the
same gradients (model and router) — from one checkpoint resharded by Megatron."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml")
CASES = "tests.support.elastic_cases"
NO_MOE_PATTERN = "M*-M*-"
LOSS_RTOL = 1e-4
GRAD_ATOL = 2e-6
# FP8: an fp32 last-bit difference (TP's summation order) can flip one rounding to the next E4M3
# value; three Adam steps grow that to 3e-4 (measured, row scaling, seed 1234; 2e-6 at seed 99)
FP8_LOSS_RTOL = 1e-3


@pytest.fixture(scope="module")
def references(rank_pools, tmp_path_factory):
    made: dict[tuple, str] = {}

    def get(pattern=None, mode="sliced", heterogeneous=False, fp8_gemm="off") -> str:
        key = (pattern, mode, heterogeneous, fp8_gemm)
        if key not in made:
            work = tmp_path_factory.mktemp("elastic_ref")
            (info,) = rank_pools.get(1).run(
                f"{CASES}:make_elastic_reference",
                config_path=CONFIG,
                workdir=str(work),
                pattern=pattern,
                mode=mode,
                heterogeneous=heterogeneous,
                fp8_gemm=fp8_gemm,
            )
            assert len(info["losses"]) == 3 and info["trace"]
            made[key] = str(work)
        return made[key]

    return get


def _check(
    rank_pools,
    references,
    world: int,
    pattern=None,
    mode="sliced",
    heterogeneous=False,
    fp8_gemm="off",
    loss_rtol=LOSS_RTOL,
    **layout,
):
    work = references(pattern, mode, heterogeneous, fp8_gemm)
    results = rank_pools.get(world).run(
        f"{CASES}:check_elastic",
        config_path=CONFIG,
        workdir=work,
        pattern=pattern,
        mode=mode,
        heterogeneous=heterogeneous,
        fp8_gemm=fp8_gemm,
        **layout,
    )
    ref_trace = {(it, mb): (b, c) for it, mb, b, c in results[0]["ref_trace"]}
    for r in results:
        # every rank routed its micro-batches exactly as the single rank did
        assert r["trace"], r
        for it, mb, budget, choice in r["trace"]:
            assert ref_trace[(it, mb)] == (budget, choice), (r["rank"], it, mb)
        assert len(r["losses"]) == len(r["ref_losses"])
        for got, ref in zip(r["losses"], r["ref_losses"]):
            assert set(got) == set(ref)
            for budget, value in ref.items():
                assert got[budget] == pytest.approx(value, rel=loss_rtol), (r["rank"], got, ref)
        assert r["grad_max_abs"] > 1e-4, r
        assert r["grad_max_abs_diff"] <= GRAD_ATOL, r
        assert r["num_router_params"] > 0
        assert r["router_grad_max_abs"] > 0, "the router got no gradient"
        assert r["router_grad_max_abs_diff"] <= GRAD_ATOL * max(1.0, r["router_grad_max_abs"]), r
    # all ranks of the replica saw the same budgets: traces of one DP rank agree
    return results


# The layouts, as a table of layout x feature (the way torchtitan's integration tests list their
# overrides): name -> (ranks, feature overrides, layout overrides). Each row trains three
# optimizer steps from the same checkpoint and must reproduce one rank (``_check``).
LAYOUT_SCENARIOS: dict[str, tuple[int, dict, dict]] = {
    "tp2_sp": (2, {}, dict(tp=2, sequence_parallel=True)),
    "pp2": (2, {}, dict(pp=2)),
    "ep2": (2, {}, dict(ep=2)),
    "dp2_distributed_optimizer": (2, {}, dict(distributed_optimizer=True)),
    "tp2_masked_no_moe": (2, dict(pattern=NO_MOE_PATTERN, mode="masked"), dict(tp=2)),
    "tp2_pp2_sp_heterogeneous": (
        4,
        dict(heterogeneous=True),
        dict(tp=2, pp=2, ep=1, sequence_parallel=True),
    ),
}


@pytest.mark.parametrize("scenario", list(LAYOUT_SCENARIOS))
def test_layout_reproduces_one_rank(rank_pools, references, scenario):
    ranks, feature, layout = LAYOUT_SCENARIOS[scenario]
    _check(rank_pools, references, ranks, **feature, **layout)


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_fp8_gemm_tensor_parallel_sequence_parallel(rank_pools, references, scaling):
    """elastic.fp8_gemm under TP=2 + SP: the amax of every operand sharded along the contraction
    dim is reduced over TP, so two ranks quantize exactly as one does (same losses, gradients,
    router choices); and FP8 really ran: the losses differ from the model-dtype reference."""
    results = _check(
        rank_pools,
        references,
        2,
        fp8_gemm=scaling,
        loss_rtol=FP8_LOSS_RTOL,
        tp=2,
        sequence_parallel=True,
    )
    from tests.support.elastic_cases import reference_losses

    plain = reference_losses(references())
    first = {b: v for r in results for b, v in r["losses"][0].items()}
    fp8_first, plain_first = results[0]["ref_losses"][0], plain[0]
    for budget, value in fp8_first.items():
        # before any optimizer step nothing amplifies a flip: two ranks == one rank closely ...
        assert first[budget] == pytest.approx(value, rel=1e-5)
        # ... while FP8 moved the loss 100x further from the model-dtype one (measured 1.6e-3)
        assert abs(value / plain_first[budget] - 1) > 1e-4, (fp8_first, plain_first)


def _assert_same_trace(result):
    assert result["iterations"] == (3, 6)
    full, resumed = result["full"], result["resumed"]
    assert [it for it, _ in full] == list(range(1, 7)) == [it for it, _ in resumed]
    for (_, a), (_, b) in zip(full, resumed):
        assert set(a) == set(b)
        for budget in a:
            assert b[budget] == pytest.approx(a[budget], rel=1e-6, abs=1e-7), (full, resumed)
    for budget, value in result["full_valid"].items():
        assert result["resumed_valid"][budget] == pytest.approx(value, rel=1e-6)
    assert result["choices_full"] == result["choices_resumed"]


def test_stop_and_resume_reproduces_the_loss_trace(rank_pools, tmp_path):
    (result,) = rank_pools.get(1).run(
        f"{CASES}:train_and_resume", config_path=CONFIG, workdir=str(tmp_path)
    )
    _assert_same_trace(result)


def test_preempted_by_sigterm_under_pipeline_parallel_resumes_the_loss_trace(rank_pools, tmp_path):
    """Stop and resume under PP=2, the stop being a preemption: SIGTERM reaches rank 0 (the
    first stage) mid-iteration 3; both stages finish the step, learn of it at the step
    boundary, save iteration 3 and stop; the resumed run reproduces the uninterrupted loss
    trace on both stages. (``--stop-after``'s stop: the test above, and test_elastic_cli.)"""
    results = rank_pools.get(2).run(
        f"{CASES}:train_and_resume", config_path=CONFIG, workdir=str(tmp_path), pp=2, preempt=True
    )
    for result in results:
        assert result["preempted_by"] == "SIGTERM"
        assert result["iterations"] == (3, 6)
        _assert_same_trace(result)


def test_resume_skips_a_damaged_newest_save_and_reproduces_the_trace(rank_pools, tmp_path):
    """History (checkpoint.history): saves every iteration keeping 2, so the stop at 3 leaves
    iter_0000002 and iter_0000003 with the pointer on 3. Flipped bytes in iter_0000003: --resume
    says it skipped it and why, continues from iter_0000002, and the loss trace still equals
    the uninterrupted run; the history then holds the newest 2 again."""
    (result,) = rank_pools.get(1).run(
        f"{CASES}:train_and_resume",
        config_path=CONFIG,
        workdir=str(tmp_path),
        iters=6,
        stop=3,
        damage_newest=True,
    )
    assert result["saves_after_stop"] == ["iter_0000003", "iter_0000002"]
    assert result["latest_after_stop"] == "3"
    printed = result["resume_printed"]
    assert "resume: skipped iter_0000003: checkpoint" in printed, printed
    assert "differs from what was saved" in printed and "continuing from iter_0000002" in printed
    _assert_same_trace(result)
    assert result["saves_after_resume"] == ["iter_0000006", "iter_0000005"]
    assert result["latest_after_resume"] == "6"


def test_fp8_training_with_loss_selected_freeze_resumes_exactly(rank_pools, tmp_path):
    """elastic.fp8_gemm=row through train_elastic: FP8 training steps, FP8 validation and the
    loss-selected freeze measured in FP8; stop + resume reproduces the uninterrupted run, and
    the checkpoint records the precision."""
    (result,) = rank_pools.get(1).run(
        f"{CASES}:train_and_resume",
        config_path=CONFIG,
        workdir=str(tmp_path),
        iters=6,
        stop=3,
        freeze_after=2,
        freeze_select="loss",
        freeze_candidates=2,
        fp8_gemm="row",
    )
    _assert_same_trace(result)
    assert result["fp8_gemm_meta"] == "row"
    assert set(result["freeze_search"]) == {"1", "0.77", "0.4"}


def test_frozen_router_fixes_the_choices_and_survives_resume(rank_pools, tmp_path):
    """router.freeze_after=2: from iteration 3 on, every budget keeps the choice the router made
    then (the table no longer moves), the checkpoint records
    it, and stop-at-3 + resume reproduces the uninterrupted run."""
    (result,) = rank_pools.get(1).run(
        f"{CASES}:train_and_resume",
        config_path=CONFIG,
        workdir=str(tmp_path),
        iters=6,
        stop=3,
        freeze_after=2,
    )
    _assert_same_trace(result)
    per_iteration = dict(result["choices_per_iteration"])
    assert all(per_iteration[i] == per_iteration[3] for i in range(3, 7))
    assert result["frozen_meta"] == per_iteration[3] == result["choices_full"]


def test_loss_selected_freeze_under_pipeline_parallel(rank_pools, tmp_path):
    """router.freeze_select=loss on PP=2: both stages measure the router's 4 most likely
    feasible choices per budget on validation data, keep the same lowest-loss one (never worse
    than the router's own pick), record the search in the checkpoint, and stop-at-3 + resume
    reproduces the uninterrupted run (the table is restored, not searched again)."""
    results = rank_pools.get(2).run(
        f"{CASES}:train_and_resume",
        config_path=CONFIG,
        workdir=str(tmp_path),
        iters=6,
        stop=3,
        pp=2,
        freeze_after=2,
        freeze_select="loss",
        freeze_candidates=4,
    )
    assert results[0]["choices_full"] == results[1]["choices_full"]
    for result in results:
        _assert_same_trace(result)
        per_iteration = dict(result["choices_per_iteration"])
        assert all(per_iteration[i] == per_iteration[3] for i in range(3, 7))
        assert result["frozen_meta"] == per_iteration[3] == result["choices_full"]
        search = result["freeze_search"]
        assert search == result["freeze_search_resumed"]
        assert set(search) == {"1", "0.77", "0.4"}
        for label, record in search.items():
            assert 1 <= record["candidates"] <= 4
            assert record["loss"] <= record["router_choice_loss"]
            assert abs(record["cost_fraction"] / float(label) - 1) <= 0.05


def test_every_rank_routes_identically_over_many_steps(rank_pools, tmp_path):
    """TP=2 x PP=2, heterogeneous (per-layer) router: 50 iterations x 2 micro-batches, the same
    budget and the same per-layer choice on all four ranks, and budgets actually vary."""
    results = rank_pools.get(4).run(
        f"{CASES}:route_trace",
        config_path=CONFIG,
        workdir=str(tmp_path),
        iters=50,
        tp=2,
        pp=2,
        sequence_parallel=True,
    )
    assert sorted((pp, tp) for pp, tp, _ in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    traces = [trace for _, _, trace in results]
    assert len(traces[0]) == 100
    for trace in traces[1:]:
        assert trace == traces[0]
    assert len({budget for _, _, budget, _ in traces[0]}) == 3


def test_self_teacher_and_router_lr_group(rank_pools, tmp_path):
    (result,) = rank_pools.get(1).run(
        f"{CASES}:self_teacher_and_param_groups", config_path=CONFIG, workdir=str(tmp_path)
    )
    assert result["kd_first"] == pytest.approx(0.0, abs=1e-6)  # full choice vs itself
    assert result["kd_second"] > 1e-4  # a drawn (smaller) choice
    router = [g for g in result["groups"] if g["router"]]
    others = [g for g in result["groups"] if not g["router"]]
    assert router and others
    assert all(g["max_lr"] == pytest.approx(1e-2) for g in router)  # 1e-3 x lr_mult 10
    assert all(g["max_lr"] in (None, pytest.approx(1e-3)) for g in others)


def test_no_save_optim_saves_the_model_alone_and_refuses_a_resume(rank_pools, tmp_path):
    (result,) = rank_pools.get(1).run(
        f"{CASES}:save_without_optimizer", config_path=CONFIG, workdir=str(tmp_path)
    )
    assert result["with"]["optimizer_saved"] is None  # the default save: resumable
    assert result["without"]["optimizer_saved"] is False
    # Adam's two moments and the FP32 main weights are most of a save's bytes
    assert result["without"]["bytes"] < 0.6 * result["with"]["bytes"], result
    assert "--no-save-optim" in result["resume_error"] and "--ckpt" in result["resume_error"]
