"""Hugging Face NemotronH export: a Megatron HybridModel (plain, nested, or with per-layer widths)
written as safetensors + config.json gives the same logits in ``transformers`` as in Megatron;
FP8 / NVFP4 exports are smaller and close; bad input is refused before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml")
TOL = 1e-5


@pytest.fixture(scope="module")
def plain():
    """The tiny Megatron model with no constant tensors (a wrong mapping shows in the logits)."""
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.models.config import load_config
    from elastic_plugin.parallel import (
        Layout,
        build_model_chunks,
        init_distributed,
        initialize_layout,
    )

    enable_cpu_megatron()
    init_distributed()
    initialize_layout(Layout(), seed=11)
    cfg = load_config(CONFIG).model
    model = build_model_chunks(cfg, Layout(), wrap_ddp=False)[0][0].eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for tensor in [
            *model.parameters(),
            *(b for n, b in model.named_buffers() if n.endswith("expert_bias")),
        ]:
            tensor.add_(0.1 * torch.randn(tensor.shape, generator=gen))
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=gen)
    with torch.no_grad():
        logits = model(tokens, torch.arange(40).expand(2, 40), None)
    return cfg, model, tokens, logits


def test_plain_model_round_trips_and_loads_in_stock_transformers(plain, tmp_path):
    from transformers import AutoModelForCausalLM

    from elastic_plugin.export.hf import (
        hf_config,
        hf_to_megatron,
        megatron_to_hf,
        write_hf_checkpoint,
    )

    cfg, model, tokens, reference = plain
    state = model.state_dict()
    hf = megatron_to_hf(state, cfg)
    assert hf["model.layers.1.mixer.q_proj.weight"].shape == (4 * 32, 128)
    assert hf["model.layers.1.mixer.k_proj.weight"].shape == (2 * 32, 128)
    assert hf["model.layers.2.mixer.experts.up_proj"].shape == (8, 128, 128)
    back = hf_to_megatron(hf, cfg)
    expected = {k for k in state if not k.endswith("_extra_state")}
    assert set(back) == expected and all(torch.equal(back[k], state[k]) for k in back)

    config = hf_config(hf, cfg, "fp32")
    assert "layer_overrides" not in config and config["hybrid_override_pattern"] == "M*E-M*E-"
    write_hf_checkpoint(tmp_path, hf, config, "fp32")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf_model).__name__ == "NemotronHForCausalLM"
    with torch.no_grad():
        logits = hf_model(tokens).logits
    diff = (logits - reference).abs().max().item()
    print(f"max |HF - Megatron| = {diff:.2e}")
    assert diff <= TOL


def test_a_wrong_layout_is_caught(plain, tmp_path):
    """The reference check can fail: K and V exchanged in the split changes the logits."""
    from elastic_plugin.export.hf import (
        hf_config,
        load_hf_model,
        megatron_to_hf,
        write_hf_checkpoint,
    )

    cfg, model, tokens, reference = plain
    hf = megatron_to_hf(model.state_dict(), cfg)
    k, v = "model.layers.1.mixer.k_proj.weight", "model.layers.1.mixer.v_proj.weight"
    hf[k], hf[v] = hf[v], hf[k]
    write_hf_checkpoint(tmp_path, hf, hf_config(hf, cfg, "fp32"), "fp32")
    with torch.no_grad():
        diff = (load_hf_model(tmp_path)(tokens).logits - reference).abs().max().item()
    assert diff > 1e-3


def test_bad_models_and_flags_are_refused_naming_the_field(tiny, tmp_path):
    import dataclasses

    from elastic_plugin.export.extract import _check_format
    from elastic_plugin.export.hf_compat import check_hf_compatible
    from elastic_plugin.models.config import ConfigError

    for change, field in (
        ({"activation": "swiglu"}, "model.activation"),
        ({"position_embedding_type": "rope"}, "model.position_embedding_type"),
        ({"moe_router_score_function": "softmax"}, "model.moe_router_score_function"),
        ({"layernorm_epsilon": 1e-6}, "model.layernorm_epsilon"),
    ):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            check_hf_compatible(dataclasses.replace(tiny, **change))
    check_hf_compatible(tiny)
    cases = [
        (("onnx", None, None, None), "--format 'onnx': allowed: megatron, hf"),
        (("hf", None, "int4", None), "--quantize 'int4': allowed: fp8, nvfp4"),
        (("hf", "fp64", None, None), "--dtype 'fp64': allowed: bf16, fp16, fp32"),
        (("megatron", None, "fp8", None), "--quantize goes with --format hf"),
        (("megatron", "bf16", None, None), "--dtype goes with --format hf"),
        (("hf", None, None, (2, 1, 1)), "--target-* layouts go with --format megatron"),
    ]
    for args, message in cases:
        with pytest.raises(ConfigError) as err:
            _check_format(*args, tiny)
        assert message in str(err.value)
    assert _check_format("hf", None, "nvfp4", None, tiny) == "bf16"


@pytest.fixture(scope="module")
def exported(rank_pools, tmp_path_factory):
    work = tmp_path_factory.mktemp("hf_export")
    (result,) = rank_pools.get(1).run(
        "tests.support.export_cases:hf_export_case", config_path=CONFIG, workdir=str(work)
    )
    return work, result


@pytest.mark.integration
def test_nested_hf_exports_give_the_elastic_logits(exported):
    """fp32 exports of the homogeneous (0.4) and per-layer (0.77) nested models equal the
    elastic model at that budget; bf16 is close; the nested models really differ from full."""
    _, r = exported
    for row in r["rows"]:
        print(
            f"budget {row['budget']:g} {row['quantize'] or row['dtype']}: "
            f"max diff {row['diff']:.2e}, rel {row['rel']:.2e}, bytes {row['summary']['bytes']}"
        )
        assert row["vs_full"] > 1e-3
        assert {"config.json", "model.safetensors", "export_meta.json"} <= set(row["files"])
        if row["dtype"] == "fp32":
            assert row["diff"] <= TOL, row
        elif row["quantize"] is None:
            assert row["rel"] < 0.02, row
    by = {(row["budget"], row["quantize"] or row["dtype"]): row for row in r["rows"]}
    per_layer = by[(0.77, "fp32")]["config"]
    assert per_layer["layer_overrides"] == {
        "4": {"mamba_num_heads": 8, "mamba_head_dim": 8},
        "5": {"num_attention_heads": 4},
        "6": {"n_routed_experts": 4, "moe_shared_expert_intermediate_size": 128},
        "7": {"intermediate_size": 256},
    }
    assert per_layer["hidden_size"] == 96
    small = by[(0.4, "fp32")]["config"]
    assert "layer_overrides" not in small and small["hidden_size"] == 64
    assert small["n_routed_experts"] == 4 and small["mamba_num_heads"] == 4
    assert (
        by[(0.4, "fp32")]["summary"]["params"]["total"]
        < by[(0.77, "fp32")]["summary"]["params"]["total"]
    )
    for budget in (0.4, 0.77):  # bf16 halves the fp32 bytes (up to the small json files)
        ratio = by[(budget, "bf16")]["summary"]["bytes"] / by[(budget, "fp32")]["summary"]["bytes"]
        assert 0.45 < ratio < 0.55, ratio
    assert (
        "per-layer sizes" in r["per_layer_megatron"] and "Hugging Face" in r["per_layer_megatron"]
    )


@pytest.mark.integration
def test_quantized_exports_are_smaller_and_close(exported):
    _, r = exported
    by = {(row["budget"], row["quantize"] or row["dtype"]): row for row in r["rows"]}
    for budget in (0.4, 0.77):
        bf16, fp8, nvfp4 = (by[(budget, k)] for k in ("bf16", "fp8", "nvfp4"))
        assert "hf_quant_config.json" in fp8["files"] and "hf_quant_config.json" in nvfp4["files"]
        assert nvfp4["summary"]["bytes"] < fp8["summary"]["bytes"] < bf16["summary"]["bytes"]
        # quantization error: small but real (a no-op quantizer would give bf16's error)
        assert bf16["rel"] < fp8["rel"] < 0.1 and fp8["rel"] < nvfp4["rel"] < 0.3, (fp8, nvfp4)


@pytest.mark.integration
def test_interrupted_hf_export_leaves_no_output(exported):
    _, r = exported
    assert r["interrupted"] == "killed mid-save"
    assert r["after_crash"] == {"out": False, "tmp": True}
    assert r["rerun_diff"] <= TOL and not r["rerun_tmp"]


def test_cli_flags_are_checked_before_loading(tmp_path, monkeypatch, capsys):
    """extract --format/--dtype/--quantize and export's own flags: exit 2 naming the flag,
    nothing written; a per-layer budget is accepted for --format hf."""
    import elastic_plugin.export.cli as extract_cli
    import elastic_plugin.export.report as report
    from elastic_plugin.cli import main
    from elastic_plugin.export.extract import plan_extraction
    from tests.test_elastic_extract import _fake_ckpt

    def refuse(*_args, **_kwargs):
        raise AssertionError("bad input reached the work")

    monkeypatch.setattr(extract_cli, "run_extraction", refuse)
    monkeypatch.setattr(report, "load_source", refuse)
    good = _fake_ckpt(tmp_path / "good")
    hetero = _fake_ckpt(
        tmp_path / "hetero",
        elastic={
            "budgets": [1.0, 0.5],
            "choices": {"1": {"ffn": [256, 256]}, "0.5": {"ffn": [256, 128]}},
        },
    )
    out = tmp_path / "out"
    base = ["extract", "--ckpt", str(good), "--budget", "0.4", "--out", str(out)]
    for extra, message in (
        (["--format", "onnx"], "--format 'onnx': allowed: megatron, hf"),
        (["--format", "hf", "--quantize", "int8"], "--quantize 'int8': allowed: fp8, nvfp4"),
        (["--quantize", "fp8"], "--quantize goes with --format hf"),
        (
            ["--format", "hf", "--target-tensor-model-parallel-size", "2"],
            "--target-* layouts go with --format megatron",
        ),
    ):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert message in err, err
    for extra, message in (
        (["--precisions", "bf16,int4"], "--precisions bf16,int4: allowed: bf16, fp8, nvfp4"),
        (["--eval-sequences", "-1"], "--eval-sequences -1: must be >= 0"),
    ):
        assert main(["export", "--ckpt", str(good), "--out", str(out), *extra]) == 2
        assert message in capsys.readouterr().err
    assert not out.exists()
    plan = plan_extraction(hetero, 0.5, out, fmt="hf", quantize="nvfp4")
    assert plan.choice == {"ffn": [256, 128]} and plan.dtype == "bf16"
    # export skips the Megatron checkpoint of a per-layer budget and plans the HF ones
    jobs = report._plans(hetero, out, ["bf16"], megatron=True)
    assert [(j.budget, j.precision) for j in jobs] == [
        (1.0, "megatron"),
        (1.0, "bf16"),
        (0.5, "bf16"),
    ]
