"""How a global batch splits into micro-batches: checked once, for every trainer and command.

Megatron's schedules run ``global_batch / (micro_batch x data-parallel size)`` micro-batches per
iteration on each data-parallel replica; a global batch that does not divide is refused here,
naming the caller's own spelling of the two sizes (a config field or a flag). Torch-free, so a
command checks it while parsing, before any model is built.
"""

from __future__ import annotations

from elastic_plugin.models.config import ConfigError

__all__ = ["microbatches_per_step"]


def microbatches_per_step(
    global_batch: int,
    micro_batch: int,
    data_parallel: int,
    *,
    names: tuple[str, str] = ("global_batch_size", "micro_batch_size"),
    context: str = "",
) -> int:
    """Micro-batches per iteration on each replica; ``ConfigError`` when they do not divide.

    ``names``: how the caller spells the global and micro batch sizes (``--global-batch-size``
    or ``training.global_batch_size``); ``context``: what the data-parallel size came from.
    """
    if global_batch % (micro_batch * data_parallel):
        raise ConfigError(
            f"{names[0]}={global_batch} must be a multiple of {names[1]}={micro_batch} x "
            f"data-parallel size {data_parallel}{context}"
        )
    return global_batch // (micro_batch * data_parallel)
