"""What every command line shares: Megatron-style layout flags, data-path checks, and the start-up
of the ranks (``start_ranks``).

Parsing and checking import no torch, so a bad command line fails in milliseconds; only
``start_ranks`` loads torch and Megatron.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from elastic_plugin.models.config import ConfigError, Layout

__all__ = [
    "add_layer_spec_arg",
    "add_layout_args",
    "add_runtime_args",
    "blend_prefixes",
    "check_data_path_args",
    "layer_spec_from_args",
    "layout_from_args",
    "runtime_from_args",
    "start_ranks",
]


def add_layout_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-style layout flags (default: the config's ``parallel:`` section)."""
    group = parser.add_argument_group("parallel layout")
    group.add_argument("--tensor-model-parallel-size", type=int, default=None)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=None)
    group.add_argument("--expert-model-parallel-size", type=int, default=None)
    group.add_argument(
        "--context-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="split every sequence over N ranks (each holds two mirrored chunks of 1/(2N), "
        "Megatron's causal load balance; the sequence length must divide by 2N)",
    )
    group.add_argument("--sequence-parallel", action="store_true", default=None)
    group.add_argument("--use-distributed-optimizer", action="store_true", default=None)
    group.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=None,
        metavar="M",
        help="how long a collective waits for a peer before the run fails naming the stuck "
        "rank (default 10)",
    )


def layout_from_args(args: argparse.Namespace, parallel: Layout) -> Layout:
    """The layout the flags name, each flag left out taken from ``parallel`` (the config's)."""

    def pick(flag: Any, default: Any) -> Any:
        return default if flag is None else flag

    timeout = getattr(args, "distributed_timeout_minutes", None)
    if timeout is not None and not timeout > 0:
        raise ConfigError(f"--distributed-timeout-minutes={timeout} must be > 0")

    return Layout(
        tp=pick(args.tensor_model_parallel_size, parallel.tp),
        pp=pick(args.pipeline_model_parallel_size, parallel.pp),
        ep=pick(args.expert_model_parallel_size, parallel.ep),
        sequence_parallel=pick(args.sequence_parallel, parallel.sequence_parallel),
        distributed_optimizer=pick(args.use_distributed_optimizer, parallel.distributed_optimizer),
        cp=pick(getattr(args, "context_parallel_size", None), parallel.cp),
    )


EXIT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "none")


def add_layer_spec_arg(parser: argparse.ArgumentParser, models: str) -> None:
    """``--layer-spec``: which layer spec the command's models get (``models/spec_choice.py``)."""
    from elastic_plugin.models.spec_choice import LAYER_SPEC_ENV, LAYER_SPECS

    parser.add_argument(
        "--layer-spec",
        default=None,
        metavar="|".join(LAYER_SPECS),
        help=f"the layers of {models}: auto (default) = Transformer Engine's spec for a model "
        "that only runs, where TE imports and a CUDA device is visible, else the local spec; "
        "local = the local spec everywhere; te = TE's spec for every model that can take it "
        "(an elastic student's layers are sliced, so it keeps the local spec); the log says "
        f"which spec each model got and why (default: ${LAYER_SPEC_ENV}, else auto)",
    )


def layer_spec_from_args(args: argparse.Namespace, roles: list[str]) -> str:
    """Check ``--layer-spec`` (else ``ELASTIC_PLUGIN_LAYER_SPEC``) for a command whose models
    have ``roles`` (``spec_choice.MODEL_ROLES``) before any rank starts; a flag given is put in
    this process's environment, which every model build reads (the frozen teacher's too)."""
    from elastic_plugin.models.spec_choice import (
        LAYER_SPEC_ENV,
        check_layer_spec_request,
        requested_layer_spec,
    )

    value = getattr(args, "layer_spec", None)
    if value is None:
        value = requested_layer_spec()
        check_layer_spec_request(value, roles, LAYER_SPEC_ENV)
        return value
    check_layer_spec_request(value, roles, "--layer-spec")
    value = value.strip().lower()
    os.environ[LAYER_SPEC_ENV] = value
    return value


def add_exit_signal_arg(parser: argparse.ArgumentParser) -> None:
    """``--exit-signal``: the preemption signal on which a training run saves and stops."""
    parser.add_argument(
        "--exit-signal",
        default="SIGTERM",
        choices=EXIT_SIGNALS,
        help="on this signal (SLURM sends SIGTERM at the time limit or on preemption, or the one "
        "a job asks for with --signal; torchrun forwards SIGTERM to every rank), save at the next "
        "step boundary and exit 0 so the requeued job resumes with --resume; Megatron-LM's "
        "DistributedSignalHandler (--exit-signal-handler there); none: die on it "
        "(default: SIGTERM)",
    )


