"""Megatron-LM checkpoints for the ``import --megatron`` tests, written by Megatron-LM itself.

Runs as its own process (``python -m tests.support.megatron_import_cases WORK``):
Megatron-LM's ``save_checkpoint`` needs its global args, and its torch_dist writer starts a
``spawn`` process, which needs an importable ``__main__``. It parses a small hybrid model's
Megatron-LM command line (``megatron.training.arguments``: parse_args + validate_args, then
``padded_vocab_size`` as the tokenizer build sets it), builds that model with our builder, sets
every weight to random values, and saves iteration 10 with ``megatron.training.checkpointing.
save_checkpoint`` twice: with the model's own sharded keys (our local spec stores the norms under
Transformer Engine's fused names, as a TE-trained run does) and with the norms under the names of
Megatron-Core's local specs. ``reference.pt`` holds tokens and the model's fp32 logits.

It also writes two checkpoints of Megatron-LM's ``GPTModel`` as ``pretrain_gpt.py`` builds it
(``core_transformer_config_from_args``, Megatron-Core's local GPT layer / decoder-block spec,
``GPTModel(...)`` with the args' RoPE settings; not our builder): ``gpt_dense/`` (Llama-like:
GQA, SwiGLU, Llama 3.1 RoPE scaling, untied, the norms under TE's fused names as the GPT local
spec stores them) and ``gpt_moe/`` (Qwen-like: QK layernorm, q/k/v bias, a free kv_channels,
tied embeddings, MoE and dense layers mixed by ``--moe-layer-freq`` with a shared expert, the
norms renamed to the local specs' separate names), each with ``reference_<name>.pt`` holding the
GPTModel's fp32 logits.
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


# pretrain_gpt.py's flags on CPU without TE or apex (Megatron-LM refuses the fused defaults)
_GPT_CPU = [
    "--transformer-impl", "local",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
]  # fmt: skip
_GPT_COMMON = [
    "--hidden-size", "48",
    "--num-attention-heads", "6",
    "--group-query-attention",
    "--num-query-groups", "2",
    "--swiglu",
    "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6",
    "--position-embedding-type", "rope",
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
    *_GPT_CPU,
]  # fmt: skip
GPT_ARGV = {
    "gpt_dense": [
        *_GPT_COMMON,
        "--num-layers", "2",
        "--ffn-hidden-size", "40",
        "--rotary-base", "500000",
        "--use-rope-scaling",
        "--rope-scaling-factor", "8",
        "--untie-embeddings-and-output-weights",
    ],
    "gpt_moe": [
        *_GPT_COMMON,
        "--num-layers", "3",
        "--kv-channels", "12",
        "--ffn-hidden-size", "40",
        "--rotary-base", "1000000",
        "--qk-layernorm",
        "--add-qkv-bias",
        "--num-experts", "4",
        "--moe-router-topk", "2",
        "--moe-ffn-hidden-size", "24",
        "--moe-layer-freq", "[1,0,1]",
        "--moe-shared-expert-intermediate-size", "16",
    ],
}  # fmt: skip


def gpt_model_config(name: str) -> ModelConfig:
    """The model GPT_ARGV[name] describes, as our hybrid pattern (written out by hand)."""
    common: dict = dict(
        hidden_size=48,
        vocab_size=VOCAB,
        num_attention_heads=6,
        num_query_groups=2,
        ffn_hidden_size=40,
        activation="swiglu",
        layernorm_epsilon=1e-6,
        position_embedding_type="rope",
        max_sequence_length=64,
        add_bias_linear=False,
    )
    if name == "gpt_dense":
        return ModelConfig(
            hybrid_layer_pattern="*-*-",
            kv_channels=8,  # Megatron-LM's validate_args sets hidden / heads
            rotary_base=500000,
            rope_scaling=True,
            rope_scaling_factor=8.0,
            untie_embeddings_and_output_weights=True,
            **common,
        ).validate()
    return ModelConfig(
        hybrid_layer_pattern="*E*-*E",
        kv_channels=12,
        rotary_base=1000000,
        qk_layernorm=True,
        add_qkv_bias=True,
        untie_embeddings_and_output_weights=False,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=24,
        moe_shared_expert_intermediate_size=16,
        **common,
    ).validate()


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


def _randomize(model, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if (
                torch.is_tensor(tensor)
                and tensor.is_floating_point()
                and not name.endswith("local_tokens_per_expert")
            ):
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=gen))


def _parse(argv: list[str], save: Path, script: str):
    from megatron.training import arguments, global_vars

    sys.argv = [script, *argv, "--save", str(save)]
    args = arguments.parse_args()
    arguments.validate_args(args)
    args.padded_vocab_size = VOCAB  # what build_tokenizer sets (VOCAB is a multiple of 128)
    global_vars.set_args(args)
    return args


def build_gpt_model(args):
    """Megatron-LM's GPTModel as pretrain_gpt.py's model provider builds it with
    ``--transformer-impl local`` (the MoE decoder-block spec when --num-experts is set)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.training.argument_utils import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    if args.num_experts:
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization=args.normalization
        )
    else:
        spec = get_gpt_layer_local_spec(
            args.num_experts,
            args.moe_grouped_gemm,
            args.qk_layernorm,
            normalization=args.normalization,
        )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
    )


