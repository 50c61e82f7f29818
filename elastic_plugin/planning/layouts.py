"""Every parallel layout of N GPUs that elastic-train would accept for a model and batch.

A layout is TP x PP x CP x DP = N with EP dividing DP x CP, sequence parallelism (with TP > 1)
and the distributed optimizer on or off. Context parallelism is enumerated where the model and
the sequence length allow it (``models.context_parallel.check_context_parallel``: 2 x CP chunks
of the sequence, whole Mamba groups per rank). It is valid when every check elastic-train makes before
building anything passes: ``ModelConfig.check_parallel`` (sharded dims divide), ``Layout.
check_world``, the ``elastic:`` section resolving under that TP/EP (``ElasticConfig.resolve``:
every candidate width splits), ``Runtime.check`` (recomputed layers per stage), and the two
rules elastic-train states inline: MoE with TP > 1 needs sequence parallelism
(``elastic/inputs.py``), and the global batch is a multiple of micro-batch x DP
(``elastic/train.py``); the vocabulary must split over TP (``VocabParallelEmbedding``).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_plugin.elastic.config import ElasticConfig, ResolvedElastic
from elastic_plugin.models.config import ConfigError, Layout, ModelConfig
from elastic_plugin.models.runtime import Runtime

__all__ = ["PlanLayout", "enumerate_layouts"]


@dataclass(frozen=True)
class PlanLayout(Layout):
    """The one layout type (``models.config.Layout``: what elastic-train runs) placed on the
    planned GPUs: ``dp`` is the data-parallel size left over (built with keywords)."""

    dp: int = 1

    @property
    def dp_cp(self) -> int:
        """The ranks holding the same weights (data x context parallel): Megatron reduces the
        gradients and shards the distributed optimizer over them; EP divides them."""
        return self.dp * self.cp

    @property
    def name(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        parts += [f"CP{self.cp}"] if self.cp > 1 else []
        parts += [f"EP{self.ep}", f"DP{self.dp}"]
        if self.sequence_parallel:
            parts.append("SP")
        if self.distributed_optimizer:
            parts.append("DO")
        return " ".join(parts)

    def to_dict(self) -> dict[str, object]:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "ep": self.ep,
            "dp": self.dp,
            "cp": self.cp,
            "sequence_parallel": self.sequence_parallel,
            "distributed_optimizer": self.distributed_optimizer,
            "name": self.name,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_layout(
    model: ModelConfig,
    layout: PlanLayout,
    gpus: int,
    elastic: ElasticConfig,
    runtime: Runtime,
    micro_batch_size: int,
    global_batch_size: int,
    seq_length: int | None = None,
) -> ResolvedElastic:
    """The elastic config resolved for ``layout``; ``ConfigError`` when elastic-train would
    refuse the layout (the message says why)."""
    from elastic_plugin.models.context_parallel import check_context_parallel

    tp, pp, ep, dp = layout.tp, layout.pp, layout.ep, layout.dp
    model.check_parallel(tp, pp, ep)
    layout.check_world(gpus)
    check_context_parallel(model, layout.cp, tp, seq_length)
    if tp > 1 and model.count("moe") and not layout.sequence_parallel:
        raise ConfigError("MoE layers with TP > 1 need sequence parallelism")
    if model.vocab_size % tp:
        raise ConfigError(f"model.vocab_size={model.vocab_size} is not divisible by TP {tp}")
    if global_batch_size % (micro_batch_size * dp):
        raise ConfigError(
            f"--global-batch-size={global_batch_size} is not a multiple of "
            f"--micro-batch-size={micro_batch_size} x DP {dp}"
        )
    runtime.check(model, pp)
    return elastic.resolve(model, tp, ep)


def enumerate_layouts(
    model: ModelConfig,
    gpus: int,
    elastic: ElasticConfig,
    runtime: Runtime,
    micro_batch_size: int,
    global_batch_size: int,
    distributed_optimizer: bool | None = None,
    seq_length: int | None = None,
    context_parallel: tuple[int, ...] | None = None,
) -> tuple[list[tuple[PlanLayout, ResolvedElastic]], dict[str, int]]:
    """Valid layouts with their resolved elastic config, and how many candidates each reason
    rejected. ``distributed_optimizer``: only with (True), only without (False), or both.
    ``context_parallel``: the CP sizes to consider (None: every divisor the checks accept at
    ``seq_length``)."""
    valid: list[tuple[PlanLayout, ResolvedElastic]] = []
    rejected: dict[str, int] = {}
    opt_choices = (False, True) if distributed_optimizer is None else (distributed_optimizer,)
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            for cp in _divisors(gpus // (tp * pp)):
                if context_parallel is not None and cp not in context_parallel:
                    continue
                dp = gpus // (tp * pp * cp)
                for ep in _divisors(dp * cp):
                    for sp in (False, True) if tp > 1 else (False,):
                        for dist_opt in (
                            opt_choices if dp * cp > 1 else (distributed_optimizer or False,)
                        ):
                            layout = PlanLayout(
                                tp=tp, pp=pp, ep=ep, sequence_parallel=sp,
                                distributed_optimizer=dist_opt, cp=cp, dp=dp,
                            )  # fmt: skip
                            try:
                                resolved = check_layout(
                                    model, layout, gpus, elastic, runtime,
                                    micro_batch_size, global_batch_size, seq_length,
                                )  # fmt: skip
                            except ConfigError as exc:
                                reason = str(exc).split(";")[0]
                                rejected[reason] = rejected.get(reason, 0) + 1
                                continue
                            valid.append((layout, resolved))
    return valid, rejected
