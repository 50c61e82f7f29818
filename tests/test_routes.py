"""The routes of ``make demo-real`` at equal cost (``demo_real.routes``, ``demo_real.minitron``):
FLOPs recomputed from logged steps and the architecture, Minitron's candidates at each size,
its pick, and ``route.json``. Unit tier: arithmetic on configs and hand-written metrics files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_plugin.models.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
SMOLLM2 = CONFIGS / "smollm2_elastic.yaml"
LLAMA = CONFIGS / "tiny_llama.yaml"


def _parent():
    return load_config(SMOLLM2).model


def _depth_scores(model):
    """Layer scores with blocks 3, 7, 11, 15, 19, 23 the least important (and a spread)."""
    low = {3, 7, 11, 15, 19, 23}
    return {n: (0.001 if (n - 1) // 2 in low else 0.1 + 0.001 * n) for n in range(1, 61)}


# ------------------------------------------------------------------------------ candidates
@pytest.mark.parametrize("budget", [0.7, 0.5])
def test_candidates_sit_at_the_budget_and_span_the_axes(budget):
    from elastic_plugin.demo_real.minitron import MIN_CANDIDATES, TOLERANCE, candidates
    from elastic_plugin.models.axes import model_for_choice
    from elastic_plugin.models.counting import count_parameters
    from elastic_plugin.nested.depth import depth_pruned_config

    parent = _parent()
    whole = count_parameters(parent).total
    target = int(budget * whole)
    found = candidates(parent, budget, _depth_scores(parent))
    assert len(found) >= MIN_CANDIDATES
    mixes = set()
    for cand in found:
        source = depth_pruned_config(parent, cand.dropped_layers)
        counted = count_parameters(model_for_choice(source, cand.choice)).total
        assert counted == cand.params
        assert 0 <= target - counted <= TOLERANCE * whole, cand.mix
        assert cand.source_fraction == pytest.approx(counted / count_parameters(source).total)
        cut = {axis for axis, size in cand.choice.items() if size < getattr_full(parent, axis)}
        mixes.add((frozenset(cut), bool(cand.dropped_layers)))
    assert len(mixes) >= MIN_CANDIDATES  # distinct axis mixes
    depth = [c for c in found if c.dropped_layers]
    assert depth and set(depth[0].dropped_layers) == {n for b in (3, 7, 11, 15, 19, 23)
                                                      for n in (2 * b + 1, 2 * b + 2)}  # fmt: skip
    assert depth[0].pattern == "*-" * 24


def getattr_full(model, axis):
    from elastic_plugin.models.axes import MODEL_FIELD

    return getattr(model, MODEL_FIELD[axis])


def test_candidates_refuse_what_they_cannot_do():
    from elastic_plugin.demo_real.minitron import MIXES, candidates

    parent = _parent()
    with pytest.raises(ConfigError, match="importance --depth"):
        candidates(parent, 0.7, None)
    with pytest.raises(ConfigError, match="allowed 0 < budget < 1"):
        candidates(parent, 1.0, _depth_scores(parent))
    with pytest.raises(ConfigError, match="at least 4"):
        candidates(parent, 0.7, _depth_scores(parent), {k: MIXES[k] for k in ("ffn", "depth+ffn")})
    with pytest.raises(ConfigError, match="mix 'x'"):
        candidates(parent, 0.7, _depth_scores(parent), {"x": {"experts": 0.5}})


def test_search_picks_the_lowest_validation_loss():
    from elastic_plugin.demo_real.minitron import pick_best

    assert pick_best({"ffn": 2.1, "heads+ffn": 1.9, "hidden+ffn": None, "depth+ffn": 2.5}) == (
        "heads+ffn"
    )
    assert pick_best({"a": 1.0, "b": 1.0}) == "a"
    with pytest.raises(RuntimeError, match="no usable"):
        pick_best({"a": None})
    with pytest.raises(RuntimeError, match="no usable"):
        pick_best({"a": float("nan"), "b": 1.0})


def test_split_budget_is_the_elastic_total_less_importance():
    from elastic_plugin.demo_real.minitron import split_budget

    per_size, search = split_budget(1000.0, 100.0, 2, search_share=0.64)
    assert per_size == 450.0 and search == pytest.approx(288.0)
    with pytest.raises(ConfigError, match="nothing is left"):
        split_budget(100.0, 100.0, 2)
    with pytest.raises(ConfigError, match="search_share"):
        split_budget(100.0, 1.0, 2, search_share=1.0)


# ------------------------------------------------------------------------------ FLOPs
def _record(iteration, tokens, seconds=2.0, tflop=1.0, **extra):
    rate = {"tokens_per_s": tokens / seconds, "seconds": seconds, "model_tflops": tflop}
    return {"iteration": iteration, "throughput": rate, **extra}


def _write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_run_cost_recomputes_from_logged_iterations_and_the_architecture(tmp_path):
    from elastic_plugin.demo_real.routes import run_cost
    from elastic_plugin.models.flops import forward_flops

    model = load_config(LLAMA).model
    seq, gbs = 32, 4
    choice = {"embedding": 96, "ffn": 128, "attention_heads": 2}
    metrics = _write(
        tmp_path / "m.jsonl",
        [_record(3, 3 * gbs * seq), {"iteration": 3, "valid_loss": {"0.5": 1.0}},
         _record(5, 2 * gbs * seq)],
    )  # fmt: skip
    cost = run_cost("x", metrics, model, choice, model, seq, gbs)
    per_iter = (
        3 * forward_flops(model, seq, gbs, choice).total + forward_flops(model, seq, gbs).total
    )
    assert cost.detail["iters"] == 5 and cost.tokens == 5 * gbs * seq
    assert cost.flops == 5 * per_iter
    assert cost.detail["logged_flops"] == 2e12
    with pytest.raises(ConfigError, match="not the run's"):
        run_cost("x", metrics, model, choice, model, seq, 2 * gbs)
    with pytest.raises(ConfigError, match="no metrics file"):
        run_cost("x", tmp_path / "none.jsonl", model, choice, model, seq, gbs)


def test_depth_pruned_student_is_counted_with_the_parent_as_teacher(tmp_path):
    from elastic_plugin.demo_real.routes import distil_iteration_flops
    from elastic_plugin.models.flops import forward_flops
    from elastic_plugin.nested.depth import depth_pruned_config

    parent = load_config(LLAMA).model
    student = depth_pruned_config(parent, [3, 4])
    flops = distil_iteration_flops(student, {"ffn": 64}, parent, 16, 2)
    assert flops == (
        3 * forward_flops(student, 16, 2, {"ffn": 64}).total + forward_flops(parent, 16, 2).total
    )


def _elastic_checkpoint(tmp_path: Path, probs, frozen: bool) -> Path:
    from elastic_plugin.checkpoint.meta import CHECKPOINT_META, DIST_METADATA

    cfg = load_config(LLAMA)
    small = {"embedding": 64, "ffn": 128, "attention_heads": 2}
    full = {"embedding": 128, "ffn": 256, "attention_heads": 4}
    config = cfg.to_dict() | {
        "training": {**cfg.to_dict()["training"], "seed": 5, "train_iters": 6},
        "elastic": {
            "budgets": [1.0, 0.5],
            "sizes": {"embedding": [1.0, 0.5], "ffn": [1.0, 0.5], "attention_heads": [1.0, 0.5]},
            "router": {"freeze_after": 2},
            "curriculum": [{"iters": 6, "budget_probs": probs}],
        },
    }
    elastic = {
        "budgets": [1.0, 0.5],
        "choices": {"1": full, "0.5": small},
        "cost_fraction": {"1": 1.0, "0.5": 0.4},
        **({"frozen_choices": {"1": full, "0.5": small}} if frozen else {}),
        "freeze_search": {"0.5": {"candidates": 3}, "1": {"candidates": 1}},
    }
    ckpt = tmp_path / "elastic"
    ckpt.mkdir(parents=True)
    (ckpt / DIST_METADATA).write_text("{}")
    meta = {"kind": "elastic", "iteration": 6, "config": config, "elastic": elastic}
    (ckpt / CHECKPOINT_META).write_text(json.dumps(meta))
    return ckpt


def test_elastic_run_cost_replays_the_drawn_budgets(tmp_path):
    from elastic_plugin.demo_real.routes import elastic_run_cost
    from elastic_plugin.models.flops import forward_flops, training_flops

    parent = load_config(LLAMA).model
    batch = {"seq_length": 16, "micro_batch_size": 2, "global_batch_size": 4, "eval_iters": 2}
    ckpt = _elastic_checkpoint(tmp_path, [0.0, 1.0], frozen=True)  # every draw is 0.5
    small = {"embedding": 64, "ffn": 128, "attention_heads": 2}
    choices = {"0.5": {"embedding": 128, "ffn": 256, "attention_heads": 4}}  # before the freeze
    metrics = _write(
        tmp_path / "m.jsonl",
        [_record(2, 2 * 4 * 16, choices=choices), _record(6, 4 * 4 * 16, choices={"0.5": small})],
    )
    train, search = elastic_run_cost(ckpt, metrics, parent, batch)
    teacher = forward_flops(parent, 16, 2).total
    before = training_flops(parent, 16, 2, choices["0.5"]).total + teacher
    after = training_flops(parent, 16, 2, small).total + teacher
    assert train.tokens == 6 * 4 * 16
    assert train.flops == 2 * 2 * before + 4 * 2 * after  # 2 micro-batches per iteration
    assert train.detail["micro_batches_before_freeze_approximated"] == 4
    # the freeze search: 3 candidates at 0.5 and 1 at the full budget, 2 x 2 sequences each
    assert search.kind == "search"
    assert (
        search.flops
        == 3 * forward_flops(parent, 16, 4, small).total + forward_flops(parent, 16, 4).total
    )
    ckpt_full = _elastic_checkpoint(tmp_path / "f", [1.0, 0.0], frozen=True)  # every draw is 1.0
    full, _ = elastic_run_cost(ckpt_full, metrics, parent, batch)
    assert full.flops == 6 * 2 * (training_flops(parent, 16, 2).total + teacher)


# ------------------------------------------------------------------------------ route.json
def test_route_json_is_written_complete(tmp_path, capsys):
    from elastic_plugin.demo_real.routes import ROUTE_FILE, Cost, RouteSize, write_route

    costs = [
        Cost("importance statistics", "importance", 100, 1e9),
        Cost("0.7 ffn search", "search", 1000, 4e12, {"iters": 2}),
        Cost("0.7 ffn final", "train", 3000, 9e12),
    ]
    sizes = [
        RouteSize("0.7", {"winner": "ffn"}, "ckpt", "hf", 4000, 1.3e13),
        RouteSize("1", {}, None, None),
    ]
    written = write_route(tmp_path, "minitron", sizes, costs, search_share=0.64)
    on_disk = json.loads((tmp_path / ROUTE_FILE).read_text())
    assert on_disk == written
    assert on_disk["total_flops"] == pytest.approx(1e9 + 4e12 + 9e12)
    assert on_disk["total_tokens"] == 4100
    assert on_disk["flops_by_kind"] == {"importance": 1e9, "search": 4e12, "train": 9e12}
    assert set(on_disk["sizes"]) == {"0.7", "1"}
    assert on_disk["sizes"]["0.7"]["architecture"] == {"winner": "ffn"}
    assert {"tokens", "flops", "hf_dir", "checkpoint"} <= set(on_disk["sizes"]["0.7"])
    assert len(on_disk["costs"]) == 3 and on_disk["search_share"] == 0.64
    assert "minitron: 0.013 PFLOP" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="route 'other'"):
        write_route(tmp_path, "other", sizes, costs)
    with pytest.raises(ConfigError, match="kind must be"):
        write_route(tmp_path, "alone", sizes, [Cost("x", "eval", 1, 1.0)])
