"""Hugging Face exports in the Hub's Nemotron-H layout (what the released checkpoints, transformers'
own ``save_pretrained``, vLLM and Megatron-Bridge read): ``backbone.*`` keys, one tensor per
routed expert, sharded safetensors with ``model.safetensors.index.json``, ``generation_config.json``
and the tokenizer files. The reference is transformers itself: a model loaded from our files and
saved again with ``save_pretrained`` writes the same keys, tensors and shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def tiny_hub():
    """The tiny_hub Megatron model, perturbed (so a wrong mapping shows), and its HF tensors."""
    from elastic_plugin.export.hf import megatron_to_hf
    from tests.support.inference_cases import tiny_inference_model

    model, cfg = tiny_inference_model(seed=13)
    return cfg, model, megatron_to_hf(model.state_dict(), cfg)


@pytest.fixture(scope="module")
def tiny_hf(tiny_hub):
    """The tiny_hub model in transformers' names with its config.json."""
    from elastic_plugin.export.hf import hf_config

    cfg, _, hf = tiny_hub
    return cfg, hf, hf_config(hf, cfg, "fp32", {"pad": 0, "eos": 1})


def _stored(path: Path) -> dict[str, torch.Tensor]:
    from elastic_plugin.checkpoint.hub import read_hub_tensors

    return read_hub_tensors(path)


