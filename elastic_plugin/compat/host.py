"""The CPU this process trains on: what its matmul units support, and how to use all of it.

Three settings decide how much of a CPU a training step gets, and none of them is the model's:

* **Threads.** torch uses the cores it sees, unless ``OMP_NUM_THREADS`` says otherwise, and
  torchrun sets ``OMP_NUM_THREADS=1`` for every rank it starts (whatever the cores). A rank gets
  ``cores // local ranks`` threads unless the user asked for a number (``ELASTIC_PLUGIN_THREADS``,
  or an ``OMP_NUM_THREADS`` that is not torchrun's default).
* **The allocator.** glibc serves every allocation above 32 MB (logits, their gradients, the
  KD loss's chunks) with a fresh ``mmap`` and returns it on free, so each one is page-faulted in
  again, a page at a time: measured on a 2-core EPYC, an element-wise op on a ``[2048, 49152]``
  FP32 tensor took 150 ms with fresh pages and 30 ms when the pages were reused. Keeping freed
  memory in the heap (``mallopt``: no mmap, no trim) is what jemalloc or tcmalloc would give,
  without another library; the process keeps its peak memory, as the CUDA caching allocator
  does. ``ELASTIC_PLUGIN_MALLOC=system`` leaves glibc as it is.
* **The precision of matmuls.** BF16 GEMMs are fast only where the CPU has BF16 units (AMX or
  AVX-512-BF16: 5-7x FP32 on a Sapphire Rapids core); without them torch emulates BF16 and a
  2048-wide GEMM runs at ~1% of FP32's speed (measured on an AVX2 EPYC). ``fast_bf16()`` says
  which, from the CPU's flags; ``ELASTIC_PLUGIN_CPU_BF16=0|1`` overrides the detection (tests
  pin it, so the suite computes the same numbers on every machine).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = [
    "BF16_FLAGS",
    "CpuInfo",
    "HostSettings",
    "cpu_info",
    "fast_bf16",
    "gemm_peak_gflops",
    "keep_freed_memory",
    "machine_use",
    "rank_threads",
    "throughput_totals",
    "tune_host",
]

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # either gives BF16 GEMMs in hardware (oneDNN)
_REPORTED_FLAGS = ("amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512f", "avx2", "fma")
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameter numbers (malloc.h)
_INT_MAX = 2**31 - 1


@dataclass(frozen=True)
class CpuInfo:
    """The CPU's name, its usable cores and the flags that decide matmul speed."""

    model: str
    cores: int
    flags: tuple[str, ...]

    def describe(self) -> str:
        shown = [f for f in _REPORTED_FLAGS if f in self.flags]
        return f"{self.model}, {self.cores} cores, {' '.join(shown) or 'no SIMD flags read'}"


def _cpuinfo_text() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """This machine's CPU (Linux ``/proc/cpuinfo``; elsewhere the platform's name, no flags)."""
    model: str = platform.processor() or platform.machine()
    flags: tuple[str, ...] = ()
    for line in _cpuinfo_text().splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key == "flags" and not flags:
            flags = tuple(value.split())
    return CpuInfo(model, _usable_cores(), flags)


