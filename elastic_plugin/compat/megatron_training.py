"""Run Megatron-LM's training loop (``megatron.training.pretrain``, shipped in the megatron-core
wheel) on CPU with the gloo backend (``--distributed-backend gloo``).

``enable_cpu_megatron()`` (compat/cpu.py) covers Megatron-*Core*: devices, RNG tracker, streams,
collectives; ``report_memory``'s ``torch.cuda.memory_*`` calls already answer 0 without CUDA.
The training package assumes CUDA in a few more places, each patched here once and recorded in
the same registry (``applied_patches()``, listed by ``elastic-plugin info``):

- ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda=True``, which ``pretrain`` never
  passes: default it to True (both names: ``initialize`` and the one ``training`` imported).
- ``compile_helpers`` runs ``make`` in ``megatron/core/datasets``; the wheel ships the helpers
  prebuilt (``helpers_cpp``) but no Makefile, so it fails: skip it when they import.
- ``_initialize_distributed`` makes the model-parallel groups only if
  ``torch.cuda.device_count() > 0``: make them afterwards, with the same arguments.
- ``_set_random_seed`` seeds the model-parallel RNG tracker only if ``device_count() > 0``: seed
  it afterwards (Megatron's tensor-parallel init and dropout fork it).
- ``validate_args`` reads the GPU architecture when TP or CP > 1 (``torch.cuda`` raises without
  a driver): 0; and then asserts ``CUDA_DEVICE_MAX_CONNECTIONS=1``: set by default.
- ``_warmup_jit_function`` compiles GPU fusion kernels with ``torch.compile``: skipped.

Nothing is patched when CUDA is available."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from elastic_plugin.compat.cpu import _APPLIED, _patch, applied_patches, enable_cpu_megatron


def _allow_no_cuda(orig: Callable) -> Callable:
    """``initialize_megatron`` asserts CUDA unless ``allow_no_cuda=True`` (``pretrain`` never
    passes it); default it to True."""

    @functools.wraps(orig)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        if not args:
            kwargs.setdefault("allow_no_cuda", True)
        return orig(*args, **kwargs)

    return initialize_megatron


def _compile_helpers(orig: Callable) -> Callable:
    """The wheel ships the dataset helpers prebuilt (``helpers_cpp``) but no Makefile, so
    ``compile_helpers`` (``make -C megatron/core/datasets``) fails; skip it when they import."""

    @functools.wraps(orig)
    def compile_helpers() -> None:
        try:
            import megatron.core.datasets.helpers_cpp  # noqa: F401
        except ImportError:
            orig()

    return compile_helpers


def _initialize_model_parallel_too(orig: Callable) -> Callable:
    """``_initialize_distributed`` creates Megatron's model-parallel groups only when
    ``torch.cuda.device_count() > 0``; create them from Megatron's args afterwards."""

    @functools.wraps(orig)
    def _initialize_distributed(
        get_embedding_ranks: Any,
        get_position_embedding_ranks: Any,
        store: Any,
        skip_model_parallel_init: bool = False,
    ) -> None:
        from megatron.core import parallel_state as ps
        from megatron.training import get_args, print_rank_0

        orig(
            get_embedding_ranks,
            get_position_embedding_ranks,
            store,
            skip_model_parallel_init=skip_model_parallel_init,
        )
        if skip_model_parallel_init or ps.model_parallel_is_initialized():
            return
        args = get_args()
        ps.initialize_model_parallel(  # the call _initialize_distributed makes with CUDA
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size,
            pipeline_model_parallel_comm_backend=args.pipeline_model_parallel_comm_backend,
            use_sharp=args.use_sharp,
            gtp_remat_size=args.gtp_weight_remat_size,
            expert_gtp_remat_size=args.expert_gtp_weight_remat_size,
            context_parallel_size=args.context_parallel_size,
            hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
            hybrid_context_parallel=args.hybrid_context_parallel,
            expert_model_parallel_size=args.expert_model_parallel_size,
            num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
            nccl_communicator_config_path=args.nccl_communicator_config_path,
            order="tp-cp-ep-dp-pp" if not args.use_tp_pp_dp_mapping else "tp-cp-ep-pp-dp",
            get_embedding_ranks=get_embedding_ranks,
            get_position_embedding_ranks=get_position_embedding_ranks,
            create_gloo_process_groups=args.use_gloo_process_groups,
            high_priority_stream_groups=args.high_priority_stream_groups,
            sharp_enabled_group=args.sharp_enabled_group,
        )
        print_rank_0(
            f"> initialized model parallel on CPU: tp={ps.get_tensor_model_parallel_world_size()} "
            f"pp={ps.get_pipeline_model_parallel_world_size()} "
            f"ep={ps.get_expert_model_parallel_world_size()} "
            f"dp={ps.get_data_parallel_world_size()}"
        )

    return _initialize_distributed


