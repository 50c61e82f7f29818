"""``compat.host`` and the automatic precision: what the CPU's flags say about BF16 (simulated
CPUs with and without BF16 units), threads per rank, the allocator that keeps freed memory, and
``training.bf16`` left to the machine (resolved, logged, resumed in the save's precision)."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch

from elastic_plugin.compat import host
from elastic_plugin.compat.host import CpuInfo, fast_bf16, keep_freed_memory, rank_threads
from elastic_plugin.models.config import TrainingConfig
from elastic_plugin.models.runtime import Runtime, precision_note, with_saved_precision

AMX = CpuInfo("Intel(R) Xeon(R) Platinum", 2, ("avx2", "avx512f", "amx_tile", "amx_bf16"))
AVX512_BF16 = CpuInfo("AMD EPYC 9654", 2, ("avx2", "avx512f", "avx512_bf16"))
AVX2 = CpuInfo("AMD EPYC 7B13", 2, ("avx2", "fma"))


def test_bf16_detected_from_the_cpu_flags(monkeypatch):
    monkeypatch.delenv("ELASTIC_PLUGIN_CPU_BF16", raising=False)
    assert fast_bf16(AMX) == (True, "the CPU has amx_bf16")
    assert fast_bf16(AVX512_BF16) == (True, "the CPU has avx512_bf16")
    assert fast_bf16(AVX2) == (False, "the CPU has no amx_bf16 or avx512_bf16")
    monkeypatch.setenv("ELASTIC_PLUGIN_CPU_BF16", "1")
    assert fast_bf16(AVX2) == (True, "ELASTIC_PLUGIN_CPU_BF16=1")


@pytest.mark.parametrize(
    "cpu,expected", [(AMX, "bfloat16"), (AVX512_BF16, "bfloat16"), (AVX2, "float32")]
)
def test_automatic_precision_follows_the_machine_and_says_why(monkeypatch, cpu, expected):
    """training.bf16 unset (or ``auto``): BF16 where the CPU has BF16 units, FP32 without
    (the fallback, simulated); an explicit value is kept whatever the machine."""
    monkeypatch.delenv("ELASTIC_PLUGIN_CPU_BF16", raising=False)
    monkeypatch.setattr(host, "cpu_info", lambda: cpu)
    for auto in (TrainingConfig(), TrainingConfig(bf16="auto")):  # type: ignore[arg-type]
        assert Runtime.of(auto).dtype_name == expected
    note = precision_note(TrainingConfig())
    assert note.startswith("precision: " + ("BF16" if expected == "bfloat16" else "FP32"))
    assert "auto: the CPU has" in note
    assert Runtime.of(TrainingConfig(bf16=False)).dtype_name == "float32"
    assert Runtime.of(TrainingConfig(bf16=True)).dtype_name == "bfloat16"
    assert "--bf16 / training.bf16" in precision_note(TrainingConfig(bf16=True))


def test_resume_keeps_the_saved_precision_when_left_to_the_machine(monkeypatch):
    monkeypatch.setattr(host, "cpu_info", lambda: AVX2)
    monkeypatch.delenv("ELASTIC_PLUGIN_CPU_BF16", raising=False)
    saved_bf16 = {"params_dtype": "bfloat16"}
    resumed = with_saved_precision(TrainingConfig(), saved_bf16)
    assert resumed.bf16 is True and Runtime.of(resumed).dtype_name == "bfloat16"
    Runtime.of(resumed).check_resumable(saved_bf16, "resume")  # no mismatch
    explicit = with_saved_precision(TrainingConfig(bf16=False), saved_bf16)
    with pytest.raises(ValueError, match="resume with --bf16"):
        Runtime.of(explicit).check_resumable(saved_bf16, "resume")


def test_bad_precision_value_names_the_key():
    from elastic_plugin.models.config import ConfigError, load_config

    cfg = load_config("examples/configs/tiny.yaml")
    with pytest.raises(ConfigError, match="training.bf16='yes'; allowed: true, false, auto"):
        Runtime.of(TrainingConfig(bf16="yes")).check(cfg.model)  # type: ignore[arg-type]


def test_threads_per_rank(monkeypatch):
    for name in ("ELASTIC_PLUGIN_THREADS", "OMP_NUM_THREADS", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    eight = CpuInfo("x", 8, ())
    assert rank_threads(1, eight) == (8, "8 cores / 1 rank")
    assert rank_threads(3, eight) == (2, "8 cores / 3 ranks")
    assert rank_threads(16, eight)[0] == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert rank_threads(2, eight) == (3, "OMP_NUM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's default for several ranks: not asked
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert rank_threads(2, eight) == (4, "8 cores / 2 ranks")
    monkeypatch.setenv("ELASTIC_PLUGIN_THREADS", "5")
    assert rank_threads(2, eight) == (5, "ELASTIC_PLUGIN_THREADS")
    monkeypatch.setenv("ELASTIC_PLUGIN_THREADS", "zero")
    with pytest.raises(ValueError, match="ELASTIC_PLUGIN_THREADS='zero'; allowed: a positive"):
        rank_threads(2, eight)


def test_the_host_line_names_threads_precision_and_allocator():
    line = host.tune_host().describe()
    assert line.startswith("host: ") and "threads per rank" in line and "BF16 matmuls" in line
    assert "allocator" in line
    assert torch.get_num_threads() == host.tune_host().threads


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost",
    )]  # fmt: skip


@pytest.mark.skipif(not keep_freed_memory(), reason="needs glibc's mallopt")
def test_freed_large_blocks_stay_in_the_heap():
    """What the setting changes: a 64 MB block (above glibc's largest mmap threshold) comes from
    the heap and stays there, free for the next one, when it is released. glibc's default maps
    it separately (``hblkhd``) and unmaps it on free, so every such tensor is faulted in afresh
    (``fordblks`` would not grow by the block)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = _MallInfo2
    before = libc.mallinfo2()
    block = torch.ones(16 * 2**20)
    held = libc.mallinfo2()
    del block
    freed = libc.mallinfo2()
    assert held.hblkhd - before.hblkhd < 2**20  # not a separate mapping
    assert freed.fordblks - held.fordblks >= 60 * 2**20  # kept, free for reuse


def test_megatrons_cpu_adam_runs_torchs_fused_kernel():
    """``parallel.build_optimizer`` switches the torch AdamW inside Megatron's optimizer to the
    fused CPU kernel (not with the distributed optimizer, whose shards start anywhere): the
    update equals the unfused AdamW's to rounding."""
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.models.config import load_config
    from elastic_plugin.parallel import (
        Layout,
        build_model_chunks,
        build_optimizer,
        init_distributed,
        initialize_layout,
    )

    enable_cpu_megatron()
    init_distributed()
    initialize_layout(Layout(), seed=3)
    model_cfg = load_config("examples/configs/tiny.yaml").model
    chunks, _ = build_model_chunks(model_cfg, Layout())
    params = list(chunks[0].parameters())
    initial = [p.detach().clone() for p in params]
    results = []
    for fused in (True, False):
        with torch.no_grad():
            for p, value in zip(params, initial):
                p.copy_(value)
        optimizer = build_optimizer(chunks, lr=1e-2)
        inner = optimizer.chained_optimizers[0].optimizer
        assert all(g["fused"] for g in inner.param_groups)
        if not fused:  # the op-by-op AdamW Megatron would run
            for group in inner.param_groups:
                group["fused"], group["foreach"] = None, False
        for step in range(3):
            for param in params:  # Megatron reads the DDP gradient buffer
                param.main_grad = torch.full_like(param, 0.01 * (step + 1))
                param.grad = param.main_grad
            optimizer.step()
        results.append([p.detach().clone() for p in params])
    moved = sum(float((a - b).abs().sum()) for a, b in zip(results[0], initial))
    assert moved > 0
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
