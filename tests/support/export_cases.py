"""Rank cases for the export tests: a briefly trained tiny elastic checkpoint whose choice table
holds a homogeneous small model (0.4) and a per-layer one (0.77), the elastic model's logits at
each budget (the reference), and HF / quantized exports of them compared with it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from elastic_plugin.checkpoint.meta import read_checkpoint_meta

TOKENS = 24
SMALL = {
    "embedding": 64,
    "ffn": 128,
    "shared_ffn": 64,
    "attention_heads": 2,
    "mamba_heads": 4,
    "mamba_head_dim": 8,
    "experts": 4,
}
# one size per layer of each axis (layers in AxisSpec.layers order): a heterogeneous nested model
PER_LAYER = {
    "embedding": 96,
    "mamba_heads": [4, 8],
    "mamba_head_dim": [16, 8],
    "attention_heads": [2, 4],
    "experts": [8, 4],
    "shared_ffn": [64, 128],
    "ffn": [128, 256],
}


def killed_mid_save(write: Callable[[], Any]) -> str:
    """Run ``write`` with safetensors' ``save_file`` dying after it created its file (a job
    killed mid-save); returns the error it raised ("no error" if none)."""
    import safetensors.torch as st

    original = st.save_file

    def dying_save(tensors, filename, *args, **kwargs):
        Path(filename).write_bytes(b"partial")
        raise RuntimeError("killed mid-save")

    st.save_file = dying_save
    try:
        write()
        return "no error"
    except RuntimeError as exc:
        return str(exc)
    finally:
        st.save_file = original


def _quant_high_precision():
    """SMALL slices the Mamba head dim 16 -> 8: NVFP4 keeps those out_proj in high precision."""
    from elastic_plugin.export.extract import QuantOptions

    return QuantOptions("high-precision")


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, TOKENS), generator=torch.Generator().manual_seed(3))


def train_checkpoint(config_path: str, work: Path) -> Path:
    """Two elastic iterations of the tiny model, with the choice table set to SMALL / PER_LAYER."""
    from tests.support import elastic_cases as ec

    return ec.train_tiny_elastic(
        ec._experiment(config_path, None), work, choices={"0.4": SMALL, "0.77": PER_LAYER}
    )


def elastic_references(ckpt: Path, vocab: int) -> dict[str, torch.Tensor]:
    """The elastic model's fp32 logits at every budget of the stored table (and full)."""
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.model import build_elastic_chunks
    from elastic_plugin.models.config import config_from_dict
    from elastic_plugin.parallel import Layout, initialize_layout

    meta = read_checkpoint_meta(ckpt)
    initialize_layout(Layout())
    model_cfg = config_from_dict(meta["config"]).model
    resolved = ElasticConfig.from_dict(meta["config"]["elastic"]).resolve(model_cfg)
    chunks, state, _ = build_elastic_chunks(ckpt, Layout(), resolved, wrap_ddp=False)
    model = chunks[0].eval()
    tokens = _tokens(vocab)
    position = torch.arange(TOKENS).expand(2, TOKENS)
    out = {}
    with torch.no_grad():
        for label, choice in meta["elastic"]["choices"].items():
            state.set_sizes(choice)
            out[label] = model(tokens, position, None).clone()
        state.clear()
        out["full"] = model(tokens, position, None).clone()
    return out


def hf_logits(path: Path, vocab: int) -> torch.Tensor:
    from elastic_plugin.export.hf import load_hf_model

    with torch.no_grad():
        return load_hf_model(path)(_tokens(vocab)).logits


