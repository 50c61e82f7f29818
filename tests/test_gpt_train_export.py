"""Train, then export, on GPT families: a few elastic iterations of the tiny Llama (tied
embeddings) under PP=2 and of the tiny Qwen3-MoE under TP=2 x EP=2, then every budget extracted
at TP=1 and exported. References: transformers' own classes (logits of each fp32 export vs the
elastic model at that budget, fp32 <= 1e-4; stock ``from_pretrained`` finds every weight of a
homogeneous export), and each budget's own export (the same budget sliced out of an FP8 / NVFP4
nested directory with calibrated input scales, equal bit for bit). The stored
choices are set as a converged router would have chosen them: 0.4 homogeneous, 0.77 one width
per layer, which is written with ``layer_overrides`` (docs/export-and-serve.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
CASES = "tests.support.gpt_export_cases"
TOL = 1e-4
# weight-only (load_hf_model dequantizes) vs the elastic model on these briefly trained random
# models, measured: fp8 0.03, nvfp4 0.10-0.27 (serve-check adds the activations)
REL = {"fp8": 0.1, "nvfp4": 0.5}
RUNS = {
    # name: (config, layout, stored choices (0.77 per layer), quantized format)
    "llama_pp2": (
        "tiny_llama.yaml",
        {"pp": 2},
        {
            "0.77": {"embedding": 96, "attention_heads": [4, 2, 2, 4], "ffn": [256, 128, 192, 128]},
            "0.4": {"embedding": 64, "attention_heads": 2, "ffn": 128},
        },
        "fp8",
    ),
    "qwen3_moe_tp2_ep2": (
        "tiny_qwen3_moe.yaml",
        {"tp": 2, "ep": 2},
        {
            "0.77": {
                "embedding": 96,
                "attention_heads": [4, 2, 4, 2],
                "ffn": [128],
                "experts": [8, 4, 6],
            },
            "0.4": {"embedding": 64, "attention_heads": 2, "ffn": 128, "experts": 4},
        },
        "nvfp4",
    ),
}


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request, rank_pools, tmp_path_factory):
    config, layout, choices, fmt = RUNS[request.param]
    work = tmp_path_factory.mktemp(request.param)
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("ep", 1)  # DP = EP here
    results = rank_pools.get(world).run(
        f"{CASES}:train_case",
        config_path=str(CONFIGS / config),
        workdir=str(work / "train"),
        choices=choices,
        **layout,
    )
    (result,) = rank_pools.get(1).run(
        f"{CASES}:export_case", ckpt=results[0], workdir=str(work), fmt=fmt
    )
    return request.param, fmt, result


def test_every_budget_exports_with_the_elastic_models_logits(run):
    name, _, result = run
    architecture = "LlamaForCausalLM" if name.startswith("llama") else "Qwen3MoeForCausalLM"
    assert set(result["fp32"]) == {"1", "0.77", "0.4"}
    for label, row in result["fp32"].items():
        print(f"{name} {label}: max |transformers - elastic| = {row['diff']:.2e}")
        assert row["architecture"] == architecture
        assert row["diff"] <= TOL, (label, row)
        if label == "0.77":  # per-layer widths: transformers' layers built per config
            assert row["layer_overrides"], row
            continue
        stock = row["stock"]
        assert stock["class"] == architecture
        assert not stock["missing"] and not stock["unexpected"], stock
        assert stock["same_weights"]
        assert stock["tied"] == name.startswith("llama")  # tied embeddings stay tied


def test_a_budget_sliced_from_a_nested_directory_is_its_own_export(run):
    name, fmt, result = run
    assert set(result["nested"]) == {fmt}
    for kind, rows in result["nested"].items():
        for label, row in rows.items():
            assert row["exit"] == 0, (kind, label, row["stderr"])
            assert row["same_keys"] and row["bitwise"] and row["files_equal"], (kind, label)
            assert row["load_nested_vs_export"] == 0.0, (kind, label, row)
            assert row["export_vs_elastic"] < REL[kind], (kind, label, row)
            assert row["input_scales"] > 0, (kind, label, row)  # calibrated, per budget


def test_serve_check_passes_a_sliced_quantized_budget_and_per_layer_export(run):
    _, _, result = run
    for what, (code, stderr) in result["serve_check"].items():
        assert code == 0, (what, stderr)
