"""Which layer spec each model gets (models/spec_choice.py), and a run with Transformer Engine
importable but no GPU, as on a CPU node where TE is installed.

TE imports on such a node, but its modules refuse to be built ("TransformerEngine needs CUDA"):
choosing its spec because it imports broke every model. ``te_importable`` installs a stand-in
``transformer_engine`` package that behaves so; every model of the pipeline (the trained
model, the reordered checkpoint's, the elastic student, the frozen teacher) must then be built
with the local spec and train a step. A TE that can run is simulated by its backend entry's
``missing`` (no GPU here); that is where the choice between the specs is made.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
from pathlib import Path

import pytest
import torch

from elastic_plugin.models import spec_choice
from elastic_plugin.models.config import ConfigError
from elastic_plugin.models.spec_choice import (
    LAYER_SPEC_ENV,
    SPEC_BACKENDS,
    check_layer_spec_request,
    choose_layer_spec,
)

CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml")
NEEDS_CUDA = "TransformerEngine needs CUDA"


@pytest.fixture
def te_importable(monkeypatch):
    """``transformer_engine`` and ``transformer_engine.pytorch`` import; building any of its
    modules raises, as TE 2.20 does on a machine without a GPU."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: this is the CPU node's case")
    # Megatron decides at import whether TE is there and then imports much of it; the stand-in
    # has no such depth, so Megatron (and our modules that import it) are imported first and
    # keep their TE-less paths. What this simulates is what our choice reads at build time.
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.hybrid.hybrid_layer_specs  # noqa: F401
    import megatron.core.models.hybrid.hybrid_model  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401

    import elastic_plugin.elastic.train  # noqa: F401
    import elastic_plugin.models.specs  # noqa: F401
    import elastic_plugin.training.step  # noqa: F401

    class NeedsCuda(torch.nn.Module):
        def __init__(self, *args, **kwargs) -> None:
            raise RuntimeError(NEEDS_CUDA)

    def module_attr(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return NeedsCuda

    te = types.ModuleType("transformer_engine")
    te.__version__ = "2.20.2"  # type: ignore[attr-defined]
    te.__path__ = []  # type: ignore[attr-defined]
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.__getattr__ = module_attr  # type: ignore[method-assign]
    te.pytorch = pytorch  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", pytorch)
    monkeypatch.delenv(LAYER_SPEC_ENV, raising=False)
    return te


@pytest.fixture
def te_runs(monkeypatch):
    """TE's layers can run here (a GPU node with TE), for the choice alone."""
    monkeypatch.setitem(
        SPEC_BACKENDS, "te", dataclasses.replace(SPEC_BACKENDS["te"], missing=lambda: None)
    )
    monkeypatch.delenv(LAYER_SPEC_ENV, raising=False)


def _backends(requested: str | None = None) -> dict[str, str]:
    return {role: choose_layer_spec(role, requested).backend for role in spec_choice.MODEL_ROLES}


def test_te_importable_without_a_gpu_gives_every_model_the_local_spec(te_importable) -> None:
    from elastic_plugin.models.specs import have_transformer_engine

    assert have_transformer_engine()
    assert "no CUDA device is visible" in spec_choice.transformer_engine_missing()
    assert set(_backends().values()) == {"local"}
    assert "no CUDA device" in choose_layer_spec("teacher").reason
    with pytest.raises(
        ConfigError, match="asks for te, but Transformer Engine imports, but no CUDA"
    ):
        choose_layer_spec("teacher", "te")
    with pytest.raises(
        ConfigError, match="--layer-spec=te: Transformer Engine imports.*auto, local"
    ):
        check_layer_spec_request("te", ["student", "teacher"], "--layer-spec")


def test_where_te_runs_only_models_that_are_not_sliced_take_it(te_runs) -> None:
    assert _backends() == {"sliced": "local", "student": "local", "teacher": "te", "trained": "te"}
    student = choose_layer_spec("student")
    assert "sliced" in student.reason and "not elastic yet" in student.reason
    assert student.describe().startswith("layer spec of the elastic student: local (")
    assert (
        choose_layer_spec("teacher").reason
        == "Transformer Engine imports and a CUDA device is visible"
    )
    assert set(_backends("local").values()) == {"local"}  # forced
    forced = _backends("te")
    assert forced["teacher"] == forced["trained"] == "te" and forced["student"] == "local"
    assert choose_layer_spec("student", "te").reason.startswith("te asked for, but its layers")
    # a command whose every model is sliced cannot honour te: refused before any rank starts
    with pytest.raises(
        ConfigError, match="--layer-spec=te: this command's models.*the elastic student"
    ):
        check_layer_spec_request("te", ["student"], "--layer-spec")
    check_layer_spec_request("te", ["student", "teacher"], "--layer-spec")


def test_elastic_te_linears_are_one_backend_entry(te_runs, monkeypatch) -> None:
    """Once TE's linears have an elastic forward, the entry's ``not_elastic`` goes: the student
    (and every sliced model) then takes TE's spec where it runs, with no other change."""
    monkeypatch.setitem(
        SPEC_BACKENDS, "te", dataclasses.replace(SPEC_BACKENDS["te"], not_elastic=None)
    )
    assert set(_backends().values()) == {"te"}
    check_layer_spec_request("te", ["student"], "--layer-spec")


def test_bad_requests_name_the_flag_or_variable_and_the_allowed_values(monkeypatch) -> None:
    from elastic_plugin.cli_args import layer_spec_from_args

    monkeypatch.setenv(LAYER_SPEC_ENV, "fast")
    with pytest.raises(
        ConfigError, match=f"{LAYER_SPEC_ENV}='fast': allowed values are auto, local, te"
    ):
        choose_layer_spec("teacher")
    with pytest.raises(ConfigError, match=f"{LAYER_SPEC_ENV}='fast'"):
        layer_spec_from_args(argparse.Namespace(layer_spec=None), ["trained"])
    with pytest.raises(ConfigError, match="--layer-spec='tex': allowed values are auto, local, te"):
        layer_spec_from_args(argparse.Namespace(layer_spec="tex"), ["trained"])
    # a flag given reaches every build of this process (the frozen teacher's too) through the env
    assert layer_spec_from_args(argparse.Namespace(layer_spec="local"), ["trained"]) == "local"
    import os

    assert os.environ[LAYER_SPEC_ENV] == "local"
    with pytest.raises(ValueError, match="model role 'critic'"):
        choose_layer_spec("critic")


# --------------------------------------------------------------------------- a run with TE there
@pytest.fixture
def megatron():
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.parallel import init_distributed

    enable_cpu_megatron()
    init_distributed()


def _te_classes(model: torch.nn.Module) -> list[str]:
    return sorted(
        {
            f"{type(m).__module__}.{type(m).__name__}"
            for m in model.modules()
            if "transformer_engine" in type(m).__module__
        }
    )


def test_every_model_builds_with_the_local_spec_and_trains_a_step(
    te_importable, megatron, monkeypatch, tmp_path
) -> None:
    from elastic_plugin import parallel
    from elastic_plugin.models import builder
    from elastic_plugin.models.specs import LocalHybridStack
    from elastic_plugin.training.step import train_step
    from tests.support import elastic_cases as ec

    built: list[tuple[str, torch.nn.Module]] = []
    real_layer_spec_of, real_build = parallel.layer_spec_of, builder.build_hybrid_model

    def record_role(role="sliced", use_te=None):
        choice = real_layer_spec_of(role, use_te)
        built.append((role, choice))
        return choice

    def record_model(*args, **kwargs):
        model = real_build(*args, **kwargs)
        built.append(("model", model))
        return model

    monkeypatch.setattr(parallel, "layer_spec_of", record_role)
    monkeypatch.setattr(builder, "build_hybrid_model", record_model)
    cfg = ec._experiment(CONFIG, None)

    # train's model: one LM training step (forward, backward, optimizer)
    parallel.initialize_layout(parallel.Layout(), seed=3)
    chunks, _ = parallel.build_model_chunks(cfg.model, parallel.Layout(), role="trained")
    optimizer = parallel.build_optimizer(chunks, lr=1e-3)
    batches = ec._synthetic_iterator(cfg.model.vocab_size, 4, 0)
    result = train_step(chunks, optimizer, batches, 1, ec.SEQ_LEN, 4)
    assert torch.isfinite(torch.tensor(result["loss"])) and result["update_successful"]

    # the reordered checkpoint, the elastic student and its frozen teacher: two elastic steps
    ckpt = ec.train_tiny_elastic(cfg, tmp_path, iters=2)
    assert (ckpt / "elastic_meta.json").is_file()

    roles = [role for role, _ in built if role != "model"]
    assert {"trained", "sliced", "student", "teacher"} <= set(roles)
    for role, item in built:
        if role == "model":
            assert isinstance(item.decoder, LocalHybridStack) and item.layer_spec.backend == "local"
            assert _te_classes(item) == []
        else:
            assert item.backend == "local", (role, item)
            assert "no CUDA device is visible" in item.reason or "sliced" in item.reason


def test_megatron_kernels_that_would_call_te_fall_back_to_torch_without_a_gpu(monkeypatch):
    """With TE installed, Megatron binds TE's CUDA kernels at import (the MoE router's GEMM, the
    optimizer's FusedAdam and multi-tensor helpers) whatever the layer spec: on a CPU node the
    compat layer points each back at the implementation Megatron uses without TE. (Measured with
    a real TE 2.20.2 build importable and no GPU: the unit tier went from 54 failed / 20 errors,
    all 'Found no NVIDIA driver' in the router's te_general_gemm, to 959 passed.)"""
    from megatron.core import optimizer as mopt
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as mopt_base
    from megatron.core.transformer.moe import moe_utils

    from elastic_plugin.compat import cpu

    def te_kernel(name: str):
        def kernel(*args, **kwargs):
            raise RuntimeError("Found no NVIDIA driver on your system")

        kernel.__module__ = f"transformer_engine.pytorch.{name}"
        return kernel

    monkeypatch.setattr(cpu, "_APPLIED", [])
    for name in ("te_general_gemm", "fused_permute", "fused_topk_with_score_function"):
        monkeypatch.setattr(moe_utils, name, te_kernel("cpp_extensions"))
    monkeypatch.setattr(mopt, "Adam", te_kernel("optimizers"))
    monkeypatch.setattr(mopt, "SGD", te_kernel("optimizers"))
    monkeypatch.setattr(mopt, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(distrib_optimizer, "Adam", te_kernel("optimizers"))
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", True)
    for module in (mopt_base, clip_grads):
        monkeypatch.setattr(module, "multi_tensor_applier", te_kernel("optimizers"))
        monkeypatch.setattr(module, "multi_tensor_scale_impl", te_kernel("optimizers"))
    monkeypatch.setattr(clip_grads, "l2_norm_impl", te_kernel("optimizers"))
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_tensor_impl", te_kernel("optimizers"))

    cpu._patch_te_kernels()
    assert moe_utils.te_general_gemm is None and moe_utils.fused_permute is None
    assert moe_utils.fused_topk_with_score_function is None
    assert mopt.Adam is torch.optim.AdamW and mopt.SGD is torch.optim.SGD
    assert mopt.USING_PYTORCH_OPTIMIZER
    assert distrib_optimizer.Adam is torch.optim.Adam and not distrib_optimizer.HAVE_APEX_OR_TE
    assert not distrib_optimizer.USING_TE_OPTIMIZER
    for module in (mopt_base, clip_grads):
        assert module.multi_tensor_applier is mutils.local_multi_tensor_applier
        assert module.multi_tensor_scale_impl is mutils.local_multi_tensor_scale
    assert clip_grads.l2_norm_impl is mutils.local_multi_tensor_l2_norm
    assert clip_grads.multi_tensor_scale_tensor_impl is None
    assert any("TE without a GPU" in name for name in cpu.applied_patches())
    # where TE was never imported nothing is patched
    monkeypatch.setattr(cpu, "_APPLIED", [])
    cpu._patch_te_kernels()
    assert cpu.applied_patches() == []
