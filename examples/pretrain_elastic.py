"""Elastic nested training inside Megatron-LM's own training loop (``megatron.training.pretrain``).

For teams that launch ``pretrain_gpt.py`` / ``pretrain_mamba.py``: the same structure (model
provider, forward step, dataset provider, ``pretrain``), so Megatron-LM's logging, checkpointing
(``--save``/``--load``), data blending, batch-size ramp-up and fault tolerance all apply. The model
is the importance-reordered checkpoint written by ``elastic-plugin reorder`` (``--elastic-ckpt``);
its architecture must match Megatron's model flags, which this script prints for you::

    read -r -a ARCH <<< "$(python examples/pretrain_elastic.py --print-arch-flags \\
        --elastic-ckpt OUT/checkpoints/reordered)"
    torchrun --nproc_per_node 8 examples/pretrain_elastic.py "${ARCH[@]}" \\
        --elastic-ckpt OUT/checkpoints/reordered --elastic-budgets 1.0 0.77 0.4 \\
        --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4 \\
        --micro-batch-size 4 --global-batch-size 256 --seq-length 4096 --train-iters 10000 \\
        --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --bf16 \\
        --data-path ... --tokenizer-type ... --save CKPT --load CKPT

Without CUDA (CPU + gloo, e.g. for a smoke test) add ``--distributed-backend gloo``; ``main()``
applies ``elastic_plugin.compat.megatron_training.enable_cpu_megatron_training()``, a no-op
with CUDA (tests/test_pretrain_elastic.py runs this script so, in every TP/EP/DP layout).

Limits (use ``elastic-plugin elastic-train`` for these): ``pretrain`` runs one forward-backward
schedule per iteration, so the frozen teacher's logits are computed inline, micro-batch by
micro-batch, which needs the whole model on one pipeline stage: **pipeline_model_parallel_size
must be 1** (``elastic-plugin elastic-train`` runs a separate teacher pass through Megatron's
schedules and supports PP > 1). Megatron-LM's ``--save`` directories are layout-independent
(``elastic_plugin.elastic.megatron_lm``: canonical order on disk, ``elastic_meta.json`` in each
``iter_NNNNNNN``), so ``elastic-plugin inspect / extract / export / generate`` read them and
``--load`` reads them in any TP/EP layout (another layout's optimizer state needs
``--no-load-optim``). The script imports nothing heavy at import time.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(_REPO))

from elastic_plugin.elastic.args import add_elastic_args, elastic_config_from_args  # noqa: E402
from elastic_plugin.models.config import ConfigError, ModelConfig  # noqa: E402

PP_ERROR = (
    "examples/pretrain_elastic.py needs --pipeline-model-parallel-size 1: megatron.training."
    "pretrain runs one schedule per iteration, so the teacher's logits are computed inline "
    "on the stage that holds the whole model. For pipeline parallelism use "
    "`elastic-plugin elastic-train` (it runs a separate teacher pass through Megatron's "
    "pipeline schedules), e.g. torchrun ... -m elastic_plugin.cli elastic-train --ckpt "
    "CKPT --pipeline-model-parallel-size 2 ..."
)


# ------------------------------------------------------------------------------ arguments
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
        if isinstance(self.value, float) and isinstance(got, (int, float)):
            return abs(got - self.value) <= 1e-12 * max(1.0, abs(self.value))
        return got == self.value


def arch_flags(model: ModelConfig) -> list[ArchFlag]:
    """The Megatron-LM flags that describe ``model`` (the checkpoint's architecture)."""
    flags = [
        ArchFlag("--hybrid-layer-pattern", "hybrid_layer_pattern", model.hybrid_layer_pattern),
        ArchFlag("--num-layers", "num_layers", model.num_layers),
        ArchFlag("--hidden-size", "hidden_size", model.hidden_size),
        ArchFlag("--num-attention-heads", "num_attention_heads", max(model.num_attention_heads, 1)),
        ArchFlag("--max-position-embeddings", "max_position_embeddings", model.max_sequence_length),
        ArchFlag(
            "--position-embedding-type", "position_embedding_type", model.position_embedding_type
        ),
        ArchFlag("--normalization", "normalization", model.normalization),
        ArchFlag("--norm-epsilon", "layernorm_epsilon", model.layernorm_epsilon),
        ArchFlag("--init-method-std", "init_method_std", model.init_method_std),
        ArchFlag(
            "--untie-embeddings-and-output-weights",
            "untie_embeddings_and_output_weights",
            model.untie_embeddings_and_output_weights,
            "store_true",
        ),
        ArchFlag("--disable-bias-linear", "add_bias_linear", model.add_bias_linear, "store_false"),
    ]
    if model.position_embedding_type == "rope":
        flags.append(ArchFlag("--rotary-base", "rotary_base", model.rotary_base))
    if model.activation in ("squared_relu", "swiglu"):
        flags.append(
            ArchFlag(
                f"--{model.activation.replace('_', '-')}", model.activation, True, "store_true"
            )
        )
    if model.count("attention"):
        flags.append(ArchFlag("--kv-channels", "kv_channels", model.head_dim))
        if model.query_groups != model.num_attention_heads:
            flags += [
                ArchFlag("--group-query-attention", "group_query_attention", True, "store_true"),
                ArchFlag("--num-query-groups", "num_query_groups", model.query_groups),
            ]
    if model.count("mlp"):
        flags.append(ArchFlag("--ffn-hidden-size", "ffn_hidden_size", model.ffn_hidden_size))
    if model.count("mamba"):
        flags += [
            ArchFlag("--mamba-num-heads", "mamba_num_heads", model.mamba_num_heads),
            ArchFlag("--mamba-head-dim", "mamba_head_dim", model.mamba_head_dim),
            ArchFlag("--mamba-num-groups", "mamba_num_groups", model.mamba_num_groups),
            ArchFlag("--mamba-state-dim", "mamba_state_dim", model.mamba_state_dim),
        ]
    if model.count("moe"):
        flags += [
            ArchFlag("--num-experts", "num_experts", model.num_moe_experts),
            ArchFlag("--moe-router-topk", "moe_router_topk", model.moe_router_topk),
            ArchFlag("--moe-ffn-hidden-size", "moe_ffn_hidden_size", model.moe_ffn_hidden_size),
            ArchFlag(
                "--moe-router-score-function",
                "moe_router_score_function",
                model.moe_router_score_function,
            ),
            ArchFlag(
                "--moe-router-enable-expert-bias",
                "moe_router_enable_expert_bias",
                model.moe_router_enable_expert_bias,
                "store_true",
            ),
        ]
        if model.moe_shared_expert_intermediate_size:
            flags.append(
                ArchFlag(
                    "--moe-shared-expert-intermediate-size",
                    "moe_shared_expert_intermediate_size",
                    model.moe_shared_expert_intermediate_size,
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
            f"architecture: {'; '.join(wrong)}. Print the right flags with `python "
            f"examples/pretrain_elastic.py --print-arch-flags --elastic-ckpt {ckpt}`"
        )


def _checkpoint_config(path: str | None, flag: str):
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


# ------------------------------------------------------------------------------ the session
@dataclass
class ElasticSession:
    """What forward_step needs and Megatron's model does not hold: the frozen teacher and the
    budget sampling / routing / loss state (``elastic.step.ElasticStep``)."""

    step: Any  # ElasticStep
    teacher: Any  # torch.nn.Module, frozen, outside the optimizer and the checkpoint
    resolved: Any  # ResolvedElastic
    train_iters: int
    cfg: Any  # ExperimentConfig of --elastic-ckpt
    ecfg: Any  # ElasticConfig (the checkpoint's elastic: section, then the --elastic-* flags)
    source_meta: dict  # --elastic-ckpt's metadata (its data and tokenizer, for our tools)
    log: Any = None  # ElasticLog: per-budget losses, choices, throughput (elastic.megatron_lm_log)
    _iteration: int = -1
    _local: int = 0
    _eval_local: int = 0


_SESSION: ElasticSession | None = None


def session() -> ElasticSession:
    if _SESSION is None:
        raise RuntimeError("examples/pretrain_elastic.py: model_provider has not run yet")
    return _SESSION


def elastic_setup(args: argparse.Namespace):
    """Checks that need only the arguments: (ExperimentConfig, ElasticConfig, resolved)."""
    from elastic_plugin.elastic.megatron_lm import check_checkpoint_args

    if (args.pipeline_model_parallel_size or 1) > 1:
        raise ConfigError(PP_ERROR)
    check_checkpoint_args(args)
    if getattr(args, "virtual_pipeline_model_parallel_size", None):
        raise ConfigError(PP_ERROR)
    cfg, meta = _checkpoint_config(args.elastic_ckpt, "--elastic-ckpt")
    check_arch_args(args, cfg.model, args.elastic_ckpt)
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    if (tp > 1 or ep > 1) and not meta.get("reordered"):
        raise ConfigError(
            f"--elastic-ckpt {args.elastic_ckpt} is not importance-reordered; run "
            f"`elastic-plugin reorder` first (needed for TP/EP > 1)"
        )
    ecfg = elastic_config_from_args(
        args, base=cfg.elastic, base_source=f"--elastic-ckpt {args.elastic_ckpt}"
    )
    resolved = ecfg.resolve(cfg.model, tp, ep)
    for i, stage in enumerate(ecfg.curriculum):
        if stage.seq_length and args.seq_length and stage.seq_length > args.seq_length:
            raise ConfigError(
                f"elastic.curriculum[{i}].seq_length={stage.seq_length} exceeds "
                f"--seq-length={args.seq_length}"
            )
    if ecfg.mode == "sliced" and not ecfg.router.hard:
        raise ConfigError("--elastic-soft-masks needs --elastic-mode masked")
    _check_eval_covers_budgets(args, len(resolved.budgets))
    if ecfg.teacher != "frozen":
        raise ConfigError(
            "examples/pretrain_elastic.py trains with a frozen teacher "
            "(--elastic-teacher frozen); use `elastic-plugin elastic-train` for "
            "--elastic-teacher self"
        )
    teacher_dir = args.elastic_teacher_ckpt or args.elastic_ckpt
    tcfg, _ = _checkpoint_config(teacher_dir, "--elastic-teacher-ckpt")
    if tcfg.model != cfg.model:
        raise ConfigError(
            f"--elastic-teacher-ckpt {teacher_dir}: another architecture than --elastic-ckpt"
        )
    return cfg, ecfg, resolved, meta


def _check_eval_covers_budgets(args: argparse.Namespace, budgets: int) -> None:
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


def _build(
    model_cfg: ModelConfig,
    args: argparse.Namespace,
    pre_process: bool,
    post_process: bool,
    vp_stage,
    pg_collection,
):
    import torch

    from elastic_plugin.models.builder import build_hybrid_model, transformer_config
    from elastic_plugin.models.config import ParallelConfig

    parallel = ParallelConfig(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.expert_model_parallel_size,
        bool(args.sequence_parallel),
    )
    dtype = getattr(args, "params_dtype", None) or torch.float32
    overrides = {}
    if getattr(args, "calculate_per_token_loss", None) is not None:
        overrides["calculate_per_token_loss"] = args.calculate_per_token_loss
    config = transformer_config(model_cfg, parallel, dtype, **overrides)
    return build_hybrid_model(
        model_cfg, config, pre_process, post_process, vp_stage, pg_collection=pg_collection
    )


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage=None,
    config=None,
    pg_collection=None,
):
    """Megatron model provider: the reordered checkpoint, elastic, with its budget router; also
    builds the frozen teacher (kept in this module, not in Megatron's model list)."""
    global _SESSION
    import torch
    from megatron.training import get_args

    from elastic_plugin.checkpoint.io import load_checkpoint
    from elastic_plugin.elastic.cost import ElasticCost
    from elastic_plugin.elastic.model import attach_elastic
    from elastic_plugin.elastic.router import AnnealSchedule
    from elastic_plugin.elastic.sampling import BudgetSampler, Stage
    from elastic_plugin.elastic.step import ElasticStep

    args = get_args()
    cfg, ecfg, resolved, source_meta = elastic_setup(args)
    model = _build(cfg.model, args, pre_process, post_process, vp_stage, pg_collection)
    load_checkpoint([model], args.elastic_ckpt)
    state = attach_elastic(
        model,
        resolved,
        bool(args.sequence_parallel) and args.tensor_model_parallel_size > 1,
        router_seed=args.seed,
    )
    teacher_dir = args.elastic_teacher_ckpt or args.elastic_ckpt
    teacher = _build(cfg.model, args, pre_process, post_process, vp_stage, pg_collection)
    load_checkpoint([teacher], teacher_dir)
    teacher.requires_grad_(False)
    teacher.eval()
    if torch.cuda.is_available():
        teacher.cuda(torch.cuda.current_device())
    if getattr(args, "bf16", False) or getattr(args, "fp16", False):
        from megatron.core.transformer.module import Float16Module

        teacher = Float16Module(teacher.config, teacher)
    total = args.train_iters or max(1, (args.train_samples or 1) // args.global_batch_size)
    anneal = ecfg.router.anneal_iters or total
    stages = [Stage(s.iters, s.budget_probs, s.seq_length) for s in ecfg.curriculum] or None
    step = ElasticStep(
        state=state,
        sampler=BudgetSampler(resolved.budgets, stages, args.seed, total),
        cost=ElasticCost(cfg.model, resolved),
        temperature=AnnealSchedule(*ecfg.router.temperature, anneal),
        logit_scale=AnnealSchedule(*ecfg.router.logit_scale, anneal),
        num_microbatches=1,  # forward_step sets Megatron's current number
        teacher_chunks=[teacher],
    )
    _SESSION = ElasticSession(step, teacher, resolved, total, cfg, ecfg, source_meta)
    _SESSION.log = _elastic_log(model, step, resolved)
    return model


def _elastic_log(model, step, resolved):
    """The ``elastic |`` log line's accumulator (``elastic.megatron_lm_log``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from elastic_plugin.elastic.megatron_lm_log import ElasticLog
    from elastic_plugin.elastic.train import choice_table

    return ElasticLog(
        list(resolved.budgets),
        {name: spec.full for name, spec in resolved.axes.items()},
        lambda: choice_table(step_router(model), resolved),
        step.take_flops,
        world=dist.get_world_size(),
        data_parallel=ps.get_data_parallel_world_size(),
        group=ps.get_data_parallel_group(),
    )


def checkpoint_meta_for_save(iteration: int, chunks: list) -> dict[str, Any]:
    """What Megatron-LM's ``--save`` directories carry for our tools (``elastic.megatron_lm``):
    the elastic checkpoint metadata ``elastic-train`` writes, from the router's choices now."""
    from megatron.training import get_args

    from elastic_plugin.elastic.train import checkpoint_meta, choice_table
    from elastic_plugin.parallel import Layout

    args, run = get_args(), session()
    layout = Layout(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.expert_model_parallel_size,
        bool(args.sequence_parallel),
        bool(args.use_distributed_optimizer),
    )
    training = dataclasses.replace(run.cfg.training, bf16=bool(getattr(args, "bf16", False)))
    meta = checkpoint_meta(
        dataclasses.replace(run.cfg, training=training),
        run.ecfg,
        layout,
        run.resolved,
        choice_table(step_router(chunks[0]), run.resolved),
        iteration,
        int(getattr(args, "consumed_train_samples", 0) or 0),
        None,
    )
    source = {k: run.source_meta.get(k) for k in ("data", "tokenizer") if k in run.source_meta}
    return {**meta, **source, "megatron_lm": {"ckpt_format": args.ckpt_format}}


# ------------------------------------------------------------------------------ data
def _megatron_tp_broadcast():
    """Megatron-LM's ``get_batch_on_this_tp_rank(data_iterator)`` (reads on TP rank 0 and
    broadcasts) where this Megatron-LM has it and CUDA runs; None: every TP rank reads its own
    (identical) batch, as on CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        from megatron.training.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    except ImportError:
        return None
    return lambda it: get_batch_on_this_cp_rank(get_batch_on_this_tp_rank(it))


def get_batch(data_iterator) -> dict[str, Any]:
    """tokens, labels, loss_mask, attention_mask, position_ids of one micro-batch on this rank."""
    broadcast = _megatron_tp_broadcast()
    if broadcast is not None:
        return dict(broadcast(data_iterator))
    from elastic_plugin.training.step import get_batch as read_local

    return read_local(data_iterator)


def is_dataset_built_on_rank(vp_stage=None) -> bool:
    from megatron.core import parallel_state as ps

    if _megatron_tp_broadcast() is None:
        return True
    return ps.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """GPT datasets from Megatron's data flags (``--data-path``/``--split``/``--mock-data``)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer, print_rank_0
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    print_rank_0("> building elastic train, validation and test datasets ...")
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset if args.mock_data else GPTDataset,
        train_val_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        config,
    ).build()


# ------------------------------------------------------------------------------ forward step
def _position_ids(batch: dict) -> Any:
    import torch

    tokens = batch["tokens"]
    if batch.get("position_ids") is not None:
        return batch["position_ids"]
    return torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)


