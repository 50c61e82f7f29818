"""Zero-shot screening (``elastic/screening.py``) on a tiny Llama-shaped Megatron model in this
process: a candidate broken on purpose ranks last, each budget starts on its lowest-loss valid
candidate (the router's hard choice at the first iteration is that candidate), the ablation
table is written and printed, and bad config values name their field and the allowed values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny_llama.yaml"
SIZES = {"embedding": [128, 96], "ffn": [256, 128], "attention_heads": [4, 2]}
BUDGETS = [1.0, 0.7, 0.5]
SEQ, MBS = 32, 2
BROKEN_FFN = 128  # every candidate with this FFN width is broken (see ``_break_ffn_cut``)


def _batches(vocab: int) -> list[dict]:
    """A periodic token pattern (each token is the previous + 5): a few Adam steps teach it."""
    pattern = torch.arange(SEQ + 1) * 5 % vocab
    out = []
    for shift in range(3):
        seq = torch.roll(pattern, 7 * shift).expand(MBS, SEQ + 1)
        out.append(
            {
                "tokens": seq[:, :-1].clone(),
                "labels": seq[:, 1:].clone(),
                "loss_mask": torch.ones(MBS, SEQ),
                "position_ids": torch.arange(SEQ).expand(MBS, SEQ).clone(),
                "attention_mask": None,
            }
        )
    return out


def _train(model, batches: list[dict], steps: int = 30) -> float:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        b = batches[step % len(batches)]
        loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def _break_ffn_cut(model, pairs: int, scale: float) -> None:
    """In every MLP, ``pairs`` kept neurons a < half get a twin b = half + a in the half an FFN
    cut to ``BROKEN_FFN`` drops (the same gate and up rows) and the output columns
    ``+scale v`` (added to a's) and ``-scale v`` (b's): the full MLP's twins cancel (it only
    loses b's own contribution), a model cut to half the neurons keeps ``+scale v``."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.decoder.layers:
            mlp = getattr(layer, "mlp", None)
            if mlp is None or not hasattr(mlp, "linear_fc1"):
                continue
            fc1, fc2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight
            full = fc2.shape[1]
            assert full == 2 * BROKEN_FFN
            v = scale * torch.randn(fc2.shape[0], generator=gen)
            for a in range(pairs):
                b = BROKEN_FFN + a
                fc1[b], fc1[full + b] = fc1[a], fc1[full + a]  # gate and up rows
                fc2[:, a] += v
                fc2[:, b] = -v


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.cost import ElasticCost
    from elastic_plugin.elastic.model import attach_elastic
    from elastic_plugin.models.config import TrainingConfig, load_config
    from elastic_plugin.parallel import (
        Layout,
        build_model_chunks,
        init_distributed,
        initialize_layout,
    )

    enable_cpu_megatron()
    init_distributed()
    initialize_layout(Layout(), seed=7)
    cfg = load_config(CONFIG).model
    model = build_model_chunks(cfg, Layout(), wrap_ddp=False)[0][0]
    batches = _batches(cfg.vocab_size)
    assert _train(model, batches) < 2.0  # ln(128) = 4.85 untrained
    _break_ffn_cut(model, pairs=8, scale=5.0)
    ecfg = ElasticConfig.from_dict(
        {
            "budgets": BUDGETS,
            "sizes": SIZES,
            "router": {"init": "screened", "screen_tokens": 3 * SEQ * MBS},
        }
    )
    resolved = ecfg.resolve(cfg)
    state = attach_elastic(model, resolved, sequence_parallel=False, router_seed=0)

    def valid_factory():
        return iter(batches * 50)

    sched = TrainingConfig(seq_length=SEQ, micro_batch_size=MBS, eval_iters=1)
    out = tmp_path_factory.mktemp("screening")
    return {
        "model": model,
        "state": state,
        "ecfg": ecfg,
        "resolved": resolved,
        "cost": ElasticCost(cfg, resolved),
        "sched": sched,
        "valid": valid_factory,
        "out": out,
    }


@pytest.fixture(scope="module")
def screened(setup):
    """The run's screening, as ``elastic-train`` calls it (``train._screen_router``)."""
    from elastic_plugin.elastic.train import _screen_router

    s = setup
    _screen_router(
        [s["model"]],
        s["state"],
        {},  # no scores file: depth importance is measured
        ecfg=s["ecfg"],
        resolved=s["resolved"],
        sched=s["sched"],
        dp=1,
        out_dir=s["out"],
        valid_factory=s["valid"],
    )
    return json.loads((s["out"] / "screening.json").read_text())


