"""``elastic-plugin compare``: the token arithmetic (the elastic run's tokens under its
curriculum, the equal-cost split), the per-route configs (one fixed architecture that
``elastic-train`` accepts and reaches exactly; a from-scratch model of that architecture), bad
flags refused naming the flag before any work, and a real 2-budget tiny run end to end (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastic_plugin.comparison.plan import (
    elastic_tokens,
    iters_for_tokens,
    plan_runs,
    route_tokens,
)
from elastic_plugin.models.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY_ELASTIC = ROOT / "examples" / "configs" / "tiny_elastic.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def test_elastic_tokens_follow_the_curriculum_and_the_equal_cost_split():
    config = yaml.safe_load(TINY_ELASTIC.read_text())
    # the demo: 600 iterations at 64 tokens, then 900 at the run's 128, batch 16
    assert elastic_tokens(config, 1500) == 600 * 16 * 64 + 900 * 16 * 128
    assert elastic_tokens(config, 100) == 100 * 16 * 64  # stopped inside stage 1
    assert elastic_tokens(config, 1600) == 600 * 16 * 64 + 1000 * 16 * 128  # past the last
    config["elastic"]["curriculum"] = [{"iters": 10, "seq_length": 32}]
    assert elastic_tokens(config, 12) == 12 * 16 * 32  # the last stage continues
    total = 2_457_600
    assert route_tokens("equal_cost", total, 2) == total // 2
    assert route_tokens("equal_tokens", total, 2) == total
    assert route_tokens("equal_cost", total, 2, scale=0.1) == total // 20
    assert iters_for_tokens(total // 2, 16, 128) == 600
    with pytest.raises(ConfigError, match="--token-budgets.*allowed: equal_cost, equal_tokens"):
        route_tokens("equal", total, 2)
    runs = plan_runs(
        ["0.77", "0.4"],
        ["elastic", "prune_distil", "scratch", "zero_shot"],
        ["equal_cost", "equal_tokens"],
        [1, 2, 3],
        total,
        2,
        16,
        128,
    )
    trained = [r for r in runs if r.token_budget]
    assert len(runs) == 2 * 2 + 2 * 2 * 2 * 3 and len(trained) == 24
    assert len({r.name for r in runs}) == len(runs)
    # untrained routes first, then every equal-cost model before the first equal-tokens one
    assert [r.token_budget for r in runs[:4]] == [None] * 4
    assert {r.iters for r in trained if r.token_budget == "equal_cost"} == {600}
    assert {r.tokens for r in trained if r.token_budget == "equal_tokens"} == {1200 * 16 * 128}
    first_equal_tokens = next(i for i, r in enumerate(runs) if r.token_budget == "equal_tokens")
    assert all(r.token_budget != "equal_cost" for r in runs[first_equal_tokens:])


def test_route_configs_are_one_fixed_architecture_elastic_train_accepts():
    """The prune+distil config resolves to one candidate per axis, its budget is reached
    exactly (budget loss 0), nothing is frozen or scheduled; the scratch config is the plain
    model of the same choice."""
    from elastic_plugin.comparison.configs import distil_config, scratch_config
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.cost import ElasticCost
    from elastic_plugin.models.axes import model_for_choice
    from elastic_plugin.models.config import config_from_dict
    from elastic_plugin.models.counting import count_parameters

    config = yaml.safe_load(TINY_ELASTIC.read_text())
    cfg = config_from_dict(config)
    ecfg = ElasticConfig.from_dict(config["elastic"])
    resolved = ecfg.resolve(cfg.model)
    choice = resolved.smallest_choice()
    fraction = (
        ElasticCost(cfg.model, resolved).of_choice(choice) / ElasticCost(cfg.model, resolved).full
    )
    out = distil_config(config, choice, fraction, seed=7, iters=30)
    one = ElasticConfig.from_dict(out["elastic"])
    r1 = one.resolve(config_from_dict(out).model)  # raises if the budget is not reachable
    assert r1.budgets == (fraction,) and r1.smallest_choice() == choice == r1.largest_choice()
    assert one.curriculum == () and one.router.freeze_after is None
    assert ElasticCost(cfg.model, r1).of_choice(choice) / ElasticCost(cfg.model, r1).full == (
        pytest.approx(fraction, rel=1e-12)
    )
    assert out["training"]["seed"] == 7 and out["training"]["train_iters"] == 30
    assert config["elastic"]["budgets"] == [1.0, 0.77, 0.4]  # the source is not changed
    scratch = scratch_config(config, choice, seed=2, iters=30)
    small = config_from_dict(scratch).model
    assert "elastic" not in scratch and small == model_for_choice(cfg.model, choice)
    assert small.hidden_size == choice["embedding"] and small.ffn_hidden_size == choice["ffn"]
    assert count_parameters(small).total < count_parameters(cfg.model).total / 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--seeds", "0"], "--seeds=0: must be an int >= 1"),
        (["--scale", "1.5"], "--scale=1.5: must be a fraction in (0, 1]"),
        (["--routes", "elastic,distil"], "--routes 'elastic,distil': 'distil' unknown; allowed"),
        (["--token-budgets", "all"], "--token-budgets 'all': 'all' unknown"),
        (
            ["--budgets", "0.5"],
            "--budgets '0.5': '0.5' unknown; allowed: a comma-separated list of 0.77, 0.4",
        ),
        (["--budgets", "1"], "--budgets '1': '1' unknown"),
        (["--num-problems", "-1"], "--num-problems=-1"),
        (["--reordered", "/nonexistent/ckpt"], "--reordered"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag_before_any_work(
    tmp_path, monkeypatch, capsys, flags, message
):
    import elastic_plugin.comparison.compare as compare
    from elastic_plugin.cli import main
    from tests.test_elastic_extract import _fake_ckpt

    def refuse(*_args, **_kwargs):
        raise AssertionError("bad input reached the work")

    monkeypatch.setattr(compare, "run_compare", refuse)
    data = tmp_path / "data"
    data.mkdir()
    for name in ("valid.idx", "train.idx", "heldout.jsonl"):
        (data / name).write_text("")
    ckpt = _fake_ckpt(
        tmp_path / "run" / "checkpoints" / "elastic",
        data={"data_path": str(data / "train"), "valid_data_path": str(data / "valid")},
    )
    _fake_ckpt(tmp_path / "run" / "checkpoints" / "reordered", kind="teacher")
    rc = main(["compare", "--ckpt", str(ckpt), "--out", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("elastic-plugin compare: error: "), err
    assert message in err, err
    assert not (tmp_path / "out").exists()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elastic_plugin.cli", *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env=ENV,
    )


@pytest.mark.integration
def test_compare_makes_every_route_of_a_two_budget_run_and_reports_it(tmp_path):
    """teacher -> importance -> reorder -> a 2-budget elastic run (tiny iteration counts), then
    ``compare`` with every route at the equal-cost budget, 2 seeds, half scale: a valid
    compare.json (every route measured at the 0.4 size, seed spread, costs against the elastic
    run), compare.md and the plot."""
    config = yaml.safe_load(TINY_ELASTIC.read_text())
    config["training"].update(
        seq_length=64,
        micro_batch_size=4,
        global_batch_size=4,
        train_iters=6,
        eval_iters=1,
        eval_interval=6,
        log_interval=2,
        lr_warmup_iters=1,
    )
    config["data"].update(num_train=400, num_valid=40)
    config["elastic"].update(
        budgets=[1.0, 0.4],
        curriculum=[{"iters": 4, "seq_length": 32}, {"iters": 4, "budget_probs": [0.5, 0.5]}],
    )
    config["elastic"]["router"].update(freeze_after=None, freeze_select="likelihood")
    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    for args in (
        ["train", "--config", str(cfg_path), "--out", str(run), "--no-progress"],
        ["importance", "--ckpt", str(ckpts / "teacher"), "--out", str(run / "scores.pt"),
         "--num-samples", "8", "--micro-batch-size", "4", "--no-progress"],
        ["reorder", "--ckpt", str(ckpts / "teacher"), "--scores", str(run / "scores.pt"),
         "--out", str(ckpts / "reordered")],
        ["elastic-train", "--ckpt", str(ckpts / "reordered"), "--config", str(cfg_path),
         "--out", str(run), "--train-iters", "8", "--eval-interval", "8", "--no-progress"],
    ):  # fmt: skip
        proc = _cli(*args)
        assert proc.returncode == 0, (args[0], proc.stderr[-3000:])
    out = tmp_path / "cmp"
    proc = _cli(
        "compare", "--ckpt", str(ckpts / "elastic"), "--out", str(out),
        "--token-budgets", "equal_cost", "--seeds", "2", "--scale", "0.5",
        "--num-problems", "4", "--batch-size", "4", "--eval-sequences", "4",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "compare.json").read_text())
    elastic_total = 4 * 4 * 32 + 4 * 4 * 64  # the curriculum's two stages
    assert report["elastic_run"]["tokens"] == elastic_total
    assert report["settings"]["num_sizes"] == 1
    assert report["settings"]["token_budgets"] == {"equal_cost": 3 * 4 * 64}  # 768 at 0.5x
    (size,) = report["sizes"]
    assert size["budget"] == "0.4"
    assert set(size["routes"]) == {
        "elastic",
        "zero_shot",
        "prune_distil/equal_cost",
        "scratch/equal_cost",
    }
    for key, route in size["routes"].items():
        assert 0.0 <= route["accuracy"]["mean"] <= 1.0, key
        assert 0.0 < route["valid_loss"]["mean"] < 20.0, key
    distil = size["routes"]["prune_distil/equal_cost"]
    assert distil["seeds"] == [1, 2] and len(distil["valid_loss"]["values"]) == 2
    assert distil["valid_loss"]["values"][0] != distil["valid_loss"]["values"][1]  # seeds differ
    # the same architecture everywhere: every model of the size has the same parameter count
    models = [m for m in report["models"] if m["label"] == "0.4"]
    assert len(models) == 2 + 2 * 2 and len({json.dumps(m["params"]) for m in models}) == 1
    # every model measured per problem and per window, so gaps get paired standard errors
    for m in models:
        assert len(m["correct"]) == 4 and len(m["window_losses"]) == 4
        assert m["valid_loss"] == pytest.approx(sum(m["window_losses"]) / 4, rel=1e-12)
        assert m["accuracy"] == sum(m["correct"]) / 4
    assert distil["vs_elastic"]["accuracy"]["items"] == 4
    assert distil["vs_elastic"]["valid_loss"]["se"] > 0
    # zero-shot is the teacher pruned: distilling it must lower the validation loss
    assert distil["valid_loss"]["mean"] < size["routes"]["zero_shot"]["valid_loss"]["mean"]
    cost = report["cost"]
    assert cost["prune_distil/equal_cost"]["tokens"] == 768
    assert cost["prune_distil/equal_cost"]["token_ratio"] == pytest.approx(768 / elastic_total)
    # FLOPs from the runs' metrics: a 0.4 model distilled on half the tokens costs less than
    # the elastic run (which also trained the full model); from scratch has no teacher passes
    assert 0 < cost["scratch/equal_cost"]["tflop"] < cost["prune_distil/equal_cost"]["tflop"]
    assert 0 < cost["prune_distil/equal_cost"]["flop_ratio"] < 1
    md = (out / "compare.md").read_text()
    assert "## Where the elastic run loses" in md and "Reduced run" in md
    assert (out / "compare_accuracy_vs_params.png").stat().st_size > 1000
    # a rerun reuses the trained models (result.json) and only measures again
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert len(runs) == 4 and all((out / "runs" / r / "result.json").is_file() for r in runs)


def test_report_states_where_the_elastic_run_loses_and_the_cost_ratios(tmp_path):
    """Synthetic measurements: a route that beats the elastic model is named with its margin
    and seed spread; costs add the sizes' tokens (one seed) against the elastic run's; the
    headline compares the smallest size with its architecture distilled alone."""
    from elastic_plugin.comparison.report import assemble, markdown, plot

    params = {"total": 1000, "active": 800}

    def rec(route, label, loss, acc, budget=None, seed=None, tokens=0, seconds=0.0, tflop=3.0):
        return {
            "name": f"{route}_{label}_{budget}_{seed}",
            "route": route,
            "label": label,
            "token_budget": budget,
            "seed": seed,
            "tokens": tokens,
            "seconds": seconds,
            "tflop": tflop if budget else None,
            "valid_loss": loss,
            "accuracy": acc,
            "params": params if label == "0.4" else {"total": 2000, "active": 1500},
        }

    records = [
        rec("elastic", "0.77", 0.50, 0.60),
        rec("elastic", "0.4", 0.70, 0.40),
        rec("zero_shot", "0.4", 2.0, 0.0),
        *[
            rec("prune_distil", "0.4", loss, acc, "equal_tokens", s, 1000, 10.0 + s)
            for s, loss, acc in ((1, 0.60, 0.50), (2, 0.64, 0.44), (3, 0.62, 0.47))
        ],
        *[
            rec("prune_distil", "0.77", 0.55, 0.55, "equal_tokens", s, 1000, 20.0)
            for s in (1, 2, 3)
        ],
    ]
    sizes = {
        "0.77": {"choice": {}, "cost_fraction": 0.77},
        "0.4": {"choice": {}, "cost_fraction": 0.4},
    }
    settings = {
        "task": "products",
        "problems": 10,
        "eval_sequences": 4,
        "seq_length": 64,
        "seeds": [1, 2, 3],
        "scale": 1.0,
        "num_sizes": 2,
        "token_budgets": {"equal_tokens": 1000},
        "elastic_checkpoint": "ckpt",
    }
    report = assemble(
        records, sizes, {"iterations": 10, "tokens": 1000, "seconds": 15.0, "tflop": 4.0}, settings
    )
    (line,) = report["elastic_loses"]  # 0.77 alone is worse; 0.4 alone is better
    assert line.startswith("budget 0.4: prune_distil/equal_tokens beats the elastic model")
    assert "accuracy 47.0% vs 40.0% (+7.0 points, seed spread ±3.0)" in line
    assert "validation loss 0.6200 vs 0.7000 (seed spread ±0.0200)" in line
    assert report["cost"]["elastic"]["sizes"] == 2  # the one run made both sizes
    cost = report["cost"]["prune_distil/equal_tokens"]
    assert cost["tokens"] == 2000 and cost["token_ratio"] == 2.0 and cost["sizes"] == 2
    assert cost["tflop"] == 6.0 and cost["flop_ratio"] == 1.5  # 2 sizes x 3 TFLOP vs 4
    assert cost["seconds"] == pytest.approx(12.0 + 20.0) and cost["time_ratio"] == pytest.approx(
        32.0 / 15.0
    )
    head = report["headline"]
    assert head["budget"] == "0.4" and head["paid"] is False
    assert "**the elastic model loses here**" in "\n".join(head["markdown"])
    md = markdown(report)
    assert "0.6200 ± 0.0200" in md and "47.0 ± 3.0%" in md and line in md
    assert plot(report, tmp_path / "p.png").stat().st_size > 1000


def test_a_gap_is_judged_against_the_paired_sampling_noise_of_the_items():
    """With per-problem correctness and per-window losses, a route's gap to the elastic model
    gets a paired standard error (seeds averaged per item, then the spread of the per-item
    differences / sqrt(items)): a one-problem gap on 8 problems is within noise, a consistent
    gap on every item is beyond it, and the headline says which."""
    from elastic_plugin.comparison.report import assemble, markdown

    params = {"total": 1000, "active": 800}

    def rec(route, correct, windows, budget=None, seed=None):
        return {
            "name": f"{route}_{seed}",
            "route": route,
            "label": "0.4",
            "token_budget": budget,
            "seed": seed,
            "tokens": 500 if budget else 0,
            "seconds": 1.0,
            "tflop": 1.0 if budget else None,
            "valid_loss": sum(windows) / len(windows),
            "accuracy": sum(correct) / len(correct),
            "correct": correct,
            "window_losses": windows,
            "params": params,
        }

    elastic = rec("elastic", [1, 0, 1, 0, 1, 0, 0, 0], [0.70, 0.80, 0.60, 0.75])
    close = [  # one more problem right on average, losses within the windows' spread
        rec("prune_distil", [1, 1, 1, 0, 1, 0, 0, 0], [0.60, 0.90, 0.50, 0.80], "equal_cost", 1),
        rec("prune_distil", [1, 0, 1, 1, 1, 0, 0, 0], [0.62, 0.88, 0.52, 0.78], "equal_cost", 2),
    ]
    settings = {
        "task": "products",
        "problems": 8,
        "eval_sequences": 4,
        "seq_length": 64,
        "seeds": [1, 2],
        "scale": 1.0,
        "num_sizes": 1,
        "token_budgets": {"equal_cost": 500},
        "elastic_checkpoint": "ckpt",
    }
    sizes = {"0.4": {"choice": {}, "cost_fraction": 0.4}}
    run = {"iterations": 10, "tokens": 1000, "seconds": 15.0, "tflop": 4.0}
    report = assemble([elastic, *close], sizes, run, settings)
    paired = report["sizes"][0]["routes"]["prune_distil/equal_cost"]["vs_elastic"]
    # per-problem differences (seed means minus elastic): 0, .5, 0, .5, 0, 0, 0, 0
    diffs = [0, 0.5, 0, 0.5, 0, 0, 0, 0]
    mean = sum(diffs) / 8
    se = (sum((d - mean) ** 2 for d in diffs) / 7) ** 0.5 / 8**0.5
    assert paired["accuracy"]["diff"] == pytest.approx(0.125)
    assert paired["accuracy"]["se"] == pytest.approx(se) and paired["accuracy"]["items"] == 8
    assert paired["valid_loss"]["items"] == 4
    (line,) = report["elastic_loses"]
    assert "over 8 problems: within sampling noise" in line
    head = report["headline"]
    assert head["paid"] is False and head["within_noise"] is True
    assert "within the sampling noise" in "\n".join(head["markdown"])
    assert head["paired_standard_error"]["accuracy"] == pytest.approx(se)

    far = [  # every problem right, every window 0.2 lower: far beyond the noise
        rec("prune_distil", [1] * 8, [w - 0.2 for w in elastic["window_losses"]], "equal_cost", 1),
        rec("prune_distil", [1] * 8, [w - 0.21 for w in elastic["window_losses"]], "equal_cost", 2),
    ]
    report = assemble([elastic, *far], sizes, run, settings)
    (line,) = report["elastic_loses"]
    assert "problems: beyond sampling noise" in line
    assert "validation windows: beyond sampling noise" in line
    head = report["headline"]
    assert head["within_noise"] is False
    assert "**the elastic model loses here**" in "\n".join(head["markdown"])
    assert line in markdown(report)
    # measurements without per-item data (older records): no paired error, still a loss
    bare = [{k: v for k, v in r.items() if k not in ("correct", "window_losses")} for r in far]
    report = assemble([elastic, *bare], sizes, run, settings)
    assert report["sizes"][0]["routes"]["prune_distil/equal_cost"]["vs_elastic"] is None
    assert report["headline"]["within_noise"] is False


def test_demo_report_carries_the_short_comparison_of_its_own_checkpoint(tmp_path):
    """evaluate's report.md gets "Does the method pay?" from OUT/compare/compare.json's headline
    when that comparison measured the same elastic checkpoint, and nothing otherwise."""
    from elastic_plugin.evaluation.report import COMPARE_JSON, _comparison, markdown

    ckpt = tmp_path / "checkpoints" / "elastic"
    ckpt.mkdir(parents=True)
    path = tmp_path / COMPARE_JSON
    assert _comparison(path, ckpt) is None  # no comparison run
    path.parent.mkdir()
    head = {"checkpoint": str(ckpt), "markdown": ["| elastic | 0.5 | 40.0% |"], "paid": True}
    path.write_text(json.dumps({"headline": head}))
    assert _comparison(path, tmp_path / "checkpoints" / ".." / "checkpoints" / "elastic") == head
    assert _comparison(path, tmp_path / "other") is None  # another run's comparison
    report = {
        "task": "products",
        "problems": 1,
        "teacher_valid_loss": 0.5,
        "budgets": [],
        "budget_control": [],
        "targets": {},
        "comparison": head,
    }
    md = markdown(report)
    assert "## Does the method pay?\n\n| elastic | 0.5 | 40.0% |" in md
    assert "Does the method pay" not in markdown(report | {"comparison": None})