def hf_export_case(config_path: str, workdir: str) -> dict[str, Any]:
    """1 rank: train, take references, export 0.4 (homogeneous) and 0.77 (per layer) in fp32,
    bf16, FP8 and NVFP4, and compare each with the elastic model; then an interrupted export."""
    from elastic_plugin.export.extract import extract_nested
    from elastic_plugin.models.config import ConfigError, load_config

    work = Path(workdir)
    vocab = load_config(config_path).model.vocab_size
    ckpt = train_checkpoint(config_path, work)
    refs = elastic_references(ckpt, vocab)
    rows = []
    for budget in (0.4, 0.77):
        for dtype, quantize in (("fp32", None), ("bf16", None), ("bf16", "fp8"), ("bf16", "nvfp4")):
            out = work / f"hf_{budget:g}_{quantize or dtype}"
            summary = extract_nested(
                ckpt,
                budget,
                out,
                fmt="hf",
                dtype=dtype,
                quantize=quantize,
                quant=_quant_high_precision() if quantize else None,
            )
            ref = refs[f"{budget:g}"]
            logits = hf_logits(out, vocab)
            rows.append(
                {
                    "budget": budget,
                    "dtype": dtype,
                    "quantize": quantize,
                    "summary": summary,
                    "files": sorted(p.name for p in out.iterdir()),
                    "config": json.loads((out / "config.json").read_text()),
                    "diff": (logits - ref).abs().max().item(),
                    "rel": ((logits - ref).norm() / ref.norm()).item(),
                    "vs_full": (ref - refs["full"]).abs().max().item(),
                }
            )
    try:
        extract_nested(ckpt, 0.77, work / "megatron_per_layer")
        per_layer_megatron = ""
    except ConfigError as exc:
        per_layer_megatron = str(exc)

    # interrupted: the safetensors write dies after creating a file in <out>.tmp
    out = work / "interrupted"
    interrupted = killed_mid_save(lambda: extract_nested(ckpt, 0.4, out, fmt="hf"))
    after = {"out": out.exists(), "tmp": out.with_name(out.name + ".tmp").exists()}
    extract_nested(ckpt, 0.4, out, fmt="hf", dtype="fp32")
    rerun = (hf_logits(out, vocab) - refs["0.4"]).abs().max().item()
    return {
        "rows": rows,
        "per_layer_megatron": per_layer_megatron,
        "interrupted": interrupted,
        "after_crash": after,
        "rerun_diff": rerun,
        "rerun_tmp": out.with_name(out.name + ".tmp").exists(),
    }


def nested_export_case(config_path: str, workdir: str) -> dict[str, Any]:
    """1 rank: one nested BF16 directory of a trained checkpoint; every budget sliced from it
    (``slice`` CLI and ``load_nested``) against that budget's own BF16 export; bad input."""
    import contextlib
    import io

    from elastic_plugin.checkpoint.hub import from_hub, read_hub_tensors
    from elastic_plugin.cli import main
    from elastic_plugin.export.extract import extract_nested
    from elastic_plugin.export.nested_hf import load_nested, slice_nested, write_nested_export
    from elastic_plugin.models.config import load_config

    work = Path(workdir)
    vocab = load_config(config_path).model.vocab_size
    ckpt = train_checkpoint(config_path, work)
    nested = write_nested_export(ckpt, work / "nested", max_shard_size="100KB")
    rows = []
    for budget in (1.0, 0.77, 0.4):
        label = f"{budget:g}"
        own = work / f"hf_{label}"
        extract_nested(ckpt, budget, own, fmt="hf", dtype="bf16")
        sliced = work / f"sliced_{label}"
        with contextlib.redirect_stdout(io.StringIO()):
            code = main(
                ["slice", "--hf", str(work / "nested"), "--budget", label, "--out", str(sliced)]
            )
        a, b = from_hub(read_hub_tensors(own)), from_hub(read_hub_tensors(sliced))
        with torch.no_grad():
            loaded = load_nested(work / "nested", budget)(_tokens(vocab)).logits
        rows.append(
            {
                "budget": budget,
                "exit": code,
                "same_keys": sorted(a) == sorted(b),
                "bitwise": all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a),
                "config_equal": json.loads((own / "config.json").read_text())
                == json.loads((sliced / "config.json").read_text()),
                "load_nested_vs_export": (loaded - hf_logits(own, vocab)).abs().max().item(),
                "bytes_own": sum(p.stat().st_size for p in own.iterdir()),
            }
        )
    # a slice killed while writing its weights leaves only <out>.tmp; a rerun replaces it
    killed = work / "killed"
    interrupted = killed_mid_save(lambda: slice_nested(work / "nested", 0.4, killed))
    after_kill = {"out": killed.exists(), "tmp": killed.with_name(killed.name + ".tmp").exists()}
    slice_nested(work / "nested", 0.4, killed)
    rerun = from_hub(read_hub_tensors(killed))
    rerun_equal = all(
        torch.equal(rerun[k], v) for k, v in from_hub(read_hub_tensors(work / "hf_0.4")).items()
    )
    errors = {}
    for name, argv in {
        "untrained": [
            "slice",
            "--hf",
            str(work / "nested"),
            "--budget",
            "0.5",
            "--out",
            str(work / "x"),
        ],
        "not_nested": [
            "slice",
            "--hf",
            str(work / "hf_0.4"),
            "--budget",
            "0.4",
            "--out",
            str(work / "y"),
        ],
        "out_taken": [
            "slice",
            "--hf",
            str(work / "nested"),
            "--budget",
            "0.4",
            "--out",
            str(work / "hf_0.4"),
        ],
    }.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(argv)
        errors[name] = {
            "exit": code,
            "stderr": err.getvalue(),
            "written": (work / "x").exists() or (work / "y").exists(),
        }
    return {
        "nested": nested,
        "files": sorted(p.name for p in (work / "nested").iterdir()),
        "nested_config": json.loads((work / "nested" / "nested_config.json").read_text()),
        "rows": rows,
        "errors": errors,
        "interrupted": interrupted,
        "after_kill": after_kill,
        "rerun_equal": rerun_equal,
        "rerun_tmp": killed.with_name(killed.name + ".tmp").exists(),
    }


