"""Context parallelism (CP) on our own layers: checks, the batch split, and the loss scale.

Layout (Megatron's, so its rotary slicing and Mamba CP agree with ours): the sequence is cut into
``2 * cp`` equal chunks and CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``. Under causal
attention the early chunks are cheap and the late ones dear; the mirrored pair gives every rank
the same attention work. Megatron's ``get_batch_on_this_cp_rank`` does the split; RoPE under CP
is sliced the same way inside Megatron's ``RotaryEmbedding`` (positions stay global); Megatron's
``MambaContextParallel`` undoes and redoes the order around the scan. The attention on our SDPA
path (``models.attention``) gathers K/V over the CP group and masks each query chunk causally at
its global offset.

Loss: every CP rank sums its own tokens' losses; :func:`loss_scale` rescales a rank's
token-summed loss so that the sum over CP ranks of what Megatron's schedule and DDP make of it is
the mean over the whole sequence (Megatron's DDP averages gradients over data x context parallel).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elastic_plugin.models.config import ConfigError, ModelConfig

if TYPE_CHECKING:  # the checks are imported by torch-free command-line parsing
    import torch

FLAG = "--context-parallel-size"


def check_context_parallel(
    model: ModelConfig, cp: int, tp: int = 1, seq_length: int | None = None
) -> None:
    """Refuse a CP size the model or the sequence cannot serve, naming the flag (before any
    model is built)."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ConfigError(f"{FLAG}={cp!r}: must be an int >= 1")
    if cp == 1:
        return
    if seq_length is not None and seq_length % (2 * cp):
        raise ConfigError(
            f"{FLAG}={cp} needs a sequence length divisible by 2 x {cp} = {2 * cp} (each CP rank "
            f"holds two mirrored chunks of the sequence), got --seq-length {seq_length}"
        )
    if model.count("mamba"):
        groups = model.mamba_num_groups // max(tp, 1)
        if groups % cp:
            raise ConfigError(
                f"{FLAG}={cp} must divide the Mamba groups per tensor-parallel rank "
                f"(model.mamba_num_groups={model.mamba_num_groups} / TP {tp} = {groups}): under CP "
                "each rank scans whole groups over the whole sequence, so the nested heads of a "
                "group stay on one rank"
            )
    if model.count("attention") and model.position_embedding_type not in ("none", "rope"):
        raise ConfigError(
            f"{FLAG}={cp}: position embedding {model.position_embedding_type!r} is not supported "
            "under context parallelism (allowed: 'none', 'rope')"
        )


def cp_size() -> int:
    """This process's context-parallel size (1 outside a Megatron layout)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1
    return ps.get_context_parallel_world_size()


def chunk_order(cp: int) -> list[int]:
    """The chunks held by CP ranks 0, 1, ... in the order an all-gather lays them out."""
    order: list[int] = []
    for rank in range(cp):
        order += [rank, 2 * cp - 1 - rank]
    return order


def split_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """This CP rank's two mirrored chunks of every sequence-shaped tensor (Megatron's split).

    The SDPA path builds the causal mask of each chunk itself: a batch's ``attention_mask`` that
    is the plain causal mask (Megatron's datasets make one) is dropped; any other (document
    boundaries: ``reset_attention_mask``) is refused, since its keys would need gathering too."""
    import torch

    cp = cp_size()
    if cp == 1:
        return batch
    mask = batch.get("attention_mask")
    if mask is not None:
        if not is_causal_mask(mask):
            raise ConfigError(
                f"{FLAG}={cp}: only causal attention is supported under context parallelism; "
                f"the batch's attention_mask {tuple(mask.shape)} is another mask (document "
                "boundaries?)"
            )
        batch = {**batch, "attention_mask": None}
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] % (2 * cp):
            raise ConfigError(
                f"{FLAG}={cp} needs a sequence length divisible by {2 * cp}; batch field "
                f"{key!r} has {value.shape[1]} positions"
            )
    parts = {k: v for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 2}
    rest = {k: v for k, v in batch.items() if k not in parts}
    split = get_batch_on_this_cp_rank(
        {**parts, "cu_seqlens": None}, is_hybrid_cp=False, cp_group=ps.get_context_parallel_group()
    )
    split.pop("cu_seqlens", None)
    return {**rest, **split}


def is_causal_mask(mask: torch.Tensor, query_positions: torch.Tensor | None = None) -> bool:
    """Whether a boolean ``mask`` [..., sq, sk] (True = masked) is plain causal attention for
    queries at ``query_positions`` (default ``0 .. sq-1``) over keys ``0 .. sk-1``."""
    import torch

    if mask.dtype != torch.bool:
        return False
    sq, sk = mask.shape[-2:]
    rows = torch.arange(sq, device=mask.device) if query_positions is None else query_positions
    if rows.numel() != sq:
        return False
    causal = torch.arange(sk, device=mask.device)[None, :] > rows.to(mask.device)[:, None]
    return bool(torch.equal(mask, causal.expand_as(mask)))


def loss_scale(num_tokens: torch.Tensor) -> torch.Tensor:
    """The factor that makes this CP rank's token-summed loss, divided by its own ``num_tokens``
    (Megatron's schedule) and averaged over the CP ranks (its DDP), the whole sequence's
    token mean: ``cp * local / global`` (1 when the ranks hold as many loss tokens each)."""
    import torch
    import torch.distributed as dist

    cp = cp_size()
    if cp == 1:
        return torch.ones((), dtype=torch.float32, device=num_tokens.device)
    from megatron.core import parallel_state as ps

    local = num_tokens.detach().to(torch.float64).reshape(1)
    total = local.clone()
    dist.all_reduce(total, group=ps.get_context_parallel_group())
    return (cp * local / total.clamp(min=1)).reshape(()).to(torch.float32)
