"""Cross-check: Megatron-Bridge's NemotronH bridge reads our Hugging Face exports.

Megatron-Bridge converts Hub Nemotron-H checkpoints to Megatron-Core and back; serving runtimes read
the same layout. It cannot be installed with our pins (its torch and megatron-core requirements differ), so
this is a script, not a test or a dependency: install it beside the project, without its
dependencies, and put it on the path for this run only::

    pip install --no-deps --target /tmp/bridge megatron-bridge==0.6.2
    PYTHONPATH=/tmp/bridge .venv/bin/python bench/compare_bridge.py [--export DIR ...]

Without ``--export`` it writes the perturbed tiny model twice: in the Hub layout our exports use
(``backbone.*``, one tensor per expert, sharded), and in transformers' in-memory layout that our
exports used before (``model.*``, stacked experts, one file). For each it reports the bridge's
"Can't find ... in hf_keys" warnings (weights it could not read) and the largest logit difference
between the bridge's Megatron model and transformers' own ``from_pretrained`` of the same files.
Two placeholder modules make ``import megatron.bridge`` work here: its LoRA layers import
Transformer Engine unconditionally, and one bundled model imports a transformers module that
5.24 removed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class _Anything(types.ModuleType):
    """A module whose every attribute is a placeholder class (for imports never used here)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {})
        setattr(self, name, value)
        return value


def _stub_unavailable_imports() -> None:
    """Replace the two modules that cannot import here by placeholders (neither is used by the
    NemotronH conversion): the bridge's LoRA layers (they import Transformer Engine at the top;
    stubbing TE itself would make Megatron-Core believe TE is installed) and the transformers
    module 5.24 removed."""
    for name in ("megatron.bridge.peft.lora_layers", "transformers.modeling_attn_mask_utils"):
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = _Anything(name)


class _CantFind(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "Can't find" in record.getMessage():
            self.messages.append(record.getMessage())


def _write_exports(work: Path) -> dict[str, Path]:
    from safetensors.torch import save_file

    from elastic_plugin.export.hf import hf_config, megatron_to_hf, write_hf_checkpoint
    from tests.support.inference_cases import tiny_inference_model

    model, cfg = tiny_inference_model(seed=21)
    hf = megatron_to_hf(model.state_dict(), cfg)
    config = hf_config(hf, cfg, "fp32")
    hub, memory = work / "hub_layout", work / "in_memory_layout"
    hub.mkdir()
    write_hf_checkpoint(hub, hf, config, "fp32", max_shard_bytes=200_000)
    memory.mkdir()
    write_hf_checkpoint(memory, hf, config, "fp32")  # config + extras, then the old weights file
    for old in memory.glob("model*.safetensors*"):
        old.unlink()
    save_file({k: v.contiguous() for k, v in hf.items()}, str(memory / "model.safetensors"))
    return {"ours (Hub layout, sharded)": hub, "before (in-memory layout)": memory}


def _bridge_logits(path: Path, tokens, spec):
    import torch
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(str(path))
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.hybrid_stack_spec = spec
    from megatron.core.transformer.enums import AttnBackend

    for name, value in (
        ("attention_backend", AttnBackend.local),  # our local spec's DotProductAttention
        ("apply_rope_fusion", False),
        ("moe_grouped_gemm", False),
        ("moe_permute_fusion", False),
    ):
        setattr(provider, name, value)
    provider.finalize()
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(name, None)  # set by our own model's backend choice; Megatron asserts on it
    model = provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=True, bf16=False, mixed_precision_wrapper=None
    )[0].eval()
    position = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, position, None).float()


def run(exports: list[str] | None = None) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.parallel import Layout, init_distributed, initialize_layout

    enable_cpu_megatron()
    init_distributed()
    initialize_layout(Layout())
    from elastic_plugin.models.specs import local_hybrid_stack_spec

    spec = local_hybrid_stack_spec()
    work = Path(tempfile.mkdtemp(prefix="compare_bridge_"))
    paths = {str(p): Path(p) for p in exports} if exports else _write_exports(work)
    _stub_unavailable_imports()
    handler = _CantFind()
    logging.getLogger().addHandler(handler)
    logging.getLogger("megatron.bridge").addHandler(handler)
    rows = []
    for name, path in paths.items():
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tokens = torch.randint(
            0, reference.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
        )
        with torch.no_grad():
            expected = reference(tokens).logits.float()
        handler.messages.clear()
        try:
            got = _bridge_logits(path, tokens, spec)
            diff = (got - expected).abs().max().item()
            error = ""
        except Exception as exc:  # the bridge fails on some inputs; report, do not stop
            diff, error = float("nan"), f"{type(exc).__name__}: {exc}"[:120]
        rows.append(
            {
                "name": name,
                "files": len(list(path.glob("*.safetensors"))),
                "cant_find_warnings": len(handler.messages),
                "max|bridge-transformers|": f"{diff:.2e}",
                "error": error,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", action="append", default=None, metavar="DIR")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run_all import print_table

    print_table(run(args.export))


if __name__ == "__main__":
    main()