def _train_loss(step, index: int, probs, batch: dict, output_tensor):
    """``ElasticStep._loss`` (KD + budget loss) reported the way Megatron's loop logs losses
    (all budgets together; per budget in the ``elastic |`` line, ``session().log``)."""
    import torch

    try:
        total, num_tokens, report = step._loss(0, index, probs, batch, output_tensor)
    finally:
        step._teacher_logits = []
    session().log.add(report["elastic"])
    kd_sum, tokens, b_loss = (report["elastic"][i].to(total.device) for i in range(3))
    return (
        total,
        num_tokens,
        {
            "kd loss": torch.stack([kd_sum, tokens]).float(),
            "budget loss": torch.stack([b_loss * tokens, tokens]).float(),
        },
    )


def _eval_loss(labels_budget: list[str], current: str, loss_mask, output_tensor):
    """Per-token LM loss of the budget this micro-batch evaluated; zeros for the others, so
    Megatron's evaluation (sums over all micro-batches) yields one mean per budget."""
    import torch

    mask = loss_mask.float()
    loss_sum = (output_tensor.float() * mask).sum()
    tokens = mask.sum()
    zero = torch.zeros(2, device=loss_sum.device)
    report = {
        f"lm loss {label}": (torch.stack([loss_sum.detach(), tokens]) if label == current else zero)
        for label in labels_budget
    }
    return loss_sum, tokens.to(torch.int), report