def test_export_is_what_save_pretrained_writes(tiny_hf, tmp_path):
    from transformers import AutoModelForCausalLM

    from elastic_plugin.checkpoint.hub import HUB_INDEX
    from elastic_plugin.export.hf import write_hf_checkpoint

    cfg, hf, config = tiny_hf
    ours = tmp_path / "ours"
    ours.mkdir()
    write_hf_checkpoint(ours, hf, config, "fp32", max_shard_bytes=200_000)
    index = json.loads((ours / HUB_INDEX).read_text())
    shards = sorted({f for f in index["weight_map"].values()})
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    for shard in shards:  # no shard over the limit unless it holds one tensor that is
        tensors = json.loads(_header(ours / shard))
        sizes = [
            v["data_offsets"][1] - v["data_offsets"][0]
            for k, v in tensors.items()
            if k != "__metadata__"
        ]
        assert sum(sizes) <= 200_000 or len(sizes) == 1
    stored = _stored(ours)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in stored.values()
    )
    assert all(k.startswith(("backbone.", "lm_head.")) for k in stored)
    experts = [k for k in stored if ".mixer.experts." in k]
    assert "backbone.layers.2.mixer.experts.7.up_proj.weight" in experts
    assert not any(k.endswith(("experts.up_proj", "experts.down_proj")) for k in stored)
    assert {"generation_config.json", "config.json"} <= {p.name for p in ours.iterdir()}
    generation = json.loads((ours / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 1 and generation["pad_token_id"] == 0

    model, info = AutoModelForCausalLM.from_pretrained(
        ours, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    theirs = tmp_path / "theirs"
    model.save_pretrained(theirs, max_shard_size=200_000)
    reference = _stored(theirs)
    assert set(reference) == set(stored)
    assert all(torch.equal(reference[k], stored[k]) for k in stored)
    theirs_index = json.loads((theirs / HUB_INDEX).read_text())
    assert set(theirs_index["weight_map"]) == set(index["weight_map"])


def _header(path: Path) -> str:
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return raw[8 : 8 + length].decode()


def test_hub_layout_round_trips_to_transformers_names(tiny_hf):
    from elastic_plugin.checkpoint.hub import from_hub, to_hub

    _, hf, _ = tiny_hf
    hub = to_hub(hf)
    back = from_hub(hub)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    assert from_hub(hf).keys() == hf.keys()  # transformers' names pass through


def test_quantized_experts_stay_per_expert(tiny_hf, tmp_path):
    from elastic_plugin.checkpoint.hub import from_hub
    from elastic_plugin.export.hf import write_hf_checkpoint
    from elastic_plugin.export.quantize import dequantize_state_dict, quantize_state_dict

    _, hf, config = tiny_hf
    quantized, quant_config = quantize_state_dict(hf, "fp8")
    write_hf_checkpoint(tmp_path, quantized, config, "bf16", quant_config=quant_config)
    stored = _stored(tmp_path)
    name = "backbone.layers.2.mixer.experts.3.down_proj"
    assert stored[name + ".weight"].dtype == torch.float8_e4m3fn
    assert stored[name + ".weight_scale"].dtype == torch.float32
    plain = dequantize_state_dict(from_hub(stored), quant_config)
    assert plain["model.layers.2.mixer.experts.down_proj"].shape[0] == 8


def test_broken_directories_are_named(tiny_hf, tmp_path):
    from elastic_plugin.checkpoint.hub import HUB_INDEX, parse_shard_size, read_hub_tensors
    from elastic_plugin.export.hf import write_hf_checkpoint
    from elastic_plugin.models.config import ConfigError

    _, hf, config = tiny_hf
    write_hf_checkpoint(tmp_path, hf, config, "fp32", max_shard_bytes=200_000)
    index = json.loads((tmp_path / HUB_INDEX).read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    data = (tmp_path / last).read_bytes()
    (tmp_path / last).write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=f"{last}: not a readable safetensors file"):
        read_hub_tensors(tmp_path)
    (tmp_path / last).unlink()
    with pytest.raises(ConfigError, match=f"{HUB_INDEX} names {last}, which is not in"):
        read_hub_tensors(tmp_path)
    with pytest.raises(ConfigError, match="no model.safetensors or"):
        read_hub_tensors(tmp_path / "nothing")
    assert parse_shard_size("5GB") == 5 * 10**9 and parse_shard_size("2GiB") == 2 * 2**30
    assert parse_shard_size(1234) == 1234
    for bad in ("five", "0", "-1MB"):
        with pytest.raises(ConfigError, match="--max-shard-size"):
            parse_shard_size(bad)


def test_hf_slicing_equals_the_megatron_slicing(tiny_hub):
    """A budget cut from the full model's HF tensors == the HF tensors of the budget's Megatron
    slice, bit for bit, for a homogeneous and a per-layer choice."""
    from elastic_plugin.export.hf import megatron_to_hf
    from elastic_plugin.export.hf_slicing import slice_hf_state
    from elastic_plugin.models.config import ConfigError
    from elastic_plugin.nested.slicing import sliced_state_dict
    from tests.support.export_cases import PER_LAYER, SMALL

    cfg, model, full = tiny_hub
    for choice in (SMALL, PER_LAYER):
        expected = megatron_to_hf(sliced_state_dict(model, cfg, choice), cfg)
        got = slice_hf_state(full, cfg, choice)
        assert set(got) == set(expected)
        for key in expected:
            assert torch.equal(got[key], expected[key]), key
    with pytest.raises(ConfigError, match="attention_heads"):
        slice_hf_state(full, cfg, {"attention_heads": 3})


@pytest.fixture(scope="module")
def nested_run(rank_pools, tmp_path_factory):
    work = tmp_path_factory.mktemp("nested_export")
    (result,) = rank_pools.get(1).run(
        "tests.support.export_cases:nested_export_case",
        config_path=CONFIG,
        workdir=str(work),
    )
    return result


@pytest.mark.integration
def test_every_budget_sliced_from_one_nested_directory_is_its_own_export(nested_run):
    r = nested_run
    assert "nested_config.json" in r["files"] and "model.safetensors.index.json" in r["files"]
    config = r["nested_config"]
    assert [b["label"] for b in config["budgets"]] == ["1", "0.77", "0.4"]
    per_layer = next(b for b in config["budgets"] if b["label"] == "0.77")
    assert per_layer["sizes"]["mamba_heads"] == {"1": 4, "5": 8}
    assert config["budgets"][0]["params"]["total"] > per_layer["params"]["total"]
    for row in r["rows"]:
        print(row)
        assert row["exit"] == 0 and row["same_keys"] and row["bitwise"] and row["config_equal"], row
        assert row["load_nested_vs_export"] == 0.0, row
    # one directory for three models: smaller than the three separate exports together
    assert r["nested"]["bytes"] < sum(row["bytes_own"] for row in r["rows"])


@pytest.mark.integration
def test_a_killed_slice_leaves_no_output(nested_run):
    r = nested_run
    assert r["interrupted"] == "killed mid-save"
    assert r["after_kill"] == {"out": False, "tmp": True}
    assert r["rerun_equal"] and not r["rerun_tmp"]


@pytest.mark.integration
def test_slice_refuses_bad_input_before_writing(nested_run):
    errors = nested_run["errors"]
    assert all(e["exit"] == 2 and not e["written"] for e in errors.values()), errors
    assert "--budget 0.5: not a budget of" in errors["untrained"]["stderr"]
    assert "trained budgets: 1, 0.77, 0.4" in errors["untrained"]["stderr"]
    assert "no nested_config.json" in errors["not_nested"]["stderr"]
    assert "--out" in errors["out_taken"]["stderr"]


@pytest.fixture(scope="module")
def serve_checked(rank_pools, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve_check")
    (result,) = rank_pools.get(1).run(
        "tests.support.export_cases:serve_check_case",
        config_path=CONFIG,
        workdir=str(work),
    )
    return result


@pytest.mark.integration
def test_serve_check_passes_every_format_and_catches_a_tampered_export(serve_checked):
    r = serve_checked
    loaders = {
        "hf_1_bf16": "transformers AutoModelForCausalLM",
        "hf_0.4_fp32": "transformers AutoModelForCausalLM",
        "hf_0.4_fp8": "elastic_plugin load_hf_model",
        "hf_0.4_nvfp4": "elastic_plugin load_hf_model",
        "hf_0.77_fp32": "elastic_plugin load_hf_model",  # per-layer widths
        "nested_0.77": "load_nested",
    }
    for name, loader in loaders.items():
        result = r[name]["result"]
        print(name, result)
        assert r[name]["exit"] == 0 and result["ok"] and result["loader"] == loader, r[name]
        assert not result["missing_keys"] and not result["unexpected_keys"]
    assert r["hf_0.4_fp32"]["result"]["max_abs_diff"] <= 1e-5
    assert (
        r["hf_0.77_fp32"]["result"]["per_layer"]
        and r["hf_0.77_fp32"]["result"]["max_abs_diff"] <= 1e-5
    )
    assert r["hf_0.4_fp8"]["result"]["precision"] == "fp8"
    tampered = r["tampered"]
    assert tampered["exit"] == 1 and not tampered["result"]["ok"]
    assert tampered["result"]["max_abs_diff"] > 1e-3
    # the same altered file in an export that recorded its digests is refused before loading
    damaged = r["damaged"]
    assert (
        damaged["exit"] == 2
        and "file model.safetensors differs from what was saved" in (damaged["stderr"])
    ), damaged
    verify = r["verify"]
    assert verify["hf_0.4_fp32"][0] == 0 and verify["nested"][0] == 0, verify
    assert verify["damaged"][0] == 2 and "model.safetensors differs" in verify["damaged"][1]
    assert r["nested_without_budget"]["exit"] == 2
    assert "is a nested directory; name the budget" in r["nested_without_budget"]["stderr"]
    assert r["budget_on_plain"]["exit"] == 2
    assert "--budget goes with a nested directory" in r["budget_on_plain"]["stderr"]


def test_exports_record_digests_and_every_read_verifies_them(tiny_hf, tmp_path):
    """An export's export_meta.json records every other file's size and SHA-256; a flipped
    byte, a truncated or a missing shard is named before any tensor is read. A Hub download
    (no export_meta.json) reads as before."""
    import hashlib

    from elastic_plugin.checkpoint.hub import (
        EXPORT_META,
        HUB_INDEX,
        from_hub,
        read_hub_tensors,
        verify_export_files,
    )
    from elastic_plugin.export.hf import write_hf_checkpoint
    from elastic_plugin.models.config import ConfigError

    _, hf, config = tiny_hf
    export = tmp_path / "export"
    export.mkdir()
    write_hf_checkpoint(
        export,
        hf,
        config,
        "fp32",
        extra_files={EXPORT_META: {"kind": "hf"}},
        max_shard_bytes=200_000,
    )
    meta = json.loads((export / EXPORT_META).read_text())
    files = sorted(p.name for p in export.iterdir() if p.name != EXPORT_META)
    assert meta["kind"] == "hf" and sorted(meta["files"]) == files
    shard = sorted(set(json.loads((export / HUB_INDEX).read_text())["weight_map"].values()))[0]
    data = (export / shard).read_bytes()
    assert meta["files"][shard] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify_export_files(export) and from_hub(read_hub_tensors(export)).keys() == hf.keys()

    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    (export / shard).write_bytes(bytes(flipped))
    with pytest.raises(ConfigError, match=f"file {shard} differs from what was saved"):
        read_hub_tensors(export)
    (export / shard).write_bytes(data[:-10])
    with pytest.raises(ConfigError, match=f"file {shard} is truncated: expected {len(data)}"):
        read_hub_tensors(export)
    (export / shard).unlink()
    with pytest.raises(ConfigError, match=f"file {shard} is missing"):
        read_hub_tensors(export)
    plain = tmp_path / "plain"  # no export_meta.json: nothing recorded, nothing checked
    plain.mkdir()
    write_hf_checkpoint(plain, hf, config, "fp32")
    assert not verify_export_files(plain) and from_hub(read_hub_tensors(plain)).keys() == hf.keys()


def test_slicing_the_files_reads_the_same_tensors(tiny_hf, tmp_path):
    """``slice_hub_files`` (reads only what a budget keeps, shard by shard) == slicing the whole
    state in memory, for a homogeneous and a per-layer choice."""
    from elastic_plugin.checkpoint.hub import from_hub
    from elastic_plugin.export.hf import write_hf_checkpoint
    from elastic_plugin.export.hf_slicing import slice_hf_state, slice_hub_files
    from tests.support.export_cases import PER_LAYER, SMALL

    cfg, hf, config = tiny_hf
    write_hf_checkpoint(tmp_path, hf, config, "bf16", max_shard_bytes=100_000)
    stored = from_hub(_stored(tmp_path))
    for choice in (SMALL, PER_LAYER):
        expected = slice_hf_state(stored, cfg, choice)
        got = slice_hub_files(tmp_path, cfg, choice)
        assert set(got) == set(expected)
        assert all(
            torch.equal(got[k], expected[k]) and got[k].dtype == expected[k].dtype for k in got
        )