def exit_signal_from_args(args: argparse.Namespace) -> Any:
    """The ``signal.Signals`` of ``--exit-signal`` (None for none)."""
    import signal

    name = getattr(args, "exit_signal", "SIGTERM")
    return None if name == "none" else signal.Signals[name]


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's precision and recomputation flags (default: the config's ``training:``)."""
    from elastic_plugin.models.runtime import RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS

    group = parser.add_argument_group("precision and activation memory")
    group.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="BF16 mixed precision as Megatron does it: BF16 weights and activations, FP32 main "
        "weights, gradients and optimizer state, FP32 router and losses (default: "
        "training.bf16, else FP32)",
    )
    group.add_argument(
        "--fp16",
        action="store_true",
        default=None,
        help="not supported (no loss scaling is wired); use --bf16",
    )
    group.add_argument(
        "--recompute-granularity",
        default=None,
        metavar="|".join(RECOMPUTE_GRANULARITIES),
        help="recompute activations in the backward pass: full layers, or selective (core "
        "attention only)",
    )
    group.add_argument(
        "--recompute-method",
        default=None,
        metavar="|".join(RECOMPUTE_METHODS),
        help="with full: uniform (chunks of N layers) or block (the first N layers per stage)",
    )
    group.add_argument("--recompute-num-layers", type=int, default=None, metavar="N")


def runtime_from_args(args: argparse.Namespace, training: Any, model: Any, pp: int = 1) -> Any:
    """``training`` (a ``TrainingConfig``) with the precision / recompute flags applied and
    checked: flags given replace the YAML's values, a contradiction names the flags."""
    import dataclasses

    from elastic_plugin.models.runtime import FLAG_NAMES, Runtime

    if getattr(args, "fp16", None):
        if getattr(args, "bf16", None):
            raise ConfigError("--bf16 and --fp16 are mutually exclusive; use --bf16")
        raise ConfigError("--fp16 is not supported (no loss scaling is wired); use --bf16")
    changes = {
        name: getattr(args, name) for name in FLAG_NAMES if getattr(args, name, None) is not None
    }
    if changes.get("recompute_granularity") == "selective":  # the YAML's full-only settings go
        for name in ("recompute_method", "recompute_num_layers"):
            changes.setdefault(name, None)
    # a contradiction names the flag, unless the value came from the config's training:
    names = {
        k: FLAG_NAMES[k]
        if k in changes or getattr(training, k) in (None, False)
        else f"training.{k}"
        for k in FLAG_NAMES
    }
    training = dataclasses.replace(training, **changes)
    Runtime.of(training).check(model, pp, names)
    return training


def blend_prefixes(value: str) -> list[str]:
    """The dataset prefixes of a Megatron ``--data-path``: one prefix, several (equal weights),
    or ``"w1 p1 w2 p2"`` pairs (Megatron's ``get_blend_from_list`` reading, torch-free)."""
    items = value.split()
    if items and len(items) % 2 == 0 and all(_is_number(w) for w in items[0::2]):
        return items[1::2]
    return items


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_data_path_args(args: argparse.Namespace) -> None:
    """--data-path / --valid-data-path (where the command has it) must be Megatron indexed
    datasets (a prefix or a blend of them), with a tokenizer.json."""
    for flag, value in (
        ("--data-path", args.data_path),
        ("--valid-data-path", getattr(args, "valid_data_path", None)),
    ):
        if not value:
            continue
        prefixes = blend_prefixes(value)
        if not prefixes:
            raise ConfigError(f"{flag} {value!r}: empty (give a dataset prefix or a blend)")
        for prefix in prefixes:
            if not Path(prefix + ".idx").is_file():
                where = f" (in the blend {value!r})" if len(prefixes) > 1 else ""
                raise ConfigError(
                    f"{flag} {prefix}: no {prefix}.idx / .bin (a Megatron indexed dataset "
                    f"prefix){where}"
                )
    if not args.tokenizer or not Path(args.tokenizer).is_file():
        raise ConfigError(
            f"--tokenizer {args.tokenizer}: --data-path needs an existing tokenizer.json"
        )


def start_ranks(
    layout: Layout | None = None,
    seed: int = 1234,
    one_process: str | None = None,
    timeout_minutes: float | None = None,
) -> None:
    """Start this rank the same way in every command: Megatron's CPU adaptations (only where
    CUDA is absent), the default process group (torchrun's, or a 1-rank world), then Megatron's
    model-parallel groups for ``layout`` (seeded with ``seed``) when one is given.

    ``one_process``: the job runs in a single process; a larger world is refused with a
    ConfigError that starts with this text (e.g. "extraction runs as one process").
    ``timeout_minutes``: how long collectives wait (``--distributed-timeout-minutes``)."""
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.compat.host import tune_host

    enable_cpu_megatron()
    import torch.distributed as dist

    from elastic_plugin.parallel import init_distributed, initialize_layout, is_rank0

    try:  # threads per rank and the allocator, before the first large tensor
        host = tune_host()
    except ValueError as exc:  # a bad ELASTIC_PLUGIN_THREADS
        raise ConfigError(str(exc)) from None
    init_distributed(timeout_s=None if timeout_minutes is None else timeout_minutes * 60)
    if is_rank0() and one_process is None:  # a job on ranks says how it uses the host
        print(host.describe(), file=sys.stderr, flush=True)
    if one_process is not None and dist.get_world_size() != 1:
        raise ConfigError(
            f"{one_process}; got a world of {dist.get_world_size()} ranks (run it without torchrun)"
        )
    if layout is not None:
        initialize_layout(layout, seed=seed)