def forward_step(data_iterator, model):
    """Megatron forward step. Training: draw this micro-batch's budget, route, run the student,
    and distil from the teacher's logits computed here. Evaluation: each budget's nested model
    (the router's hard choice) in turn, LM loss per budget."""
    import torch
    from megatron.training import get_args

    from elastic_plugin.elastic.megatron_lm import unwrap_chunk
    from elastic_plugin.elastic.step import truncate_batch
    from elastic_plugin.elastic.train import choice_table

    run = session()
    step = run.step
    inner = unwrap_chunk(model)
    batch = get_batch(data_iterator)
    if not inner.training:
        table = choice_table(step_router(inner), run.resolved)
        labels = list(table)
        current = labels[run._eval_local % len(labels)]
        run._eval_local += 1
        step.state.set_sizes(table[current])
        output = model(
            batch["tokens"],
            _position_ids(batch),
            batch.get("attention_mask"),
            labels=batch["labels"],
        )
        return output, partial(_eval_loss, labels, current, batch["loss_mask"])
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    iteration = int(getattr(get_args(), "curr_iteration", 0) or 0) + 1
    if iteration != run._iteration:
        run._iteration, run._local = iteration, 0
        run.log.iteration_started()
    step.iteration = iteration
    step.num_microbatches = get_num_microbatches()
    local = run._local
    run._local += 1
    batch = truncate_batch(batch, step.sampler.seq_length(iteration))
    step._shape = tuple(batch["tokens"].shape[::-1])  # (sequence length, micro-batch size)
    with torch.no_grad():
        step._teacher_logits = [
            run.teacher(batch["tokens"], _position_ids(batch), batch.get("attention_mask"))
        ]
    index, probs = step.route(inner, local)
    active = step.state.is_active
    step.flops += step.choice_flops(probs if active else None) + step.choice_flops(None, False)
    output = model(batch["tokens"], _position_ids(batch), batch.get("attention_mask"))
    return output, partial(_train_loss, step, index, probs, batch)