def test_broken_candidates_rank_last(screened):
    rows = screened["candidates"]
    assert len(rows) == 8 and screened["tokens_per_candidate"] == 3 * SEQ * MBS
    assert screened["passes"] == {"candidates": 8, "ablation": 8}  # 2 budgets x 4 cuts
    for row in rows:
        assert set(row) >= {"sizes", "cost_fraction", "loss", "perplexity", "rank"}
        assert row["perplexity"] == pytest.approx(math.exp(row["loss"]))
    broken = [r for r in rows if r["sizes"]["ffn"] == BROKEN_FFN]
    intact = [r for r in rows if r["sizes"]["ffn"] != BROKEN_FFN]
    assert max(r["rank"] for r in intact) < min(r["rank"] for r in broken)
    assert min(r["loss"] for r in broken) > max(r["loss"] for r in intact) + 1.0


def test_flops_are_every_forward(setup, screened):
    from elastic_plugin.models.flops import forward_flops

    model, flops = setup["resolved"].model, screened["flops"]
    grid = sum(
        forward_flops(model, SEQ, MBS, r["sizes"], full_router=True).total
        for r in screened["candidates"]
    )
    assert flops["candidates"] == 3 * grid  # 3 micro-batches each
    full = forward_flops(model, SEQ, MBS, full_router=True)
    assert flops["depth_importance"] == 9 * full.total - sum(full.per_layer)
    assert flops["total"] == flops["candidates"] + flops["ablation"] + flops["depth_importance"]
    assert 0 < flops["ablation"] < 8 * 3 * full.total


def test_each_budget_picks_its_lowest_loss_valid_candidate(setup, screened):
    from elastic_plugin.elastic.freeze import feasible_choices

    s = setup
    for budget in BUDGETS:
        label = f"{budget:g}"
        pick = screened["choices"][label]
        feasible = feasible_choices(s["resolved"], s["cost"], budget)
        rows = [r for r in screened["candidates"] if r["sizes"] in feasible]
        assert pick["sizes"] in feasible and pick["feasible"] == len(rows)
        assert pick["loss"] == min(r["loss"] for r in rows)
        assert abs(pick["cost_fraction"] / budget - 1) <= 0.05
    # at 0.7 the broken candidate is the closer to the budget (0.676 vs 0.669): loss wins
    assert screened["choices"]["0.7"]["sizes"] == {
        "embedding": 96,
        "ffn": 256,
        "attention_heads": 2,
    }
    assert screened["choices"]["1"]["sizes"] == {"embedding": 128, "ffn": 256, "attention_heads": 4}


def test_router_starts_on_the_screened_choice(setup, screened):
    """The argmax, and the noisy hard draw of the first iteration at the starting temperature
    and logit scale (probability >= 0.95 by construction), are the screened candidate."""
    from elastic_plugin.elastic.model import router_of
    from elastic_plugin.elastic.sampling import BudgetSampler

    s = setup
    router, resolved = router_of(s["model"]), s["resolved"]
    sampler = BudgetSampler(resolved.budgets, (), seed=1234, total_iters=10)
    temperature, scale = s["ecfg"].router.temperature[0], s["ecfg"].router.logit_scale[0]
    for budget in BUDGETS[1:]:
        label = f"{budget:g}"
        want = screened["choices"][label]["sizes"]
        assert screened["choices"][label]["start_probability"] >= 0.95
        picks = router.choose(budget)
        assert {n: spec.candidates[picks[n][0]] for n, spec in resolved.axes.items()} == want
        hits = 0
        for mb in range(200):
            probs = router(
                router.encode(budget), temperature, scale, True, sampler.noise_generator(1, mb)
            )
            drawn = {
                n: spec.candidates[int(probs[n][0].argmax())] for n, spec in resolved.axes.items()
            }
            hits += drawn == want
        assert hits >= 180  # expected >= 190 (0.95); 180 is 3.2 standard deviations below
    strength = screened["router_init"]["strength"]
    assert set(strength) == set(resolved.axes) and all(v > 3.0 for v in strength.values())


def test_ablation_rows_and_printout(setup, screened, capsys):
    from elastic_plugin.elastic.screening import format_ablation, main

    rows = screened["ablation"]["0.5"]
    cuts = {r["cut"]: r for r in rows}
    assert set(cuts) == {"screened", "hidden", "FFN", "heads", "depth"}
    assert cuts["hidden"]["sizes"]["ffn"] == 256 and cuts["hidden"]["sizes"]["embedding"] < 128
    assert cuts["hidden"]["reaches"] and cuts["FFN"]["reaches"]
    assert not cuts["heads"]["reaches"]  # heads alone cannot reach half of this model
    assert cuts["depth"]["layers_kept"] < 8 and cuts["depth"]["dropped_layers"]
    assert all(r["loss"] is not None for r in rows)
    assert "depth" in set(screened["ablation"]["0.7"][i]["cut"] for i in range(5))
    assert screened["depth_scores_from"] == "measured (importance.depth: 9 forwards of 64 tokens)"
    text = format_ablation(screened, 0.5)
    assert "keeps the most" in text and "hidden" in text and "depth" in text
    path = str(setup["out"] / "screening.json")
    assert main([path, "--budget", "0.5"]) == 0
    assert "ablation at budget 0.5" in capsys.readouterr().out
    assert main([path, "--budget", "0.3"]) == 2
    assert "budgets with one: 0.7, 0.5" in capsys.readouterr().err