def fast_bf16(info: CpuInfo | None = None) -> tuple[bool, str]:
    """(whether BF16 matmuls run in hardware here, why), for the log."""
    forced = os.environ.get("ELASTIC_PLUGIN_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1", f"ELASTIC_PLUGIN_CPU_BF16={forced}"
    info = info or cpu_info()
    found = [f for f in BF16_FLAGS if f in info.flags]
    if found:
        return True, f"the CPU has {' and '.join(found)}"
    return False, f"the CPU has no {' or '.join(BF16_FLAGS)}"


def rank_threads(local_ranks: int, info: CpuInfo | None = None) -> tuple[int, str]:
    """(intra-op threads for one of ``local_ranks`` ranks on this host, why)."""
    asked = os.environ.get("ELASTIC_PLUGIN_THREADS")
    if asked:
        if not asked.isdigit() or int(asked) < 1:
            raise ValueError(f"ELASTIC_PLUGIN_THREADS={asked!r}; allowed: a positive integer")
        return int(asked), "ELASTIC_PLUGIN_THREADS"
    omp = os.environ.get("OMP_NUM_THREADS")
    torchrun_default = omp == "1" and local_ranks > 1 and "TORCHELASTIC_RUN_ID" in os.environ
    if omp and omp.isdigit() and int(omp) > 0 and not torchrun_default:
        return int(omp), "OMP_NUM_THREADS"
    cores = (info or cpu_info()).cores
    share = max(1, cores // max(1, local_ranks))
    return share, f"{cores} cores / {local_ranks} rank{'s' if local_ranks > 1 else ''}"


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse (no mmap per large block, no trimming); True if
    done. A no-op (False) off glibc or with ``ELASTIC_PLUGIN_MALLOC=system``."""
    if os.environ.get("ELASTIC_PLUGIN_MALLOC", "").lower() == "system":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _INT_MAX))


@dataclass(frozen=True)
class HostSettings:
    """What ``tune_host`` set, for the log line and ``stages.json``."""

    cpu: CpuInfo
    threads: int
    threads_why: str
    bf16: bool
    bf16_why: str
    kept_memory: bool

    def describe(self) -> str:
        return (
            f"host: {self.cpu.describe()}; {self.threads} threads per rank "
            f"({self.threads_why}); BF16 matmuls {'in hardware' if self.bf16 else 'emulated'} "
            f"({self.bf16_why}); allocator "
            f"{'keeps freed memory' if self.kept_memory else 'as the system set it'}"
        )


_SETTINGS: HostSettings | None = None


def tune_host(local_ranks: int | None = None) -> HostSettings:
    """Set this process's threads and allocator once (later calls return the first result)."""
    global _SETTINGS
    if _SETTINGS is not None:
        return _SETTINGS
    import torch

    ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    info = cpu_info()
    threads, why = rank_threads(ranks, info)
    if not torch.cuda.is_available():
        torch.set_num_threads(threads)
    bf16, bf16_why = fast_bf16(info)
    _SETTINGS = HostSettings(info, threads, why, bf16, bf16_why, keep_freed_memory())
    return _SETTINGS


# ------------------------------------------------------------------ how much of the machine
def gemm_peak_gflops(dtype_name: str = "float32", n: int = 1024, seconds: float = 1.0):
    """The machine's matmul peak for ``dtype_name`` (float32, bfloat16, int8): GFLOP/s (GOP/s)
    of an ``n x n x n`` product with this process's threads, the best of three windows; None
    where torch has no CPU kernel for it. What a stage's model FLOP/s is set against
    (``bench/bench_train.py`` measures it at n = 2048)."""
    import time

    import torch

    gen = torch.Generator().manual_seed(0)
    mm: Any
    if dtype_name == "int8":
        mm = getattr(torch, "_int_mm", None)
        if mm is None:
            return None
        a = torch.randint(-8, 8, (n, n), dtype=torch.int8, generator=gen)
        b = torch.randint(-8, 8, (n, n), dtype=torch.int8, generator=gen)
    else:
        mm = torch.mm
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
        a = torch.randn(n, n, generator=gen).to(dtype)
        b = torch.randn(n, n, generator=gen).to(dtype)
    try:
        mm(a, b)  # first call: allocation and kernel choice
    except (RuntimeError, TypeError):
        return None
    best = 0.0
    for _ in range(3):
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / 3 or count == 0:
            mm(a, b)
            count += 1
        best = max(best, 2 * n**3 * count / elapsed / 1e9)
    return best


def throughput_totals(records) -> dict[str, float] | None:
    """Summed over a run's metrics records (the ``throughput`` field the training loop logs per
    interval): ``tokens`` (all ranks), ``model_flops`` (all ranks), ``model_flops_per_rank`` and
    ``seconds`` (the steps' own time: no start-up, evaluation or save); None if no record has
    one."""
    out = dict.fromkeys(("tokens", "model_flops", "model_flops_per_rank", "seconds"), 0.0)
    for record in records:
        rate = record.get("throughput") if isinstance(record, dict) else None
        if not rate:
            continue
        seconds = float(rate.get("seconds") or 0.0)
        out["tokens"] += float(rate.get("tokens_per_s") or 0.0) * seconds
        out["model_flops"] += float(rate.get("model_tflops") or 0.0) * 1e12
        out["model_flops_per_rank"] += float(rate.get("tflops_per_rank") or 0.0) * seconds * 1e12
        out["seconds"] += seconds
    return out if out["seconds"] > 0 else None


def machine_use(tokens: float, model_flops: float, seconds: float, peak_gflops: float | None):
    """A stage's tokens/s, model GFLOP/s per rank and its share of one rank's peak (None
    without a peak); ``model_flops`` per rank."""
    gflops = model_flops / seconds / 1e9 if seconds > 0 else 0.0
    return {
        "tokens_per_s": round(tokens / seconds, 2) if seconds > 0 else None,
        "model_gflops": round(gflops, 2),
        "share_of_peak": round(gflops / peak_gflops, 4) if peak_gflops else None,
    }