def step_router(inner):
    from elastic_plugin.elastic.model import router_of

    return router_of(inner)


# ------------------------------------------------------------------------------ launch
def with_router_param_group(get_optimizer_config, lr_mult_of):
    """Wrap Megatron-LM's ``get_megatron_optimizer_config(args)``: the router trains at
    ``lr_mult`` x the model's learning rate, in its own parameter group (Megatron-LM has no hook
    for extra parameter groups)."""
    from elastic_plugin.elastic.model import router_param_groups

    def get_config(args):
        config, overrides = get_optimizer_config(args)
        groups = router_param_groups(args.lr, args.min_lr or 0.0, lr_mult_of(args))
        return config, {**(overrides or {}), **groups}

    return get_config


def _router_lr_mult(args) -> float:
    return elastic_setup(args)[1].router.lr_mult


def print_arch_flags(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pretrain_elastic.py --print-arch-flags")
    parser.add_argument("--print-arch-flags", action="store_true")
    parser.add_argument("--elastic-ckpt", required=True, metavar="DIR")
    args, _ = parser.parse_known_args(argv)
    try:
        cfg, _ = _checkpoint_config(args.elastic_ckpt, "--elastic-ckpt")
    except ConfigError as exc:
        print(f"pretrain_elastic.py: error: {exc}", file=sys.stderr)
        return 2
    print(" ".join(render_arch_flags(cfg.model)))
    return 0


def main() -> None:
    import inspect

    import megatron.training.training as megatron_training
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    from elastic_plugin.compat.megatron_training import enable_cpu_megatron_training
    from elastic_plugin.elastic.megatron_lm import install_checkpoint_hooks
    from elastic_plugin.elastic.megatron_lm_log import install_log_hook

    enable_cpu_megatron_training()  # CPU + gloo (--distributed-backend gloo); no-op with CUDA
    install_checkpoint_hooks(checkpoint_meta_for_save)  # --save/--load in our layout
    install_log_hook(lambda: _SESSION.log if _SESSION is not None else None)
    if hasattr(megatron_training, "get_megatron_optimizer_config"):
        megatron_training.get_megatron_optimizer_config = with_router_param_group(
            megatron_training.get_megatron_optimizer_config, _router_lr_mult
        )
    train_valid_test_datasets_provider.is_distributed = True
    try:
        if next(iter(inspect.signature(pretrain).parameters)) == "cfg_container":
            # Megatron-LM with config containers (megatron-core >= 0.17's megatron.training)
            from megatron.training.argument_utils import pretrain_cfg_container_from_args
            from megatron.training.arguments import parse_and_validate_args

            args = parse_and_validate_args(extra_args_provider=add_pretrain_elastic_args)
            elastic_setup(args)  # fail before Megatron builds anything
            pretrain(
                pretrain_cfg_container_from_args(args),
                train_valid_test_datasets_provider,
                ModelType.encoder_or_decoder,
                forward_step,
                model_provider=model_provider,
            )
        else:
            pretrain(
                train_valid_test_datasets_provider,
                model_provider,
                ModelType.encoder_or_decoder,
                forward_step,
                extra_args_provider=add_pretrain_elastic_args,
            )
    except ConfigError as exc:  # bad flags, or a --load that cannot continue (every rank)
        print(f"pretrain_elastic.py: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    if "--print-arch-flags" in sys.argv:
        sys.exit(print_arch_flags(sys.argv[1:]))
    main()