def test_depth_cut_drops_the_least_important_layers():
    from elastic_plugin.elastic.screening import depth_cut

    per_layer = {1: 10, 2: 30, 3: 10, 4: 30}
    cut = depth_cut(per_layer, 100.0, 0.6, {1: 0.5, 2: 0.01, 3: 0.2, 4: 0.3})
    assert cut["dropped_layers"] == [2, 3] and cut["cost_fraction"] == pytest.approx(0.6)
    assert cut["reaches"] and cut["layers_kept"] == 2
    cut = depth_cut(per_layer, 100.0, 0.6, None)  # no scores: the last layers first
    assert cut["dropped_layers"] == [3, 4]
    cut = depth_cut(per_layer, 100.0, 0.05, None)  # never below one layer
    assert cut["layers_kept"] == 1 and not cut["reaches"]


def test_start_strength_gives_the_target_probability():
    from elastic_plugin.elastic.screening import start_strength

    for candidates, rows, scale in ((6, 3, 1.0), (2, 1, 1.0), (3, 30, 2.0)):
        s = start_strength(candidates, rows, 0.95, scale)
        logits = torch.zeros(candidates, dtype=torch.float64)
        logits[0] = s
        p = torch.softmax(scale * logits, dim=0)[0].item()
        assert p**rows == pytest.approx(0.95)
    assert start_strength(1, 3, 0.95, 1.0) == 0.0


@pytest.mark.parametrize(
    "router, field, allowed",
    [
        ({"init": "best"}, "elastic.router.init='best'", "allowed: prior, screened"),
        ({"screen_tokens": 0}, "elastic.router.screen_tokens=0", "a positive integer"),
        ({"screen_tokens": 1.5}, "elastic.router.screen_tokens=1.5", "a positive integer"),
        ({"lr": -1e-2}, "elastic.router.lr=-0.01", "a number > 0"),
        ({"lr": "fast"}, "elastic.router.lr='fast'", "a number > 0"),
    ],
)
def test_bad_router_values_name_the_field(router, field, allowed):
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.models.config import ConfigError

    with pytest.raises(ConfigError) as err:
        ElasticConfig.from_dict({"router": router}, source="run.yaml")
    assert field in str(err.value) and allowed in str(err.value)
    assert str(err.value).startswith("run.yaml: ")


def test_router_lr_and_round_trip():
    from elastic_plugin.elastic.config import ElasticConfig

    cfg = ElasticConfig.from_dict({"router": {"init": "screened", "lr": 1e-2}})
    assert cfg.router.lr_multiplier(1e-4) == pytest.approx(100.0)
    assert ElasticConfig().router.lr_multiplier(1e-4) == 100.0  # lr_mult when lr is unset
    written = cfg.to_dict()["router"]
    assert written["init"] == "screened" and written["lr"] == 1e-2
    assert "screen_tokens" not in written  # at its default: not written
    assert "init" not in ElasticConfig().to_dict()["router"]
    assert ElasticConfig.from_dict(cfg.to_dict()) == cfg


def test_screened_init_without_validation_data_is_refused(tmp_path):
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.train import train_elastic
    from elastic_plugin.models.config import ConfigError, TrainingConfig, load_config
    from elastic_plugin.parallel import Layout

    cfg = load_config(CONFIG)
    ecfg = ElasticConfig.from_dict(
        {"budgets": BUDGETS, "sizes": SIZES, "router": {"init": "screened"}}
    )
    with pytest.raises(ConfigError, match="router.init=screened .* validation data"):
        train_elastic(
            cfg, ecfg, Layout(), tmp_path / "none", tmp_path, lambda n: None, None, TrainingConfig()
        )
    # one candidate per axis (a size distilled alone): nothing to screen, nothing refused; the
    # run goes on to load its (missing) checkpoint
    one = ElasticConfig.from_dict(
        {"budgets": [1.0], "sizes": {a: [1.0] for a in SIZES}, "router": {"init": "screened"}}
    )
    with pytest.raises(Exception) as err:
        train_elastic(
            cfg, one, Layout(), tmp_path / "none", tmp_path, lambda n: None, None, TrainingConfig()
        )
    assert "no such checkpoint directory" in str(err.value)