def serve_check_case(config_path: str, workdir: str) -> dict[str, Any]:
    """1 rank: ``serve-check`` on every export format of a trained checkpoint (HF fp32 / bf16 /
    FP8 / NVFP4, per-layer, a nested directory's budget), on a tampered export, and on bad input."""
    import contextlib
    import io
    import shutil

    from safetensors.torch import load_file, save_file

    from elastic_plugin.cli import main
    from elastic_plugin.export.extract import extract_nested
    from elastic_plugin.export.nested_hf import write_nested_export

    work = Path(workdir)
    ckpt = train_checkpoint(config_path, work)
    exports = {}
    for budget, dtype, quantize in (
        (1.0, "bf16", None),
        (0.4, "fp32", None),
        (0.4, "bf16", "fp8"),
        (0.4, "bf16", "nvfp4"),
        (0.77, "fp32", None),
    ):
        name = f"hf_{budget:g}_{quantize or dtype}"
        extract_nested(
            ckpt,
            budget,
            work / name,
            fmt="hf",
            dtype=dtype,
            quantize=quantize,
            quant=_quant_high_precision() if quantize else None,
        )
        exports[name] = [str(work / name)]
    write_nested_export(ckpt, work / "nested")
    exports["nested_0.77"] = [str(work / "nested"), "--budget", "0.77"]
    tampered = work / "tampered"
    shutil.copytree(work / "hf_0.4_fp32", tampered)
    weights = load_file(str(tampered / "model.safetensors"))
    key = "backbone.layers.1.mixer.k_proj.weight"
    weights[key] = weights[key] * 1.5
    save_file(weights, str(tampered / "model.safetensors"), metadata={"format": "pt"})
    damaged = work / "damaged"  # the altered file with the digests recorded at export
    shutil.copytree(tampered, damaged)
    exports["damaged"] = [str(damaged)]
    meta = json.loads((tampered / "export_meta.json").read_text())
    del meta["files"]  # a wrong export that looks intact (written without digests)
    (tampered / "export_meta.json").write_text(json.dumps(meta))
    exports["tampered"] = [str(tampered)]
    exports["nested_without_budget"] = [str(work / "nested")]
    exports["budget_on_plain"] = [str(work / "hf_0.4_fp32"), "--budget", "0.4"]
    results = {}
    for name, argv in exports.items():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["serve-check", *argv, "--json"])
        text = out.getvalue()
        results[name] = {
            "exit": code,
            "result": json.loads(text[text.index("{") :]) if "{" in text else None,
            "stderr": err.getvalue(),
        }
    results["verify"] = {
        name: _cli(["verify", str(work / name)]) for name in ("hf_0.4_fp32", "nested", "damaged")
    }
    return results


