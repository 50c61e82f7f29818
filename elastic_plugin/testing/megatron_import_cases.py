"""Megatron-LM checkpoints for the ``import --megatron`` tests, written by Megatron-LM itself.

Runs as its own process (``python -m elastic_plugin.testing.megatron_import_cases WORK``):
Megatron-LM's ``save_checkpoint`` needs its global args, and its torch_dist writer starts a
``spawn`` process, which needs an importable ``__main__``. It parses a small hybrid model's
Megatron-LM command line (``megatron.training.arguments``: parse_args + validate_args, then
``padded_vocab_size`` as the tokenizer build sets it), builds that model with our builder, sets
every weight to random values, and saves iteration 10 with ``megatron.training.checkpointing.
save_checkpoint`` twice: with the model's own sharded keys (our local spec stores the norms under
Transformer Engine's fused names, as a TE-trained run does) and with the norms under the names of
Megatron-Core's local specs. ``reference.pt`` holds tokens and the model's fp32 logits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from elastic_plugin.models.config import ModelConfig

VOCAB = 128
SAVE_ITERATION = 10
MEGATRON_ARGV = [
    "--hybrid-layer-pattern", "M*-E",
    "--hidden-size", "32",
    "--num-attention-heads", "4",
    "--group-query-attention",
    "--num-query-groups", "2",
    "--kv-channels", "8",
    "--ffn-hidden-size", "48",
    "--mamba-num-heads", "4",
    "--mamba-head-dim", "8",
    "--mamba-num-groups", "2",
    "--mamba-state-dim", "8",
    "--num-experts", "4",
    "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "16",
    "--moe-shared-expert-intermediate-size", "24",
    "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias",
    "--moe-router-topk-scaling-factor", "2.5",
    "--squared-relu",
    "--normalization", "RMSNorm",
    "--untie-embeddings-and-output-weights",
    "--position-embedding-type", "none",
    "--disable-bias-linear",
    "--ckpt-format", "torch_dist",
    "--save-interval", str(SAVE_ITERATION),
    "--micro-batch-size", "1",
    "--seq-length", "16",
    "--max-position-embeddings", "64",
    "--no-save-optim",
    "--no-save-rng",
    "--tokenizer-type", "NullTokenizer",
    "--vocab-size", str(VOCAB),
]  # fmt: skip


def source_model_config() -> ModelConfig:
    """The model MEGATRON_ARGV describes, written out independently of the import's mapping."""
    return ModelConfig(
        hybrid_layer_pattern="M*-E",
        hidden_size=32,
        vocab_size=VOCAB,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        ffn_hidden_size=48,
        mamba_num_heads=4,
        mamba_head_dim=8,
        mamba_num_groups=2,
        mamba_state_dim=8,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=24,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5,
        max_sequence_length=64,
    ).validate()


def local_norm_name(key: str) -> str:
    """A sharded key under Megatron-Core's local-spec norm names (TE fused -> separate)."""
    from elastic_plugin.export.megatron_import import norm_aliases

    names = norm_aliases(key)
    return names[1] if len(names) > 1 and "layer_norm_weight" in key else key


def _with_local_norm_names(model) -> None:
    """Make ``model.sharded_state_dict()`` store its norms under the local-spec names."""
    import dataclasses

    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    own = model.sharded_state_dict

    def renamed(*args, **kwargs):
        out = own(*args, **kwargs)
        for name, item in out.items():
            if isinstance(item, ShardedTensor) and local_norm_name(item.key) != item.key:
                out[name] = dataclasses.replace(item, key=local_norm_name(item.key))
        return out

    model.sharded_state_dict = renamed


def write_checkpoints(work: Path) -> None:
    from megatron.training import arguments, global_vars
    from megatron.training.checkpointing import save_checkpoint

    from elastic_plugin.cli_args import start_ranks
    from elastic_plugin.parallel import Layout, build_model_chunks

    start_ranks(Layout())
    (model,), _ = build_model_chunks(source_model_config(), Layout(), wrap_ddp=False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if (
                torch.is_tensor(tensor)
                and tensor.is_floating_point()
                and not name.endswith("local_tokens_per_expert")
            ):
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=gen))
    model.eval()
    tokens = torch.randint(0, VOCAB, (2, 12), generator=gen)
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    torch.save({"tokens": tokens, "logits": logits}, work / "reference.pt")
    if not torch.cuda.is_available():  # Megatron-LM records the CUDA RNG even with --no-save-rng
        torch.cuda.get_rng_state = lambda *a, **k: torch.zeros(0, dtype=torch.uint8)
    for form in ("te", "local"):
        sys.argv = ["pretrain_hybrid.py", *MEGATRON_ARGV, "--save", str(work / form)]
        args = arguments.parse_args()
        arguments.validate_args(args)
        args.padded_vocab_size = VOCAB  # what build_tokenizer sets (VOCAB is a multiple of 128)
        global_vars.set_args(args)
        if form == "local":
            _with_local_norm_names(model)
        save_checkpoint(SAVE_ITERATION, [model], None, None, 0)


if __name__ == "__main__":
    write_checkpoints(Path(sys.argv[1]))