def test_router_flags(tmp_path):
    """``--elastic-router-init / -screen-tokens / -lr`` over the YAML; a bad value names its flag."""
    import argparse

    import yaml

    from elastic_plugin.elastic.args import add_elastic_args, elastic_config_from_args
    from elastic_plugin.models.config import ConfigError

    def parse(argv):
        return add_elastic_args(argparse.ArgumentParser(allow_abbrev=False)).parse_args(argv)

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"elastic": {"router": {"init": "screened", "lr": 1e-2}}}))
    cfg = elastic_config_from_args(
        parse(["--elastic-config", str(path), "--elastic-router-screen-tokens", "64"])
    )
    assert (cfg.router.init, cfg.router.screen_tokens, cfg.router.lr) == ("screened", 64, 1e-2)
    cfg = elastic_config_from_args(
        parse(["--elastic-router-init", "prior", "--elastic-router-lr", "0.02"])
    )
    assert cfg.router.init == "prior" and cfg.router.lr == 0.02
    for argv, allowed in (
        (["--elastic-router-init", "best"], "allowed: prior, screened"),
        (["--elastic-router-screen-tokens", "0"], "a positive integer"),
        (["--elastic-router-lr", "0"], "a number > 0"),
    ):
        with pytest.raises(ConfigError, match=f"^{argv[0]}: .*{allowed}"):
            elastic_config_from_args(parse(argv))


# ------------------------------------------------------------------------------ multi-rank
def train_screened_case(workdir: str, tp: int = 1, pp: int = 1) -> dict:
    """Rank case: ``train_elastic`` with ``router.init=screened`` (one iteration) on the tiny
    Llama under ``tp`` x ``pp``; returns rank 0's screening record and first logged choices."""
    import torch.distributed as dist

    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.train import train_elastic
    from elastic_plugin.parallel import Layout
    from tests.support import elastic_cases as ec

    work = Path(workdir)
    cfg = ec._experiment(str(CONFIG), None)
    if dist.get_rank() == 0 and not (work / "init" / "elastic_meta.json").is_file():
        ec.write_init_checkpoint(cfg, work / "init")
    dist.barrier()
    ecfg = ElasticConfig.from_dict(
        {
            "budgets": BUDGETS,
            "sizes": SIZES,
            # a router LR of ~0: the first logged choice (after one step) is where it started
            "router": {"init": "screened", "screen_tokens": 2 * ec.SEQ_LEN * 4, "lr": 1e-12},
        }
    )
    vocab = cfg.model.vocab_size
    out = work / f"tp{tp}_pp{pp}"
    train_elastic(
        cfg,
        ecfg,
        Layout(tp=tp, pp=pp),
        work / "init",
        out,
        lambda consumed: ec._synthetic_iterator(vocab, 4, consumed),
        lambda: ec._synthetic_iterator(vocab, 4, 10**6),
        ec.tiny_schedule(1, 1e-3),
        progress=False,
    )
    if dist.get_rank() != 0:
        return {}
    first = json.loads((out / "elastic_metrics.jsonl").read_text().splitlines()[0])
    return {"screening": json.loads((out / "screening.json").read_text()), "first": first}


@pytest.mark.integration
def test_screening_under_tensor_and_pipeline_parallel(rank_pools, tmp_path):
    """The screening inside ``train_elastic`` measures the same losses at TP=2 and PP=2 as on
    one rank (the same sliced evaluation, layer skips on the stage that holds the layer), each
    layout picks its lowest-loss valid candidate, and its first iteration trains on it."""
    target = f"{__name__}:train_screened_case"
    (one,) = rank_pools.get(1).run(target, workdir=str(tmp_path))
    for layout in ({"tp": 2}, {"pp": 2}):
        got = rank_pools.get(2).run(target, workdir=str(tmp_path), **layout)[0]
        for a, b in zip(one["screening"]["candidates"], got["screening"]["candidates"]):
            assert a["sizes"] == b["sizes"]
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        for budget in ("0.7", "0.5"):
            for a, b in zip(
                one["screening"]["ablation"][budget], got["screening"]["ablation"][budget]
            ):
                assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (layout, a["cut"])
    for run in (one, got):
        screening = run["screening"]
        assert screening["passes"] == {"candidates": 8, "ablation": 8}
        for label, pick in screening["choices"].items():
            feasible = [
                r for r in screening["candidates"]
                if abs(r["cost_fraction"] / float(label) - 1) <= 0.05
            ]  # fmt: skip
            assert pick["loss"] == min(r["loss"] for r in feasible)
            assert run["first"]["choices"][label] == pick["sizes"]
