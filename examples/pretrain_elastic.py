"""Elastic nested training inside Megatron-LM's own training loop (``megatron.training.pretrain``).

For teams that launch ``pretrain_gpt.py`` / ``pretrain_mamba.py``: the same structure (model
provider, forward step, dataset provider, ``pretrain``), so Megatron-LM's logging, checkpointing
(``--save``/``--load``), data blending, batch-size ramp-up and fault tolerance all apply. The
elastic part is the four lines of ``main()`` (``elastic_plugin.elastic.megatron_lm_pretrain``),
the same ones a user adds to their own script (README, "Inside your Megatron-LM pipeline"). The
model is the importance-reordered checkpoint written by ``elastic-plugin reorder`` (``--elastic-ckpt``);
its architecture must match Megatron's model flags, which this script prints for you::

    read -r -a ARCH <<< "$(python examples/pretrain_elastic.py --print-arch-flags \\
        --elastic-ckpt OUT/checkpoints/reordered)"
    torchrun --nproc_per_node 8 examples/pretrain_elastic.py "${ARCH[@]}" \\
        --elastic-ckpt OUT/checkpoints/reordered --elastic-budgets 1.0 0.77 0.4 \\
        --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4 \\
        --micro-batch-size 4 --global-batch-size 256 --seq-length 4096 --train-iters 10000 \\
        --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --bf16 \\
        --data-path ... --tokenizer-type ... --save CKPT --load CKPT

Without CUDA (CPU + gloo, e.g. for a smoke test) add ``--distributed-backend gloo``;
``elastic.install()`` applies ``elastic_plugin.compat.megatron_training.
enable_cpu_megatron_training()``, a no-op with CUDA (tests/test_pretrain_elastic.py runs this script so, in every TP/EP/DP layout).

Pipeline parallelism: with one stage the frozen teacher's logits are computed inline in the forward
step; with ``--pipeline-model-parallel-size N`` the wrapped ``train_step`` runs the teacher as a
separate forward-only pass through Megatron's pipeline schedule first (virtual pipeline stages are
refused). Megatron-LM's ``--save`` directories are layout-independent
(``elastic_plugin.elastic.megatron_lm``: canonical order on disk, ``elastic_meta.json`` in each
``iter_NNNNNNN``), so ``elastic-plugin inspect / extract / export / generate`` read them and
``--load`` reads them in any TP/EP layout (another layout's optimizer state needs
``--no-load-optim``). The script imports nothing heavy at import time.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(_REPO))

from elastic_plugin.elastic.megatron_lm_args import (  # noqa: E402
    checkpoint_config,
    elastic_setup,
    print_arch_flags,
)
from elastic_plugin.models.config import ConfigError, ModelConfig  # noqa: E402


# ------------------------------------------------------------------------------ the model
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
    from elastic_plugin.models.config import Layout

    parallel = Layout(
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        ep=args.expert_model_parallel_size,
        sequence_parallel=bool(args.sequence_parallel),
        cp=getattr(args, "context_parallel_size", 1) or 1,
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
    """The checkpoint's architecture (``--elastic-ckpt``) with the plugin's hybrid spec (the
    layers an elastic student needs: the local spec while Transformer Engine's linears are not
    elastic, ``models/spec_choice.py``); ``elastic.wrap_model_provider`` loads the weights and
    adds the router."""
    from megatron.training import get_args

    args = get_args()
    cfg, _ = checkpoint_config(args.elastic_ckpt, "--elastic-ckpt")
    return _build(cfg.model, args, pre_process, post_process, vp_stage, pg_collection)


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


# ------------------------------------------------------------------------------ launch
def main() -> None:
    import inspect

    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    from elastic_plugin.elastic import megatron_lm_pretrain as elastic

    elastic.install()  # CPU adaptations, --save/--load in the elastic layout, logs, router LR
    provider = elastic.wrap_model_provider(model_provider)
    forward_step = elastic.elastic_forward_step(get_batch)
    extra_args = elastic.wrap_extra_args(None)
    train_valid_test_datasets_provider.is_distributed = True
    try:
        if next(iter(inspect.signature(pretrain).parameters)) == "cfg_container":
            # Megatron-LM with config containers (megatron-core >= 0.17's megatron.training)
            from megatron.training.argument_utils import pretrain_cfg_container_from_args
            from megatron.training.arguments import parse_and_validate_args

            args = parse_and_validate_args(extra_args_provider=extra_args)
            elastic_setup(args)  # fail before Megatron initializes anything
            pretrain(
                pretrain_cfg_container_from_args(args),
                train_valid_test_datasets_provider,
                ModelType.encoder_or_decoder,
                forward_step,
                model_provider=provider,
            )
        else:
            pretrain(
                train_valid_test_datasets_provider,
                provider,
                ModelType.encoder_or_decoder,
                forward_step,
                extra_args_provider=extra_args,
            )
    except ConfigError as exc:  # bad flags, or a --load that cannot continue (every rank)
        print(f"pretrain_elastic.py: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    if "--print-arch-flags" in sys.argv:
        sys.exit(print_arch_flags(sys.argv[1:], prog="pretrain_elastic.py"))
    main()
