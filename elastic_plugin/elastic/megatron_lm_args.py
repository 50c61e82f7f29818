"""Megatron-LM's side of an elastic run: the ``--elastic-*`` flags, the architecture flags that
must describe the checkpoint, and every check that needs only the parsed arguments.

Used by ``elastic.megatron_lm_pretrain`` (the wrappers a user's ``pretrain_mamba.py``-style
script adds) and by ``examples/pretrain_elastic.py``; everything here runs before Megatron builds
a model, so bad flags fail fast, naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from elastic_plugin.elastic.args import add_elastic_args, elastic_config_from_args
from elastic_plugin.models.config import ConfigError, ModelConfig
from elastic_plugin.models.context_parallel import check_context_parallel
from elastic_plugin.models.megatron_fields import architecture_fields

VPP_ERROR = (
    "Elastic training inside megatron.training.pretrain runs one model chunk per pipeline "
    "stage: virtual pipeline stages (--num-layers-per-virtual-pipeline-stage, "
    "--num-virtual-stages-per-pipeline-rank) are not supported; drop them (plain "
    "--pipeline-model-parallel-size N works)"
)


def add_pretrain_elastic_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: the ``--elastic-*`` flags plus the checkpoints to start from."""
    add_elastic_args(parser)
    group = parser.add_argument_group(title="elastic checkpoints")
    group.add_argument(
        "--elastic-ckpt",
        default=None,
        metavar="DIR",
        help="importance-reordered checkpoint (elastic-plugin reorder --out); the "
        "student starts from it",
    )
    group.add_argument(
        "--elastic-teacher-ckpt",
        default=None,
        metavar="DIR",
        help="frozen teacher (default: --elastic-ckpt, the same function)",
    )
    return parser


@dataclass(frozen=True)
class ArchFlag:
    """One Megatron-LM architecture flag: ``value`` flags print ``flag value``; ``store_true``
    flags print the flag when ``value`` is true; ``store_false`` ones when it is false."""

    flag: str
    dest: str
    value: Any
    kind: str = "value"

    def render(self) -> list[str]:
        if self.kind == "value":
            return [self.flag, str(self.value)]
        present = self.value if self.kind == "store_true" else not self.value
        return [self.flag] if present else []

    def matches(self, args: argparse.Namespace) -> bool:
        got = getattr(args, self.dest, None)
        if isinstance(got, list) and len(got) == 1:  # nargs="+" flags given one value
            got = got[0]
        if isinstance(self.value, float) and isinstance(got, (int, float)):
            return abs(got - self.value) <= 1e-12 * max(1.0, abs(self.value))
        return got == self.value