def _cli(argv: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of one ``elastic-plugin`` command run in this process."""
    import contextlib
    import io

    from elastic_plugin.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


def quantized_nested_case(config_path: str, workdir: str) -> dict[str, Any]:
    """1 rank: FP8 / NVFP4 nested directories with calibrated activation scales; every budget
    sliced from them (``slice`` CLI, ``load_nested``) against that budget's own quantized
    export; serve-check on a sliced and a calibrated export; bad input before anything is
    written."""
    import numpy as np

    from elastic_plugin.checkpoint.hub import from_hub, read_hub_tensors
    from elastic_plugin.data.indexed import write_indexed_dataset
    from elastic_plugin.export.extract import QuantOptions, plan_extraction, run_extraction
    from elastic_plugin.export.hf import export_input_amax, read_quant_config
    from elastic_plugin.export.nested_hf import budget_input_amax, load_nested, write_nested_export
    from elastic_plugin.export.quantize import same_bits
    from elastic_plugin.models.config import load_config

    work = Path(workdir)
    vocab = load_config(config_path).model.vocab_size
    ckpt = train_checkpoint(config_path, work)
    rng = np.random.default_rng(0)
    calib = str(work / "calib")  # the user's calibration text, as an indexed dataset
    write_indexed_dataset(calib, [rng.integers(0, vocab, 300) for _ in range(4)], vocab_size=vocab)
    quant = QuantOptions("high-precision", calib_samples=6, calib_data=calib)
    out: dict[str, Any] = {"formats": {}}
    for fmt in ("fp8", "nvfp4"):
        nested = work / f"nested_{fmt}"
        write_nested_export(ckpt, nested, None, "bf16", "100KB", fmt, quant)
        rows = {}
        for budget in (1.0, 0.77, 0.4):
            label = f"{budget:g}"
            own = work / f"hf_{label}_{fmt}"
            plan = plan_extraction(
                ckpt, budget, own, fmt="hf", dtype="bf16", quantize=fmt, quant=quant
            )
            run_extraction(plan)
            sliced = work / f"sliced_{label}_{fmt}"
            code, _ = _cli(["slice", "--hf", str(nested), "--budget", label, "--out", str(sliced)])
            a, b = from_hub(read_hub_tensors(own)), from_hub(read_hub_tensors(sliced))
            with torch.no_grad():
                loaded = load_nested(nested, budget)(_tokens(vocab)).logits
            rows[label] = {
                "exit": code,
                "same_keys": sorted(a) == sorted(b),
                "bitwise": all(same_bits(a[k], b[k]) for k in a),
                "files_equal": {
                    name: (own / name).read_text() == (sliced / name).read_text()
                    for name in ("config.json", "hf_quant_config.json")
                },
                "load_nested_vs_export": (loaded - hf_logits(own, vocab)).abs().max().item(),
                "input_amax": export_input_amax(own)[1],
                "nested_amax": budget_input_amax(nested, budget),
                "input_scales": sorted(k for k in a if k.endswith(".input_scale")),
                "quantized": sorted(k for k in a if k.endswith(".weight_scale")),
                "bytes_own": sum(p.stat().st_size for p in own.iterdir()),
            }
        out["formats"][fmt] = {
            "rows": rows,
            "nested_bytes": sum(p.stat().st_size for p in nested.iterdir()),
            # in transformers' module names (the file holds the Hub's)
            "exclude": (read_quant_config(nested)[1] or {})["quantization"]["exclude_modules"],
        }
    out["serve_check"] = {
        name: _cli(["serve-check", *argv])[0]
        for name, argv in {
            "nested_nvfp4_0.4": [str(work / "nested_nvfp4"), "--budget", "0.4"],
            "hf_0.77_fp8": [str(work / "hf_0.77_fp8")],
        }.items()
    }
    base = ["extract", "--ckpt", str(ckpt), "--budget", "0.4", "--format", "hf"]
    errors = {}
    for name, (argv, target) in {
        "nvfp4_unaligned": (["--quantize", "nvfp4", "--out"], "e1"),
        "calib_without_quantize": (["--calib-samples", "4", "--out"], "e2"),
        "calib_data_missing": (
            [
                "--quantize",
                "fp8",
                "--calib-samples",
                "4",
                "--calib-data",
                str(work / "no"),
                "--out",
            ],
            "e3",
        ),
        "calib_too_short": (
            ["--quantize", "fp8", "--calib-samples", "999", "--calib-data", calib, "--out"],
            "e4",
        ),
        "bad_policy": (["--quantize", "nvfp4", "--nvfp4-unaligned", "keep", "--out"], "e5"),
    }.items():
        code, stderr = _cli([*base, *argv, str(work / target)])
        written = (work / target).exists() or (work / f"{target}.tmp").exists()
        errors[name] = {"exit": code, "stderr": stderr, "written": written}
    out["errors"] = errors
    return out