def write_gpt_checkpoints(work: Path, gen: torch.Generator) -> None:
    """``gpt_dense/`` and ``gpt_moe/`` (see the module docstring) and their references."""
    from megatron.training.checkpointing import save_checkpoint

    for name, argv in GPT_ARGV.items():
        args = _parse(argv, work / name, "pretrain_gpt.py")
        model = build_gpt_model(args)
        _randomize(model, gen)
        model.eval()
        tokens = torch.randint(0, VOCAB, (2, 12), generator=gen)
        with torch.no_grad():
            logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
        torch.save({"tokens": tokens, "logits": logits}, work / f"reference_{name}.pt")
        if name == "gpt_moe":
            _with_local_norm_names(model)
        save_checkpoint(SAVE_ITERATION, [model], None, None, 0)


def write_gpt_tp2_case(work: str) -> dict:
    """Rank-pool case (2 ranks): ``gpt_dense`` saved by Megatron-LM's ``save_checkpoint`` under
    TP=2 (each rank its own shards: random per rank, the replicated tensors broadcast), to
    ``WORK/gpt_tp2``; rank 0 writes ``reference_gpt_tp2.pt`` (the vocab shards gathered)."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.training import global_vars
    from megatron.training.checkpointing import save_checkpoint

    from elastic_plugin.compat.megatron_training import enable_cpu_megatron_training
    from elastic_plugin.parallel import Layout, initialize_layout

    enable_cpu_megatron_training()  # validate_args asks the GPU's architecture when TP > 1
    initialize_layout(Layout(tp=2))
    rank = dist.get_rank()
    argv = [*GPT_ARGV["gpt_dense"], "--tensor-model-parallel-size", "2"]
    args = _parse(argv, Path(work) / "gpt_tp2", "pretrain_gpt.py")
    own_rng_state = torch.cuda.get_rng_state
    try:
        model = build_gpt_model(args)
        _randomize(model, torch.Generator().manual_seed(100 + rank))
        with torch.no_grad():
            for param in model.parameters():
                if not getattr(param, "tensor_model_parallel", False):
                    dist.broadcast(param.data, src=0)
        model.eval()
        gen = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, VOCAB, (2, 12), generator=gen)
        with torch.no_grad():
            local = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
            logits = gather_from_tensor_model_parallel_region(local.contiguous())
        if rank == 0:
            torch.save({"tokens": tokens, "logits": logits}, Path(work) / "reference_gpt_tp2.pt")
        if not torch.cuda.is_available():  # Megatron-LM records the CUDA RNG (--no-save-rng too)
            torch.cuda.get_rng_state = lambda *a, **k: torch.zeros(0, dtype=torch.uint8)
        save_checkpoint(SAVE_ITERATION, [model], None, None, 0)
    finally:
        torch.cuda.get_rng_state = own_rng_state
        global_vars.set_args(None)  # later cases of the pool see no Megatron-LM args
    return {"local_vocab": int(local.shape[-1])}


def write_checkpoints(work: Path) -> None:
    from megatron.training.checkpointing import save_checkpoint

    from elastic_plugin.cli_args import start_ranks
    from elastic_plugin.parallel import Layout, build_model_chunks

    start_ranks(Layout())
    (model,), _ = build_model_chunks(source_model_config(), Layout(), wrap_ddp=False)
    gen = torch.Generator().manual_seed(0)
    _randomize(model, gen)
    model.eval()
    tokens = torch.randint(0, VOCAB, (2, 12), generator=gen)
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    torch.save({"tokens": tokens, "logits": logits}, work / "reference.pt")
    if not torch.cuda.is_available():  # Megatron-LM records the CUDA RNG even with --no-save-rng
        torch.cuda.get_rng_state = lambda *a, **k: torch.zeros(0, dtype=torch.uint8)
    for form in ("te", "local"):
        _parse(MEGATRON_ARGV, work / form, "pretrain_hybrid.py")
        if form == "local":
            _with_local_norm_names(model)
        save_checkpoint(SAVE_ITERATION, [model], None, None, 0)
    write_gpt_checkpoints(work, gen)


if __name__ == "__main__":
    write_checkpoints(Path(sys.argv[1]))