def arch_flags(model: ModelConfig) -> list[ArchFlag]:
    """The Megatron-LM flags that describe ``model`` (the checkpoint's architecture); their
    values are the ``TransformerConfig`` fields the builder uses (``models.megatron_fields``)."""
    f = architecture_fields(model)
    flags = [
        ArchFlag("--hybrid-layer-pattern", "hybrid_layer_pattern", model.hybrid_layer_pattern),
        ArchFlag("--num-layers", "num_layers", f["num_layers"]),
        ArchFlag("--hidden-size", "hidden_size", f["hidden_size"]),
        ArchFlag("--num-attention-heads", "num_attention_heads", f["num_attention_heads"]),
        ArchFlag("--max-position-embeddings", "max_position_embeddings", model.max_sequence_length),
        ArchFlag(
            "--position-embedding-type", "position_embedding_type", model.position_embedding_type
        ),
        ArchFlag("--normalization", "normalization", f["normalization"]),
        ArchFlag("--norm-epsilon", "layernorm_epsilon", f["layernorm_epsilon"]),
        ArchFlag("--init-method-std", "init_method_std", f["init_method_std"]),
        ArchFlag(
            "--untie-embeddings-and-output-weights",
            "untie_embeddings_and_output_weights",
            model.untie_embeddings_and_output_weights,
            "store_true",
        ),
        ArchFlag("--disable-bias-linear", "add_bias_linear", f["add_bias_linear"], "store_false"),
        ArchFlag("--hidden-dropout", "hidden_dropout", f["hidden_dropout"]),
        ArchFlag("--attention-dropout", "attention_dropout", f["attention_dropout"]),
    ]
    if model.position_embedding_type == "rope":
        flags.append(ArchFlag("--rotary-base", "rotary_base", model.rotary_base))
        # Llama 3.1+ frequency scaling: the factor only with the flag (Megatron-LM's default is
        # 8.0 either way, so a launch without scaling needs neither)
        flags.append(
            ArchFlag("--use-rope-scaling", "use_rope_scaling", model.rope_scaling, "store_true")
        )
        if model.rope_scaling:
            flags.append(
                ArchFlag(
                    "--rope-scaling-factor",
                    "rope_scaling_factor",
                    float(model.rope_scaling_factor),
                )
            )
    if model.activation in ("squared_relu", "swiglu"):
        flags.append(
            ArchFlag(
                f"--{model.activation.replace('_', '-')}", model.activation, True, "store_true"
            )
        )
    if model.count("attention"):
        flags += [
            ArchFlag("--kv-channels", "kv_channels", f["kv_channels"]),
            ArchFlag("--qk-layernorm", "qk_layernorm", f["qk_layernorm"], "store_true"),
            # Megatron-LM's validate_args sets add_qkv_bias whenever add_bias_linear is on
            ArchFlag(
                "--add-qkv-bias",
                "add_qkv_bias",
                f["add_qkv_bias"] or f["add_bias_linear"],
                "store_true",
            ),
        ]
        if model.query_groups != model.num_attention_heads:
            flags += [
                ArchFlag("--group-query-attention", "group_query_attention", True, "store_true"),
                ArchFlag("--num-query-groups", "num_query_groups", model.query_groups),
            ]
    if model.count("mlp"):
        flags.append(ArchFlag("--ffn-hidden-size", "ffn_hidden_size", f["ffn_hidden_size"]))
    if model.count("mamba"):
        flags += [
            ArchFlag("--mamba-num-heads", "mamba_num_heads", model.mamba_num_heads),
            ArchFlag("--mamba-head-dim", "mamba_head_dim", f["mamba_head_dim"]),
            ArchFlag("--mamba-num-groups", "mamba_num_groups", f["mamba_num_groups"]),
            ArchFlag("--mamba-state-dim", "mamba_state_dim", f["mamba_state_dim"]),
        ]
    if model.count("moe"):
        flags += [
            ArchFlag("--num-experts", "num_experts", f["num_moe_experts"]),
            ArchFlag("--moe-router-topk", "moe_router_topk", f["moe_router_topk"]),
            ArchFlag("--moe-ffn-hidden-size", "moe_ffn_hidden_size", f["moe_ffn_hidden_size"]),
            ArchFlag(
                "--moe-router-score-function",
                "moe_router_score_function",
                f["moe_router_score_function"],
            ),
            ArchFlag(
                "--moe-router-enable-expert-bias",
                "moe_router_enable_expert_bias",
                f["moe_router_enable_expert_bias"],
                "store_true",
            ),
        ]
        flags += [
            ArchFlag(
                "--moe-token-dispatcher-type",
                "moe_token_dispatcher_type",
                f["moe_token_dispatcher_type"],
            ),
            ArchFlag("--moe-router-dtype", "moe_router_dtype", f["moe_router_dtype"]),
            ArchFlag(
                "--moe-router-load-balancing-type",
                "moe_router_load_balancing_type",
                f["moe_router_load_balancing_type"],
            ),
            ArchFlag("--moe-aux-loss-coeff", "moe_aux_loss_coeff", f["moe_aux_loss_coeff"]),
        ]
        if f["moe_router_topk_scaling_factor"] is not None:
            flags.append(
                ArchFlag(
                    "--moe-router-topk-scaling-factor",
                    "moe_router_topk_scaling_factor",
                    f["moe_router_topk_scaling_factor"],
                )
            )
        if f["moe_shared_expert_intermediate_size"]:
            flags.append(
                ArchFlag(
                    "--moe-shared-expert-intermediate-size",
                    "moe_shared_expert_intermediate_size",
                    f["moe_shared_expert_intermediate_size"],
                )
            )
    return flags


def render_arch_flags(model: ModelConfig) -> list[str]:
    return [part for flag in arch_flags(model) for part in flag.render()]


def check_arch_args(args: argparse.Namespace, model: ModelConfig, ckpt: str) -> None:
    """Megatron's model flags must describe the checkpoint; list every one that does not."""
    wrong = [
        f"{f.flag} (got {getattr(args, f.dest, None)!r}, checkpoint: {f.value!r})"
        for f in arch_flags(model)
        if not f.matches(args)
    ]
    if wrong:
        raise ConfigError(
            f"--elastic-ckpt {ckpt}: Megatron's model flags differ from the checkpoint's "
            f"architecture: {'; '.join(wrong)}. Print the right flags with `python -m "
            f"elastic_plugin.elastic.megatron_lm_args --elastic-ckpt {ckpt}`"
        )


