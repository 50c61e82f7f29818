"""``elastic-plugin plan`` (issue 19): its figures against Megatron and against measurement.

* analytic (``models``): the FLOPs a plan uses are ``models.flops``' (already equal to
  ``torch.utils.flop_counter``) of the nested model each budget runs; weights + gradients +
  optimizer state per rank against Megatron-LM's own estimator
  (``megatron.training.theoretical_memory_usage``) on an attention/MoE-only model, the one
  kind it covers (it refuses hybrid models); the CLI's bad input, exit codes, JSON and plot.
* measured (``multirank``, ``slow``; 2 gloo ranks, the tiny model): weights, DDP gradient
  buffers and optimizer state per rank equal what Megatron allocates, exactly; communication
  bytes per step and group equal the bytes counted at the ``torch.distributed`` calls of a real
  elastic step (teacher pass, student forward/backward, gradient reduction); the activations of
  a micro-batch within 20% of the measured peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastic_plugin.cli import build_parser, main
from elastic_plugin.elastic.config import CurriculumStage, ElasticConfig
from elastic_plugin.models.axes import model_for_choice
from elastic_plugin.models.config import load_config
from elastic_plugin.models.flops import forward_flops, training_flops
from elastic_plugin.models.runtime import Runtime
from elastic_plugin.planning.activations import stage_activation_bytes
from elastic_plugin.planning.budgets import stage_flops
from elastic_plugin.planning.comm import step_comm_bytes
from elastic_plugin.planning.devices import load_device
from elastic_plugin.planning.layouts import PlanLayout, check_layout
from elastic_plugin.planning.memory import state_bytes, teacher_logit_bytes
from elastic_plugin.planning.params import elastic_router_tensors, stage_params
from elastic_plugin.planning.plan import PlanInputs, evaluate_layout, make_plan

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "configs" / "tiny.yaml")
NANO = str(ROOT / "examples" / "configs" / "nemotron_nano_v3.yaml")
CASES = "tests.support.planning_cases"


# ----------------------------------------------------------------------------- analytic
def test_plan_flops_are_the_nested_models_flops():
    model = load_config(TINY).model
    elastic = ElasticConfig.from_dict({"budgets": [1.0, 0.77, 0.4]})
    runtime = Runtime(bf16=True, recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)  # fmt: skip
    inputs = PlanInputs(model, "tiny", 2, load_device("h100"), 128, 4, 8, runtime, elastic)
    layout = PlanLayout(
        tp=1, pp=2, ep=1, dp=1, sequence_parallel=False, distributed_optimizer=False
    )
    resolved = check_layout(model, layout, 2, elastic, runtime, 4, 8)
    plans = evaluate_layout(inputs, layout, resolved, 128)
    assert [p.run.budget for p in plans] == [1.0, 0.77, 0.4]
    teacher = forward_flops(model, 128, 4)
    for plan in plans:
        run = plan.run
        expected = training_flops(model, 128, 4, run.choice, recompute=True, full_router=True)
        assert run.train_flops == expected  # the sliced nested model, 4 passes, all routers
        assert run.teacher_flops == teacher
        assert sum(stage_flops(model, run.train_flops, 2)) == expected.total
        assert plan.step_flops == (expected.total + teacher.total) * (8 // 4)
        assert run.nested == model_for_choice(model, run.choice)
    assert plans[2].run.train_flops.total < plans[0].run.train_flops.total


def test_plan_curriculum_reads_the_training_stage_type_in_tokens_or_iterations():
    """The planner's --stage is the training config's CurriculumStage: a stage of N iterations
    costs what a stage of N x global batch x sequence length tokens does."""
    model = load_config(TINY).model
    elastic = ElasticConfig.from_dict({"budgets": [1.0, 0.77, 0.4]})
    base = PlanInputs(model, "tiny", 2, load_device("h100"), 128, 4, 8, Runtime(), elastic)
    by_tokens = dataclasses.replace(base, curriculum=(
        CurriculumStage(tokens=8 * 128 * 300.0),
        CurriculumStage(tokens=8 * 256 * 50.0, budget_probs=(0.5, 0.3, 0.2), seq_length=256),
    ))  # fmt: skip
    by_iters = dataclasses.replace(base, curriculum=(
        CurriculumStage(iters=300),
        CurriculumStage(iters=50, budget_probs=(0.5, 0.3, 0.2), seq_length=256),
    ))  # fmt: skip
    tokens_plan, iters_plan = make_plan(by_tokens)[0][0], make_plan(by_iters)[0][0]
    stages = tokens_plan.curriculum["stages"]
    assert [(s["tokens"], s["seq_length"], s["steps"]) for s in stages] == [
        (8 * 128 * 300.0, 128, 300.0),
        (8 * 256 * 50.0, 256, 50.0),
    ]
    assert stages[1]["budget_probs"] == [0.5, 0.3, 0.2]
    assert tokens_plan.curriculum == iters_plan.curriculum
    assert tokens_plan.curriculum["gpu_hours"] > 0


def _megatron_args(model, tp: int, pp: int, ep: int, dp: int, dist_opt: bool):
    """Megatron-LM's arguments for a model of '*E' pairs: one GPT layer (attention + MoE) per
    pair (the estimator's layer has both; our pattern gives each its own layer and norm)."""
    layers = model.hybrid_layer_pattern
    assert set(layers) == {"*", "E"} and layers == "*E" * (len(layers) // 2)
    return argparse.Namespace(
        kv_channels=model.head_dim, num_attention_heads=model.num_attention_heads,
        hidden_size=model.hidden_size, group_query_attention=True,
        num_query_groups=model.query_groups, num_experts=model.num_moe_experts, swiglu=False,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
        moe_layer_freq=1, num_layers=len(layers) // 2, moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        ffn_hidden_size=model.moe_ffn_hidden_size, mtp_num_layers=None, normalization="RMSNorm",
        multi_latent_attention=False, padded_vocab_size=model.vocab_size,
        untie_embeddings_and_output_weights=model.untie_embeddings_and_output_weights,
        moe_latent_size=None, moe_router_topk=model.moe_router_topk, add_bias_linear=False,
        moe_shared_expert_gate=False, expert_tensor_parallel_size=tp,
        expert_model_parallel_size=ep, pipeline_model_parallel_size=pp,
        tensor_model_parallel_size=tp, world_size=tp * pp * dp, data_parallel_size=dp,
        use_distributed_optimizer=dist_opt, hybrid_layer_pattern=None,
        virtual_pipeline_model_parallel_size=None, sequence_parallel=True,
        recompute_granularity=None, seq_length=4096, micro_batch_size=1,
    )  # fmt: skip


@pytest.mark.parametrize(
    "tp,pp,ep,dp,dist_opt", [(1, 1, 1, 1, False), (2, 1, 8, 32, True), (2, 2, 4, 8, True)]
)
def test_weights_and_optimizer_against_megatrons_estimator(tp, pp, ep, dp, dist_opt, capsys):
    """Nano v3's attention / MoE dimensions in 24 '*E' pairs (Megatron's estimator refuses the
    real, hybrid pattern). Intended differences: the distributed optimizer's buffer padding
    (ours is Megatron's allocation, the estimator leaves it out: ratio >= 1) and, under PP, the
    final norm (the estimator spreads it over the stages; it lives on the last one)."""
    from megatron.training.theoretical_memory_usage import (
        compute_weight_and_optimizer_memory,
        report_theoretical_memory,
    )

    nano = load_config(NANO).model
    model = nano.__class__(**{**nano.__dict__, "hybrid_layer_pattern": "*E" * 24}).validate()
    args = _megatron_args(model, tp, pp, ep, dp, dist_opt)
    theirs = compute_weight_and_optimizer_memory(args)
    stages = stage_params(model, tp, pp, ep)
    ours = max(sum(state_bytes(s, dp, ep, True, dist_opt).values()) for s in stages)
    ratio = ours / theirs
    with capsys.disabled():
        print(f"\nTP{tp} PP{pp} EP{ep} DP{dp} DO={dist_opt}: ours {ours / 2**30:.3f} GiB, "
              f"Megatron's {theirs / 2**30:.3f} GiB, ratio {ratio:.6f}")  # fmt: skip
    if not dist_opt and pp == 1:
        assert ours == theirs
    else:
        assert 1 - 1e-4 <= ratio <= 1 + 2e-3, ratio
    # ... and it refuses a hybrid model, which the plan covers
    hybrid = argparse.Namespace(**{**vars(args), "hybrid_layer_pattern": nano.hybrid_layer_pattern})
    assert report_theoretical_memory(hybrid) is None
    assert "not yet supported for hybrid" in capsys.readouterr().out


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--gpus", "0"], "--gpus=0; allowed: a positive integer"),
        (["--gpus", "2", "--gpu", "a100"], "--gpu 'a100'; allowed: h100, h200, b200, gb200"),
        (["--gpus", "2", "--teacher", "twin"], "--teacher 'twin'; allowed: frozen, self"),
        (["--gpus", "2", "--efficiency", "1.5"], "--efficiency=1.5; allowed: a number in (0, 1]"),
        (["--gpus", "2", "--stage", "1e9"], "--stage '1e9'; allowed: TOKENS:SEQ"),
        (["--gpus", "2", "--stage", "1e9:128:0.5/0.5"],
         "--stage '1e9:128:0.5/0.5': budget_probs=[0.5, 0.5] has 2 entries; allowed: one per budget (3"),
        (["--gpus", "2", "--stage", "0:128"], "--stage '0:128': tokens=0.0; allowed: a number > 0"),
        (["--gpus", "2", "--elastic-budgets", "0.4", "1.0"], "--elastic-budgets"),
        (["--gpus", "2", "--kd-chunk-tokens", "0"], "--kd-chunk-tokens"),
        (["--gpus", "2", "--recompute-granularity", "some"], "--recompute-granularity='some'"),
        (["--gpus", "2", "--global-batch-size", "6", "--micro-batch-size", "4"],
         "--global-batch-size=6 is not a multiple of --micro-batch-size=4"),
        (["--gpus", "3"], "no valid layout of 3 GPUs"),
        (["--gpus", "2", "--context-parallel-size", "0"],
         "--context-parallel-size=0; allowed: a positive integer"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_naming_the_flag(argv, message, capsys):
    code, _, err = _run(["--config", TINY, *argv], capsys)
    assert code == 2
    assert message in err, err


def test_context_parallel_layouts_split_the_tokens_and_keep_the_checks():
    """CP in the enumerated layouts: a CP rank holds 1/CP of each sequence (activations, teacher
    logits) plus the K/V gathered from the others, its weights' copies are DP x CP (optimizer
    shards), compute divides by CP; sizes the model or sequence cannot serve are not listed."""
    from elastic_plugin.planning.layouts import enumerate_layouts
    from elastic_plugin.planning.memory import rank_memory
    from tests.support.elastic_cases import tiny_model

    model = tiny_model(TINY, None)  # M*E-M*E-: 2 Mamba groups, 2 query groups
    elastic = ElasticConfig.from_dict({"budgets": [1.0, 0.77, 0.4]})
    args = (model, 8, elastic, Runtime(), 1, 8)
    valid, rejected = enumerate_layouts(*args, seq_length=256)
    cps = {layout.cp for layout, _ in valid}
    assert cps == {1, 2}, cps  # CP 4 / 8 would split a Mamba group
    assert any("whole" in reason or "Mamba groups" in reason for reason in rejected), rejected
    assert {lay.cp for lay, _ in enumerate_layouts(*args, seq_length=258)[0]} == {1}  # 2 x CP
    only = enumerate_layouts(*args, seq_length=256, context_parallel=(2,))[0]
    assert only and all(lay.cp == 2 and lay.tp * lay.pp * lay.cp * lay.dp == 8 for lay, _ in only)
    named = next(lay for lay, _ in only if lay.tp == 1 and lay.pp == 1)
    assert "CP2" in named.name and named.to_dict()["cp"] == 2

    stages = stage_params(model, 1, 1, 1)
    one = rank_memory(model, model, stages, 1, 1, 1, 4, False, True, Runtime(), 1, 256, 4, True)
    two = rank_memory(model, model, stages, 1, 1, 1, 2, False, True, Runtime(), 1, 256, 4, True,
                      cp=2)  # fmt: skip
    assert two.teacher_logits * 2 == one.teacher_logits
    assert (two.weights, two.optimizer) == (one.weights, one.optimizer)  # DP 2 x CP 2 = DP 4
    g, d = model.query_groups, model.head_dim
    gathered = model.count("attention") * 2 * g * d * 128 * 4  # the other rank's K/V, FP32
    halves = one.activations_per_microbatch / 2
    assert two.activations_per_microbatch == pytest.approx(halves + gathered)


def test_teacher_and_loss_memory_as_built():
    """The teacher's logits are those of the in-flight micro-batches (one on the last stage),
    whatever the global batch; the chunked loss's transient scales with the chunk, not the tokens."""
    from elastic_plugin.ops._kd_loss import REFERENCE_CHUNK_ROWS
    from elastic_plugin.planning.activations import KD_REFERENCE_CHUNK_ROWS, kd_loss_bytes
    from elastic_plugin.planning.memory import rank_memory

    assert KD_REFERENCE_CHUNK_ROWS == REFERENCE_CHUNK_ROWS  # the planner's copy (no torch)
    from tests.support.elastic_cases import tiny_model

    model = tiny_model(TINY, "*E-*E-")
    stages = stage_params(model, 1, 2, 1)
    per_mb = [
        rank_memory(model, model, stages, 1, 2, 1, 1, False, False, Runtime(), 2, 128, m, True)
        for m in (2, 8, 32)
    ]
    assert per_mb[0].stage == per_mb[-1].stage
    assert len({(m.total, m.teacher_logits) for m in per_mb}) == 1
    tokens, vocab = 8192, 65536
    small, big = (kd_loss_bytes(tokens, vocab, 2, c)["transient"] for c in (256, 1024))
    grad = 2 * tokens * vocab  # the logits' gradient, whole
    assert (big - grad) == pytest.approx(4 * (small - grad))
    # unchunked: p_s - p_t (FP32) kept and FP32 copies of the BF16 logits, all of the tokens
    one, two = (kd_loss_bytes(t, vocab, 2, None) for t in (tokens, 2 * tokens))
    assert two["stored"] == 2 * one["stored"] == 2 * 4 * tokens * vocab
    assert 1.8 * one["transient"] < two["transient"] and one["transient"] > 4 * (big - grad)


def test_custom_device_yaml_names_the_field(tmp_path, capsys):
    good = {"name": "mini", "bf16_tflops": 100, "fp8_tflops": 200, "memory_gb": 0.001,
            "hbm_tbps": 1, "nvlink_gbps": 100, "network_gbps": 10, "nvlink_domain": 4}  # fmt: skip
    for change, message in (
        ({"memory_gb": -1}, "memory_gb=-1; allowed: a number > 0"),
        ({"nvlink_domain": 1.5}, "nvlink_domain=1.5; allowed: an integer >= 1"),
        ({"hbm": 3}, "unknown field(s) hbm"),
        ({"fp8_tflops": None}, "fp8_tflops=None"),
    ):
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump({**good, **change}))
        code, _, err = _run(["--config", TINY, "--gpus", "2", "--gpu", str(path)], capsys)
        assert code == 2 and message in err, err
    # a device too small for anything: exit 2 naming the closest layout and its shortfall
    path = tmp_path / "mini.yaml"
    path.write_text(yaml.safe_dump(good))
    code, out, err = _run(["--config", TINY, "--gpus", "2", "--gpu", str(path),
                           "--reserve-gb", "0"], capsys)  # fmt: skip
    assert code == 2
    assert "no layout fits mini: the closest" in err and "short by" in err, err
    assert "no " in out  # the table still lists the layouts, marked as not fitting


def test_plan_json_and_plot(tmp_path, capsys):
    png = tmp_path / "plan.png"
    code, out, _ = _run(
        ["--config", TINY, "--gpus", "4", "--gpu", "b200", "--global-batch-size", "64",
         "--bf16", "--json", "--plot", str(png), "--stage", "1e9:128", "--stage",
         "1e9:256:0.5/0.3/0.2", "--separate-tokens", "2e9"], capsys,
    )  # fmt: skip
    assert code == 0
    plan = json.loads(out)
    assert png.is_file() and png.stat().st_size > 0
    layouts = plan["layouts"]
    assert layouts and all(entry["fits"] for entry in layouts)
    for entry in layouts:
        lay = entry["layout"]
        assert lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"] == 4
        assert (lay["dp"] * lay["cp"]) % lay["ep"] == 0  # EP divides data x context parallel
        assert lay["tp"] == 1 or lay["sequence_parallel"]  # MoE with TP needs SP
        assert [b["budget"] for b in entry["budgets"]] == [1.0, 0.77, 0.4]
    speeds = [entry["tokens_per_s"] for entry in layouts]
    assert speeds == sorted(speeds, reverse=True)
    cur = layouts[0]["curriculum"]
    assert [s["seq_length"] for s in cur["stages"]] == [128, 256]
    assert cur["gpu_hours"] == pytest.approx(sum(s["gpu_hours"] for s in cur["stages"]))
    assert cur["separate_tokens_per_budget"] == 2e9
    assert set(cur["separate_gpu_hours"]) == {"1.0", "0.77", "0.4"}


# ----------------------------------------------------------------------------- measured
MEASURED = [
    {"tp": 2, "sequence_parallel": True},
    {"tp": 2, "pattern": "M*-M*-"},
    {"bf16": True},  # two DP replicas: each rank holds what one rank does
    {"distributed_optimizer": True, "bf16": True},
    {"pp": 2},
    {"ep": 2},
    # one micro-batch: the router's Gumbel draw may pick another nested model for another one
    {"tp": 2, "sequence_parallel": True, "budget": 0.77, "num_microbatches": 1},
    # context parallelism: K/V gathered per attention layer, Mamba's all-to-alls, the
    # gradients reduced over DP x CP; with the distributed optimizer sharded over DP x CP
    {"cp": 2},
    {"cp": 2, "distributed_optimizer": True, "bf16": True},
]


def _predicted(kw: dict, r: dict, world: int = 2):
    from tests.support.elastic_cases import _elastic_config, tiny_model

    model = tiny_model(TINY, kw.get("pattern"))
    tp, pp, ep, cp = kw.get("tp", 1), kw.get("pp", 1), kw.get("ep", 1), kw.get("cp", 1)
    dp = world // (tp * pp * cp)
    ecfg = _elastic_config(model, "sliced", False)
    resolved = ecfg.resolve(model, tp, ep)
    axes = {name: (len(spec.candidates), 1) for name, spec in resolved.axes.items()}
    router = elastic_router_tensors(len(resolved.budgets), axes, ecfg.router.hidden_size)
    stages = stage_params(model, tp, pp, ep, router)
    stage = r["stage"]
    bf16, dist_opt = kw.get("bf16", False), kw.get("distributed_optimizer", False)
    state = state_bytes(stages[stage], dp * cp, ep, bf16, dist_opt)
    state["teacher_weights"] = stages[stage].model * (2 if bf16 else 4)  # rank_memory's
    tokens = r["micro_batch"] * r["seq_length"] // cp
    last = stage == pp - 1
    # the teacher runs inside the schedule: one micro-batch's logits at a time on the last stage
    state["teacher_logits"] = teacher_logit_bytes(model, tokens, tp, 1, bf16) if last else 0
    nested = model_for_choice(model, r["choice"]) if r["choice"] else model
    comm = step_comm_bytes(
        model, nested, stage, stages, tp, pp, ep, dp, kw.get("sequence_parallel", False),
        dist_opt, bf16, r["micro_batch"], r["seq_length"], kw.get("num_microbatches", 2),
        cp=cp,
    )  # fmt: skip
    return stages[stage], state, comm


def _check_step(kw: dict, ranks: list[dict], world: int, report: list) -> None:
    """Every rank's measured state bytes and communication against the plan's."""
    routed: dict[tuple[str, str], float] = {}  # follows the routing per rank; summed: exact
    for r in ranks:
        assert len({json.dumps(c, sort_keys=True) for c in r["choices"]}) <= 1, r["choices"]
        params, state, comm = _predicted(kw, r, world)
        got = r["state"]
        assert got["param_numel"] == params.total, (kw, r["rank"])
        for key in ("weights", "grads", "teacher_weights", "teacher_logits"):
            assert got[key] == state[key], (kw, key, got, state)
        if kw.get("distributed_optimizer"):  # a rank's shard of the padded buffer
            assert state["optimizer"] - 12 * 64 * len(params.dense) <= got["optimizer"]
            assert got["optimizer"] <= state["optimizer"], (got, state)
        else:
            assert got["optimizer"] == state["optimizer"], (kw, got, state)
        counted = r["comm"]
        assert set(counted) == set(comm), (kw, counted, comm)
        for group, kinds in comm.items():
            assert set(counted[group]) == set(kinds), (kw, group, counted[group], kinds)
            for kind, predicted in kinds.items():
                measured = counted[group][kind]
                report.append((kw, r["rank"], group, kind, predicted, measured))
                if group == "ep" or (
                    group == "tp" and kw.get("ep", 1) > 1 and kind != "all_reduce"
                ):
                    key = (group, kind)
                    routed[key] = routed.get(key, 0.0) + measured - predicted
                elif kw.get("budget", 1.0) < 1.0 and kind == "all_reduce":
                    # the budget router's mask gradients under TP are not modelled
                    assert (
                        predicted <= measured <= predicted + 0.01 * sum(counted[group].values())
                    ), (kw, group, kind, predicted, measured)
                else:
                    assert measured == predicted, (kw, group, kind, predicted, measured)
    assert all(v == 0 for v in routed.values()), (kw, routed)


@pytest.mark.integration
def test_state_and_communication_bytes_equal_a_real_step(rank_pools, tmp_path):
    pool = rank_pools.get(2)
    report: list = []
    for i, kw in enumerate(MEASURED):
        ranks = pool.run(f"{CASES}:measure_step", config_path=TINY, workdir=str(tmp_path / str(i)),
                         **{"num_microbatches": 2, **kw})  # fmt: skip
        _check_step(kw, ranks, 2, report)
        if kw.get("distributed_optimizer"):  # the shards add up to the whole optimizer state
            assert (
                sum(r["state"]["optimizer"] for r in ranks) == 12 * ranks[0]["state"]["param_numel"]
            )
    for kw, rank, group, kind, predicted, measured in report:
        print(f"{kw} rank {rank} {group} {kind}: predicted {predicted:.0f} counted {measured}")


@pytest.mark.integration
def test_activations_within_20_percent_of_the_measured_peak(rank_pools, tmp_path):
    """One micro-batch (4 x 256 tokens, FP32, budget 1.0) of an attention / MoE / MLP model,
    with the tiny vocabulary (layers dominate) and a 2048 one (the distillation loss'
    ``[tokens, vocab]`` tensors dominate): the modelled stored activations + the largest transient
    vs the profiler's peak of the student's forward + backward. With Mamba layers, the model of
    the scan that runs here (``mamba_scan="torch"``, the pure-PyTorch chunked scan) is asserted;
    the fused kernels' (the default) keeps less than this scan and is below the peak."""
    from elastic_plugin.ops._loader import INFO
    from tests.support.elastic_cases import tiny_model

    cpu_kernels = INFO.uses_extension  # the loss's row passes compiled (ranks run on CPU)
    big = tmp_path / "vocab2048.yaml"
    raw = yaml.safe_load(Path(TINY).read_text())
    raw["model"]["vocab_size"] = 2048
    big.write_text(yaml.safe_dump(raw))
    for config, pattern, asserted in (
        (TINY, "*E-*E-", True),
        (str(big), "*E-*E-", True),
        (TINY, "M*E-M*E-", False),
    ):
        (r, _) = rank_pools.get(2).run(
            f"{CASES}:activation_peak", config_path=config,
            workdir=str(tmp_path / f"{pattern}{Path(config).stem}"), pattern=pattern,
            seq_len=256, micro_batch=4,
        )  # fmt: skip
        model = tiny_model(config, pattern)
        ratios = {}
        for scan in ("fused", "torch"):
            act = stage_activation_bytes(
                model, model.layer_types, True, True, 1024, 1, False, Runtime(), scan,
                cpu_kernels=cpu_kernels,
            )  # fmt: skip
            predicted = act["stored"] + act["transient"]
            ratios[scan] = predicted / r["peak"]
            print(f"{pattern} vocab {model.vocab_size} {scan} scan: predicted "
                  f"{predicted / 2**20:.2f} MiB, measured peak {r['peak'] / 2**20:.2f} MiB, "
                  f"ratio {ratios[scan]:.3f}")  # fmt: skip
        if asserted:  # no Mamba layer: the scan does not matter
            assert ratios["fused"] == ratios["torch"] and 0.8 <= ratios["fused"] <= 1.2, ratios
        else:
            assert 0.8 <= ratios["torch"] <= 1.2, ratios  # the scan that ran here
            assert ratios["fused"] < ratios["torch"]


@pytest.mark.integration
def test_context_parallel_activations_within_20_percent_of_the_measured_peak(rank_pools, tmp_path):
    """CP=2 on 2 ranks, one micro-batch of 4 x 256 tokens (each rank holds 4 x 128) of an
    attention / MoE / MLP model: the modelled activations of the held tokens, the gathered K/V
    included, against the profiler's peak on each rank."""
    from tests.support.elastic_cases import tiny_model

    ranks = rank_pools.get(2).run(
        f"{CASES}:activation_peak", config_path=TINY, workdir=str(tmp_path / "cp2"),
        pattern="*E-*E-", seq_len=256, micro_batch=4, cp=2,
    )  # fmt: skip
    model = tiny_model(TINY, "*E-*E-")
    act = stage_activation_bytes(
        model, model.layer_types, True, True, 512, 1, False, Runtime(), "fused", cp=2
    )
    predicted = act["stored"] + act["transient"]
    for r in ranks:
        ratio = predicted / r["peak"]
        print(f"CP2 rank: predicted {predicted / 2**20:.2f} MiB, measured peak "
              f"{r['peak'] / 2**20:.2f} MiB, ratio {ratio:.3f}")  # fmt: skip
        assert 0.8 <= ratio <= 1.2, ratio


@pytest.mark.integration
def test_pipeline_in_flight_activations(rank_pools, tmp_path):
    """PP2 (3 layers of '*E-*E-' per stage), 4 x 256 tokens per micro-batch: with 4
    micro-batches the first stage holds two at once under 1F1B, the last one; each stage's
    student-pass peak within 20% of in-flight x stored + transient."""
    from elastic_plugin.planning.memory import in_flight
    from elastic_plugin.planning.params import stage_layer_types
    from tests.support.elastic_cases import tiny_model

    pattern = "*E-*E-"
    model = tiny_model(TINY, pattern)
    kinds = stage_layer_types(model, 2)
    peaks: dict[tuple[int, int], int] = {}
    for m in (1, 4):
        for r in rank_pools.get(2).run(
            f"{CASES}:pipeline_activation_peak", config_path=TINY, workdir=str(tmp_path),
            pattern=pattern, seq_len=256, micro_batch=4, num_microbatches=m,
        ):  # fmt: skip
            stage = r["stage"]
            act = stage_activation_bytes(
                model, kinds[stage], stage == 0, stage == 1, 1024, 1, False, Runtime()
            )
            count = in_flight(stage, 2, m)
            predicted = count * act["stored"] + act["transient"]
            ratio = predicted / r["peak"]
            print(f"PP2 stage {stage}, {m} micro-batches ({count} in flight): predicted "
                  f"{predicted / 2**20:.2f} MiB, measured {r['peak'] / 2**20:.2f} MiB, "
                  f"ratio {ratio:.3f}")  # fmt: skip
            assert 0.8 <= ratio <= 1.2, (stage, m, ratio)
            peaks[stage, m] = r["peak"]
    assert 1.6 <= peaks[0, 4] / peaks[0, 1] <= 2.2  # two micro-batches in flight on stage 0
    assert peaks[1, 4] / peaks[1, 1] <= 1.2  # one on the last stage


# ----------------------------------------------------------------------------- the sweep
def _plan_json(path: Path, *extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_plugin.cli", "plan", "--config", TINY, "--gpus", "2",
         "--json", "--top", "50", *extra],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    path.write_text(proc.stdout)
    return json.loads(proc.stdout)


def _sweep(env: dict[str, str], local: str) -> subprocess.CompletedProcess:
    script = str(ROOT / "examples" / "slurm" / "sweep.sh")
    return subprocess.run(["bash", script], env={**env, "LOCAL": local}, capture_output=True,
                          text=True, cwd=ROOT, timeout=120)  # fmt: skip


def _check_sweep_commands(lines: list[str], expected: list[dict]) -> None:
    """Each command line runs its layout (TP, PP, EP, CP as planned) as a profiled sweep run."""
    assert len(lines) == len(expected)
    for line, lay in zip(lines, expected):
        words = shlex.split(line)
        assert "elastic-train" in words and words[words.index("--ckpt") + 1] == "CK"
        for flag, key in (("--tensor-model-parallel-size", "tp"),
                          ("--pipeline-model-parallel-size", "pp"),
                          ("--expert-model-parallel-size", "ep"),
                          ("--context-parallel-size", "cp")):  # fmt: skip
            assert words[words.index(flag) + 1] == str(lay[key])
        assert ("--sequence-parallel" in words) == (lay["tp"] > 1)
        assert ("--use-distributed-optimizer" in words) == lay["distributed_optimizer"]
        assert words[words.index("--log-interval") + 1] == "1"
        assert words[words.index("--global-batch-size") + 1] == "32"
        args = build_parser().parse_args(words[words.index("elastic_plugin.cli") + 1 :])
        assert args.command == "elastic-train" and args.log_interval == 1
        assert args.context_parallel_size == lay["cp"]
        # one curriculum stage of ITERS (10) iterations per budget
        assert args.elastic_curriculum == "10:1/0/0,10:0/1/0,10:0/0/1"
        assert args.train_iters == 30 and args.profile == 30  # profiled, no checkpoint


@pytest.mark.integration
def test_sweep_dry_run_lists_every_fitting_layout_context_parallel_ones_too(tmp_path):
    """TOP above the plan's size: every fitting layout the sbatch can run (SP whenever TP > 1),
    CP layouts with --context-parallel-size; a plan where only CP layouts fit runs those."""
    plan = _plan_json(tmp_path / "plan.json", "--global-batch-size", "32")
    env = {**os.environ, "DRY_RUN": "1", "PLAN": str(tmp_path / "plan.json"), "CKPT": "CK",
           "SWEEP_DIR": str(tmp_path / "sweep"), "TOP": "100", "GPUS_PER_NODE": "2",
           "PYTHON": sys.executable}  # fmt: skip
    expected = [
        e["layout"]
        for e in plan["layouts"]
        if e["fits"] and e["layout"]["sequence_parallel"] == (e["layout"]["tp"] > 1)
    ]
    assert 0 < len(expected) <= len(plan["layouts"]) < 100  # TOP=100 takes them all
    assert any(lay["cp"] > 1 for lay in expected) and any(lay["cp"] == 1 for lay in expected)
    for local in ("0", "1"):
        proc = _sweep(env, local)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.strip().splitlines()
        if local == "0":
            submit = lines.pop(0).split()
            assert submit[:5] == ["sbatch", "--array", f"0-{len(expected) - 1}", "--nodes", "1"]
        _check_sweep_commands(lines, expected)
    assert not (tmp_path / "sweep").exists()  # a dry run writes nothing

    # only the context-parallel layouts fit (as on a long-sequence stage): those run
    only_cp = {**plan, "layouts": [{**e, "fits": e["fits"] and e["layout"]["cp"] > 1}
                                   for e in plan["layouts"]]}  # fmt: skip
    (tmp_path / "cp_plan.json").write_text(json.dumps(only_cp))
    proc = _sweep({**env, "PLAN": str(tmp_path / "cp_plan.json")}, "1")
    assert proc.returncode == 0, proc.stderr
    _check_sweep_commands(proc.stdout.strip().splitlines(),
                          [lay for lay in expected if lay["cp"] > 1])  # fmt: skip
    none_fit = {**plan, "layouts": [{**e, "fits": False} for e in plan["layouts"]]}
    (tmp_path / "none.json").write_text(json.dumps(none_fit))
    proc = _sweep({**env, "PLAN": str(tmp_path / "none.json")}, "1")
    assert proc.returncode != 0 and "has no fitting layout to run" in proc.stderr


@pytest.mark.integration
def test_scaling_report_joins_measured_runs_with_the_plan(rank_pools, tmp_path, capsys):
    """Two layouts of 2 gloo ranks trained 3 iterations each as a sweep would (metrics every
    iteration, sweep.json with the plan's entry); scaling-report joins them."""
    plan = _plan_json(tmp_path / "plan.json", "--seq-length", "32", "--micro-batch-size", "2",
                      "--global-batch-size", "8")  # fmt: skip
    sweep = tmp_path / "sweep"
    # the first trains each budget in its own stage (as sweep.sh does), the second mixes them
    runs = {"00_tp2_sp": {"tp": 2, "sequence_parallel": True, "per_budget": True},
            "01_pp2": {"pp": 2, "per_budget": False},
            "02_cp2": {"cp": 2, "per_budget": False}}  # fmt: skip
    for name, kw in runs.items():
        layout = {"tp": 1, "pp": 1, "ep": 1, "cp": 1, "sequence_parallel": False,
                  "distributed_optimizer": False}  # fmt: skip
        layout.update((k, v) for k, v in kw.items() if k in layout)
        (entry,) = [e for e in plan["layouts"]
                    if all(e["layout"][k] == v for k, v in layout.items())]  # fmt: skip
        rank_pools.get(2).run(f"{CASES}:profile_layout", config_path=TINY, iters=2,
                              workdir=str(tmp_path), out=str(sweep / name), **kw)  # fmt: skip
        planned = {k: entry[k] for k in ("memory", "tokens_per_s", "step_seconds")}
        planned["budgets"] = [{"budget": b["budget"], "tokens_per_s": b["tokens_per_s"]}
                              for b in entry["budgets"]]  # fmt: skip
        (sweep / name / "sweep.json").write_text(
            json.dumps({"layout": entry["layout"], "gpus": 2, "planned": planned})
        )
    code = main(["scaling-report", str(sweep), "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == 0
    assert sorted(r["name"] for r in rows) == sorted(runs)
    for r in rows:
        if r["name"] in ("01_pp2", "02_cp2"):
            assert r["iterations"] == 1  # 2 logged, the first dropped as warm-up
        else:
            assert r["iterations"] == 5  # 2 per budget logged, the first dropped
            # every iteration trained one budget: per-budget medians, the plan's figure beside
            assert {k: b["iterations"] for k, b in r["budgets"].items()} == {
                "1": 1,
                "0.77": 2,
                "0.4": 2,
            }
            assert all(b["planned_tokens_per_s"] > 0 for b in r["budgets"].values())
        assert r["tokens_per_s"] > 0 and r["peak_memory_gib"] > 0 and r["gpus"] == 2
        # --profile: each rank's own figures, and no checkpoint left behind
        assert sorted(r["ranks"]) == ["0", "1"] and not (sweep / r["name"] / "checkpoints").exists()
        for rank in r["ranks"].values():
            assert rank["step_seconds"] > 0 and rank["tflops_per_rank"] > 0
            assert 0 < rank["peak_memory_gib"] <= r["peak_memory_gib"] + 1e-9
        assert r["memory_ratio"] == pytest.approx(r["peak_memory_gib"] / r["planned_memory_gib"])
        with capsys.disabled():
            print(
                f"\n{r['layout']}: measured {r['tokens_per_s']:.0f} tokens/s, "
                f"{r['peak_memory_gib']:.3f} GiB peak (CPU resident set); planned for an H100 "
                f"{r['planned_tokens_per_s']:.0f} tokens/s, {r['planned_memory_gib']:.3f} GiB"
            )
    for name in ("scaling_report.md", "scaling_report.json", "scaling_throughput.png",
                 "scaling_memory.png"):  # fmt: skip
        assert (sweep / name).stat().st_size > 0
    # bad input names the path
    assert main(["scaling-report", str(tmp_path / "nothing")]) == 2
    assert "no such directory" in capsys.readouterr().err


@pytest.mark.integration
def test_tp2_ep2_step_bytes_on_four_ranks(rank_pools, tmp_path):
    """TP2 x EP2 with SP, BF16 and the distributed optimizer (4 ranks): the routed tokens' TP
    gathers follow the routing per rank (summed: exact), the experts' weighted output is
    reduce-scattered in FP32, and the weights are all-gathered twice per step (Megatron chains a
    dense and an expert distributed optimizer, and each one's step gathers every buffer)."""
    kw = {"tp": 2, "ep": 2, "sequence_parallel": True, "distributed_optimizer": True,
          "bf16": True, "num_microbatches": 1}  # fmt: skip
    ranks = rank_pools.get(4).run(f"{CASES}:measure_step", config_path=TINY,
                                  workdir=str(tmp_path), **kw)  # fmt: skip
    report: list = []
    _check_step(kw, ranks, 4, report)
    for _, rank, group, kind, predicted, measured in report:
        print(f"TP2 EP2 rank {rank} {group} {kind}: predicted {predicted:.0f} counted {measured}")


@pytest.mark.integration
def test_plan_mamba_scan_flag_models_the_scan_that_runs(tmp_path):
    """``--mamba-scan torch`` (no mamba_ssm: the plugin's pure-PyTorch scan) plans more
    activation memory than mamba_ssm's fused kernels for a model with Mamba layers, and the
    same weights; an unknown scan is refused naming the flag and the allowed values."""
    fused = _plan_json(tmp_path / "fused.json", "--top", "1")["layouts"][0]
    torch_scan = _plan_json(tmp_path / "torch.json", "--top", "1", "--mamba-scan", "torch")
    torch_scan = torch_scan["layouts"][0]
    assert torch_scan["layout"] == fused["layout"]
    assert torch_scan["memory"]["weights"] == fused["memory"]["weights"]
    assert torch_scan["memory"]["activations"] > fused["memory"]["activations"]
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_plugin.cli", "plan", "--config", TINY, "--gpus", "2",
         "--mamba-scan", "triton"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "--mamba-scan" in proc.stderr and "fused" in proc.stderr