def _seed_model_parallel_rng_too(orig: Callable) -> Callable:
    """``_set_random_seed`` seeds the model-parallel RNG tracker only when
    ``torch.cuda.device_count() > 0``; seed it afterwards (the tracker forks the CPU generator
    under ``enable_cpu_megatron``), with the seed ``_set_random_seed`` derived."""

    @functools.wraps(orig)
    def _set_random_seed(
        seed_: int,
        data_parallel_random_init: bool = False,
        te_rng_tracker: bool = False,
        inference_rng_tracker: bool = False,
        use_cudagraphable_rng: bool = False,
        pp_group: Any = None,
        dp_group: Any = None,
        tp_group: Any = None,
        ep_group: Any = None,
        etp_group: Any = None,
    ) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.utils import get_pg_rank

        orig(
            seed_,
            data_parallel_random_init,
            te_rng_tracker,
            inference_rng_tracker,
            use_cudagraphable_rng,
            pp_group=pp_group,
            dp_group=dp_group,
            tp_group=tp_group,
            ep_group=ep_group,
            etp_group=etp_group,
        )
        if torch.cuda.device_count() > 0:  # Megatron seeded it
            return

        def rank(group: Any, default: Callable[[], int] | None = None) -> int | None:
            if group is not None:
                return int(get_pg_rank(group))
            return default() if default is not None else None

        seed = seed_ + 100 * int(rank(pp_group, ps.get_pipeline_model_parallel_rank) or 0)
        if data_parallel_random_init:
            seed += 10 * int(rank(dp_group, ps.get_data_parallel_rank) or 0)
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed,
            te_rng_tracker,
            inference_rng_tracker,
            use_cudagraphable_rng,
            tp_rank=rank(tp_group),
            ep_rank=rank(ep_group),
            etp_rank=rank(etp_group),
        )

    return _set_random_seed


def _no_device_arch(orig: Callable) -> Callable:
    """``validate_args`` asks ``get_device_arch_version()`` (``torch.cuda.get_device_properties``,
    which raises without a driver) whenever TP or CP > 1: no GPU architecture, 0."""

    @functools.wraps(orig)
    def get_device_arch_version() -> int:
        return 0

    return get_device_arch_version


def _skip_jit_warmup(orig: Callable) -> Callable:
    """``set_jit_fusion_options`` warms up the fused bias-GeLU/SwiGLU/dropout-add kernels, which
    Megatron wraps in ``torch.compile``: on CPU that is ~7 s of Inductor compiles per process
    (measured on 2 cores) for kernels the plugin's models never call (its configs turn those
    fusions off); a model that does use them compiles them on first use instead."""

    @functools.wraps(orig)
    def _warmup_jit_function(tp_size: int | None = None) -> None:
        return None

    return _warmup_jit_function


# (module, attribute, wrapper factory: original -> replacement, label for applied_patches())
_INITIALIZE = "megatron.training.initialize"
_PATCHES: tuple[tuple[str, str, Callable[[Callable], Callable], str], ...] = (
    (_INITIALIZE, "initialize_megatron", _allow_no_cuda, "initialize_megatron(allow_no_cuda)"),
    (
        "megatron.training.training",
        "initialize_megatron",
        _allow_no_cuda,
        "training.initialize_megatron(allow_no_cuda)",
    ),
    (
        "megatron.core.datasets.utils",
        "compile_helpers",
        _compile_helpers,
        "datasets.compile_helpers(prebuilt helpers_cpp)",
    ),
    (
        _INITIALIZE,
        "_initialize_distributed",
        _initialize_model_parallel_too,
        "_initialize_distributed(+initialize_model_parallel)",
    ),
    (
        _INITIALIZE,
        "_set_random_seed",
        _seed_model_parallel_rng_too,
        "_set_random_seed(+model_parallel_cuda_manual_seed)",
    ),
    (
        "megatron.training.arguments",
        "get_device_arch_version",
        _no_device_arch,
        "arguments.get_device_arch_version(0)",
    ),
    (_INITIALIZE, "_warmup_jit_function", _skip_jit_warmup, "_warmup_jit_function(skipped)"),
)
# With TP or CP > 1 and an architecture before Blackwell, validate_args asserts
# CUDA_DEVICE_MAX_CONNECTIONS=1 (CUDA kernel ordering for communication overlap; meaningless on
# CPU): set it unless the user did.
_ENV = ("CUDA_DEVICE_MAX_CONNECTIONS", "1")
_ENV_LABEL = f"megatron.training:env {_ENV[0]}={_ENV[1]}"
LABELS: tuple[str, ...] = (
    *(f"megatron.training:{label}" for *_, label in _PATCHES),
    _ENV_LABEL,
)


def training_patches() -> list[str]:
    """The applied patches that are this module's (``applied_patches()`` lists all)."""
    return [name for name in applied_patches() if name in LABELS]


def enable_cpu_megatron_training(force: bool = False) -> list[str]:
    """Make ``megatron.training.pretrain`` run on CPU + gloo: ``enable_cpu_megatron()`` (called
    first) and the patches above. A no-op when CUDA is available (unless ``force``); idempotent.
    Returns every applied patch (cpu.py's and these). Megatron needs
    ``--distributed-backend gloo`` as well."""
    if torch.cuda.is_available() and not force:
        return []
    enable_cpu_megatron(force=force)
    if LABELS[0] in _APPLIED:
        return applied_patches()
    import importlib

    wrapped: dict[int, Callable] = {}  # one wrapper per original (initialize_megatron: 2 names)
    for module_name, attr, factory, label in _PATCHES:
        module = importlib.import_module(module_name)
        orig = getattr(module, attr)
        if id(orig) not in wrapped:
            wrapped[id(orig)] = factory(orig)
        _patch(module, attr, wrapped[id(orig)], f"megatron.training:{label}")
    os.environ.setdefault(*_ENV)
    _APPLIED.append(_ENV_LABEL)
    return applied_patches()