def checkpoint_config(path: str | None, flag: str):
    """(ExperimentConfig, meta) of a plugin checkpoint, with an error naming ``flag``."""
    from elastic_plugin.checkpoint.meta import read_checkpoint_meta
    from elastic_plugin.models.config import config_from_dict

    if not path:
        raise ConfigError(
            f"{flag} DIR is required (the importance-reordered checkpoint written "
            f"by `elastic-plugin reorder`)"
        )
    meta = read_checkpoint_meta(path, flag)  # a stage directory stands for its newest save
    return config_from_dict(meta["config"], source=f"{flag} {path}"), meta


_NOTED: set[str] = set()


def _note_once(message: str) -> None:
    """Print ``message`` to stderr once per process. Why: a Megatron-LM launch runs
    :func:`elastic_setup` more than once (the router's LR group while Megatron parses, the
    early check, the model provider), and a note is worth reading once."""
    import sys

    if message not in _NOTED:
        _NOTED.add(message)
        print(message, file=sys.stderr)


def elastic_setup(args: argparse.Namespace):
    """Checks that need only the arguments: (ExperimentConfig, ElasticConfig, resolved)."""
    from elastic_plugin.elastic.megatron_lm import check_checkpoint_args

    check_checkpoint_args(args)
    if (getattr(args, "virtual_pipeline_model_parallel_size", None) or 1) > 1:
        raise ConfigError(VPP_ERROR)
    cfg, meta = checkpoint_config(args.elastic_ckpt, "--elastic-ckpt")
    check_arch_args(args, cfg.model, args.elastic_ckpt)
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    pp = args.pipeline_model_parallel_size or 1
    cfg.model.check_parallel(tp, pp, ep)  # names the field and the layout that does not divide
    cp = getattr(args, "context_parallel_size", None) or 1
    check_context_parallel(cfg.model, cp, tp, getattr(args, "seq_length", None))
    if (tp > 1 or ep > 1) and not meta.get("reordered"):
        raise ConfigError(
            f"--elastic-ckpt {args.elastic_ckpt} is not importance-reordered; run "
            f"`elastic-plugin reorder` first (needed for TP/EP > 1)"
        )
    ecfg = elastic_config_from_args(
        args, base=cfg.elastic, base_source=f"--elastic-ckpt {args.elastic_ckpt}"
    )
    if getattr(args, "elastic_router_freeze_after", None) is not None:
        raise ConfigError(
            "--elastic-router-freeze-after: freezing each budget's choice after a validation "
            "search runs in `elastic-plugin elastic-train` only; inside "
            "megatron.training.pretrain the router trains throughout"
        )
    if ecfg.router.freeze_after is not None:  # the checkpoint's elastic: section asks for it
        _note_once(
            f"elastic: note: --elastic-ckpt's elastic.router.freeze_after="
            f"{ecfg.router.freeze_after} is not applied inside megatron.training.pretrain (the "
            f"router trains throughout; `elastic-plugin elastic-train` freezes)"
        )
        router = dataclasses.replace(ecfg.router, freeze_after=None, freeze_select="likelihood")
        ecfg = dataclasses.replace(ecfg, router=router)
    if getattr(args, "elastic_router_init", None) == "screened":
        raise ConfigError(
            "--elastic-router-init screened: the zero-shot screening before training runs in "
            "`elastic-plugin elastic-train` only; inside megatron.training.pretrain the router "
            "starts from its size prior"
        )
    if ecfg.router.init == "screened":  # the checkpoint's elastic: section asks for it
        _note_once(
            "elastic: note: --elastic-ckpt's elastic.router.init=screened is not applied inside "
            "megatron.training.pretrain (the router starts from its size prior; `elastic-plugin "
            "elastic-train` screens)"
        )
        ecfg = dataclasses.replace(ecfg, router=dataclasses.replace(ecfg.router, init="prior"))
    resolved = ecfg.resolve(cfg.model, tp, ep)
    for i, stage in enumerate(ecfg.curriculum):
        if cp > 1 and stage.seq_length and stage.seq_length != args.seq_length:
            raise ConfigError(
                f"elastic.curriculum[{i}].seq_length={stage.seq_length} with "
                f"--context-parallel-size={cp}: inside megatron.training.pretrain the batch is "
                "already split over the CP ranks when a stage would cut it; train each stage as "
                "its own run with --seq-length, or use `elastic-plugin elastic-train`"
            )
        if stage.seq_length and args.seq_length and stage.seq_length > args.seq_length:
            raise ConfigError(
                f"elastic.curriculum[{i}].seq_length={stage.seq_length} exceeds "
                f"--seq-length={args.seq_length}"
            )
    if ecfg.mode == "sliced" and not ecfg.router.hard:
        raise ConfigError("--elastic-soft-masks needs --elastic-mode masked")
    check_eval_covers_budgets(args, len(resolved.budgets))
    if ecfg.teacher != "frozen":
        raise ConfigError(
            "Elastic training inside megatron.training.pretrain uses a frozen teacher "
            "(--elastic-teacher frozen); use `elastic-plugin elastic-train` for "
            "--elastic-teacher self"
        )
    teacher_dir = args.elastic_teacher_ckpt or args.elastic_ckpt
    tcfg, _ = checkpoint_config(teacher_dir, "--elastic-teacher-ckpt")
    if tcfg.model != cfg.model:
        raise ConfigError(
            f"--elastic-teacher-ckpt {teacher_dir}: another architecture than --elastic-ckpt"
        )
    return cfg, ecfg, resolved, meta


