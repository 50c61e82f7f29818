"""Train-then-export on GPT families (rank-pool cases): elastic training of a few iterations under
a multi-rank layout (PP2 for the tiny Llama, TP2 x EP2 for the tiny Qwen3-MoE), then, on one rank,
every budget extracted at TP=1 and exported as its family's Hugging Face directory (transformers'
logits vs the elastic model at that budget), a quantized nested directory with calibrated
activation scales and every budget sliced out of it vs its own export, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def train_case(
    config_path: str,
    workdir: str,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    iters: int = 2,
    choices: dict[str, Any] | None = None,
) -> str:
    """Every rank: a random init saved as reordered, ``iters`` elastic iterations under
    TP/PP/EP (synthetic tokens). Rank 0 then overwrites the stored choices with ``choices``
    (label -> sizes, one per layer where a list: what a converged, heterogeneous router would
    have chosen; a few iterations leave every budget near the full model) and returns the
    checkpoint."""
    from elastic_plugin.elastic.train import train_elastic
    from elastic_plugin.parallel import Layout
    from tests.support.elastic_cases import (
        _elastic_config,
        _experiment,
        _synthetic_iterator,
        tiny_schedule,
        write_init_checkpoint,
    )

    work = Path(workdir)
    cfg = _experiment(config_path, None)
    write_init_checkpoint(cfg, work / "init")
    layout = Layout(tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1)
    sched = tiny_schedule(iters, 2e-2, global_batch=8, micro_batch=4)
    run = train_elastic(
        cfg, _elastic_config(cfg.model, "sliced", False), layout, work / "init", work / "run",
        lambda c: _synthetic_iterator(cfg.model.vocab_size, 4, c), None, sched, progress=False,
    )  # fmt: skip
    ckpt = Path(run.checkpoint_dir)
    dist.barrier()
    if dist.get_rank() == 0 and choices:
        meta = json.loads((ckpt / "elastic_meta.json").read_text())
        meta["elastic"]["choices"].update(choices)
        (ckpt / "elastic_meta.json").write_text(json.dumps(meta))
    dist.barrier()
    return str(ckpt)


def _stock_loads(path: Path) -> dict[str, Any]:
    """What ``AutoModelForCausalLM.from_pretrained`` reports for an export (keys it missed or
    did not expect) and whether its weights are those of ``load_hf_model``'s model."""
    from transformers import AutoModelForCausalLM

    from elastic_plugin.export.hf import load_hf_model

    # with output_loading_info transformers returns (model, info); its stub says model only
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    stock, info = loaded
    ours, theirs = load_hf_model(path).state_dict(), stock.state_dict()
    return {
        "class": type(stock).__name__,
        "missing": list(info["missing_keys"]),
        "unexpected": list(info["unexpected_keys"]),
        "same_weights": sorted(ours) == sorted(theirs)
        and all(torch.equal(ours[k], v) for k, v in theirs.items()),
        "tied": bool(stock.config.tie_word_embeddings)
        and stock.lm_head.weight.data_ptr() == stock.model.embed_tokens.weight.data_ptr(),
    }


def export_case(ckpt: str, workdir: str, fmt: str) -> dict[str, Any]:
    """1 rank: every budget exported in fp32 (transformers' logits vs the elastic model's at that
    budget, TP=1); a ``fmt`` (fp8 / nvfp4) nested directory with calibrated input scales, each
    budget sliced out (``slice`` CLI) vs its own quantized export; serve-check of a sliced
    quantized budget and the per-layer export."""
    import numpy as np

    from elastic_plugin.checkpoint.hub import read_hub_tensors
    from elastic_plugin.data.indexed import write_indexed_dataset
    from elastic_plugin.export.extract import (
        QuantOptions,
        extract_nested,
        plan_extraction,
        run_extraction,
    )
    from elastic_plugin.export.hf import load_hf_model
    from elastic_plugin.export.nested_hf import load_nested, write_nested_export
    from elastic_plugin.export.quantize import same_bits
    from elastic_plugin.models.config import config_from_dict
    from tests.support.export_cases import _cli, _tokens, elastic_references

    work, ckpt_path = Path(workdir), Path(ckpt)
    meta = json.loads((ckpt_path / "elastic_meta.json").read_text())
    vocab = config_from_dict(meta["config"]).model.vocab_size
    refs = elastic_references(ckpt_path, vocab)
    tokens = _tokens(vocab)  # the tokens of elastic_references
    labels = sorted(meta["elastic"]["choices"], key=float, reverse=True)
    out: dict[str, Any] = {"choices": meta["elastic"]["choices"], "fp32": {}, "nested": {}}
    for label in labels:
        path = work / f"hf_{label}_fp32"
        extract_nested(ckpt_path, float(label), path, fmt="hf", dtype="fp32")
        config = json.loads((path / "config.json").read_text())
        with torch.no_grad():
            logits = load_hf_model(path)(tokens).logits
        row = {
            "architecture": config["architectures"][0],
            "layer_overrides": config.get("layer_overrides"),
            "diff": (logits - refs[label]).abs().max().item(),
        }
        if not config.get("layer_overrides"):
            row["stock"] = _stock_loads(path)
        out["fp32"][label] = row

    rng = np.random.default_rng(0)
    calib = str(work / "calib")
    write_indexed_dataset(calib, [rng.integers(0, vocab, 300) for _ in range(4)], vocab_size=vocab)
    quant = QuantOptions("error", calib_samples=4, calib_data=calib)
    # the plain nested directory's slicing is tests/test_families.py's (every family, from files)
    nested = work / f"nested_{fmt}"
    write_nested_export(ckpt_path, nested, None, "bf16", "100KB", fmt, quant)
    rows = {}
    for label in labels:
        own, sliced = work / f"hf_{label}_{fmt}", work / f"sliced_{label}_{fmt}"
        plan = plan_extraction(
            ckpt_path, float(label), own, fmt="hf", dtype="bf16", quantize=fmt, quant=quant
        )
        run_extraction(plan)
        code, stderr = _cli(["slice", "--hf", str(nested), "--budget", label, "--out", str(sliced)])
        a, b = read_hub_tensors(own), read_hub_tensors(sliced) if code == 0 else {}
        with torch.no_grad():
            loaded = load_nested(nested, float(label))(tokens).logits
            own_logits = load_hf_model(own)(tokens).logits
        rows[label] = {
            "exit": code,
            "stderr": stderr[-500:],
            "same_keys": sorted(a) == sorted(b),
            "bitwise": bool(b) and all(same_bits(a[k], b[k]) for k in a),
            "files_equal": all(
                (own / f).read_text() == (sliced / f).read_text()
                for f in ("config.json", "hf_quant_config.json")
            ),
            "input_scales": sum(k.endswith(".input_scale") for k in a),
            "load_nested_vs_export": (loaded - own_logits).abs().max().item(),
            "export_vs_elastic": ((own_logits - refs[label]).norm() / refs[label].norm()).item(),
        }
    out["nested"][fmt] = rows
    out["serve_check"] = {
        "nested_quantized_0.4": _cli(
            ["serve-check", str(work / f"nested_{fmt}"), "--budget", "0.4"]
        ),
        "hf_0.77_fp32": _cli(["serve-check", str(work / "hf_0.77_fp32")]),
    }
    return out