def check_eval_covers_budgets(args: argparse.Namespace, budgets: int) -> None:
    """``forward_step`` evaluates one budget per micro-batch, in turn: an evaluation with fewer
    micro-batches than budgets would log ``lm loss <budget> nan`` for the ones it never reached."""
    eval_iters = getattr(args, "eval_iters", None)
    if not eval_iters or not getattr(args, "global_batch_size", None):
        return
    dp = getattr(args, "data_parallel_size", None) or 1
    per_iteration = max(1, args.global_batch_size // (args.micro_batch_size * dp))
    if eval_iters * per_iteration < budgets:
        need = -(-budgets // per_iteration)
        raise ConfigError(
            f"--eval-iters {eval_iters} evaluates {eval_iters * per_iteration} micro-batches "
            f"({per_iteration} per iteration), one budget each; {budgets} budgets need "
            f"--eval-iters >= {need}"
        )


def check_built_vocab(model: Any, expected: ModelConfig, ckpt: str) -> None:
    """Megatron pads the tokenizer's vocabulary (``--make-vocab-size-divisible-by`` x TP); a
    model built at another size cannot take the checkpoint's embedding."""
    built = getattr(model, "vocab_size", None)
    if built is not None and built != expected.vocab_size:
        raise ConfigError(
            f"--elastic-ckpt {ckpt}: the model provider built a vocabulary of {built}, the "
            f"checkpoint's is {expected.vocab_size}: Megatron pads the tokenizer's size "
            f"(--vocab-size / --tokenizer-model) to a multiple of --make-vocab-size-divisible-by "
            f"x --tensor-model-parallel-size; choose them so the padded size is "
            f"{expected.vocab_size}"
        )


def align_rotary(model: Any, expected: ModelConfig) -> bool:
    """Give a built model the checkpoint's RoPE scaling when its provider could not.

    Megatron-LM's hybrid model builder (``megatron.training.models.hybrid``) ignores
    ``--use-rope-scaling`` (only its GPT builder passes it), so a user's ``pretrain_mamba.py``
    provider builds plain RoPE even with the flag: the student would not be the checkpoint's
    function. The rotary module holds no parameters, so swapping in the scaled one
    (``models.builder.scaled_rotary_embedding``) changes no weight. Returns whether it swapped."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if not expected.rope_scaling or rotary is None:
        return False
    import torch

    from elastic_plugin.models.builder import scaled_rotary_embedding

    unscaled = getattr(rotary, "inv_freq", None)
    scaled_rotary_embedding(expected, model)
    return unscaled is None or not torch.equal(unscaled.cpu(), model.rotary_pos_emb.inv_freq.cpu())


def print_arch_flags(argv: list[str], prog: str = "megatron_lm_args") -> int:
    """Print the Megatron-LM architecture flags of ``--elastic-ckpt`` (for a launch script)."""
    import sys

    parser = argparse.ArgumentParser(prog=f"{prog} --print-arch-flags")
    parser.add_argument("--print-arch-flags", action="store_true")
    parser.add_argument("--elastic-ckpt", required=True, metavar="DIR")
    args, _ = parser.parse_known_args(argv)
    try:
        cfg, _ = checkpoint_config(args.elastic_ckpt, "--elastic-ckpt")
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(" ".join(render_arch_flags(cfg.model)))
    return 0


if __name__ == "__main__":  # python -m elastic_plugin.elastic.megatron_lm_args --elastic-ckpt DIR
    import sys

    sys.exit(print_arch_flags(sys.argv[1:]))
