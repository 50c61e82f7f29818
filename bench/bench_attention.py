"""SDPA core attention vs Megatron's unfused ``DotProductAttention``: forward+backward time and
peak memory, side by side.

``SDPAAttention`` (``elastic_plugin/models/attention.py``, the local spec's default) calls
``scaled_dot_product_attention`` (flash / memory-efficient kernels; the flash kernel on a CPU);
``DotProductAttention`` builds the ``[b, heads, s, s]`` scores, their softmax and its gradient.
For a GQA shape (b=1, 8 query heads, 2 groups, head dim 64) at 2K and 8K tokens, causal: the two
run interleaved (``interleaved_medians``) for the time ratio; then one more step of each gives
the peak memory above what was allocated before the step (the inputs) and the max abs difference
of their outputs and q/k/v gradients. Peak memory: ``torch.cuda.max_memory_allocated`` on a GPU;
on a CPU the profiler's allocation events (``profile_memory=True``, every allocation and free of
the CPU allocator, in time order: independent of malloc's caching), replayed to their running
maximum (``tests.support.memory.peak_bytes``). Megatron's persistent score buffer
(``get_global_memory_buffer``) is emptied before the measured step, so that step allocates it
like the first step of training does.

Columns: medians (``*_ms``), ``sdpa/unfused`` (time, lower is better), peak ``*_MB`` and
``mem sdpa/unfused``; ``max_diff`` (text, FP32 on a CPU, bf16 on a GPU).

Run: ``python bench/bench_attention.py [--quick] [--reps N] [--json PATH]`` or
``python bench/run_all.py --only attention``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

import torch  # noqa: E402
from _timing import interleaved_medians, synchronizer  # noqa: E402

from tests.support.memory import clear_megatron_buffer, peak_bytes  # noqa: E402

TOKENS = (2048, 8192)
QUICK_TOKENS = (512, 1024)
SHAPE = {"batch": 1, "heads": 8, "groups": 2, "head_dim": 64}


def _setup_megatron() -> None:
    """A 1-rank world and TP=1 groups (``DotProductAttention`` needs the TP group and Megatron's
    global memory buffer), unless the caller already has a layout."""
    from megatron.core import parallel_state

    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.parallel import Layout, init_distributed, initialize_layout

    enable_cpu_megatron()
    init_distributed()
    if not parallel_state.model_parallel_is_initialized():
        initialize_layout(Layout())


def _modules(device: torch.device, dtype: torch.dtype, heads: int, groups: int, head_dim: int):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from elastic_plugin.models.attention import SDPAAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_cpu_initialization=device.type == "cpu",
    )
    args = dict(
        config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    return {"sdpa": SDPAAttention(**args), "unfused": DotProductAttention(**args)}


def run(
    quick: bool = False,
    reps: int | None = None,
    device: str | None = None,
    tokens: tuple[int, ...] | None = None,
) -> list[dict]:
    _setup_megatron()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    reps = reps or (1 if quick else 3)
    tokens = tokens or (QUICK_TOKENS if quick else TOKENS)
    b, heads, groups, d = (SHAPE[k] for k in ("batch", "heads", "groups", "head_dim"))
    modules = {name: m.to(dev) for name, m in _modules(dev, dtype, heads, groups, d).items()}
    rows = []
    for s in tokens:
        gen = torch.Generator().manual_seed(s)
        q = torch.randn(s, b, heads, d, generator=gen).to(dev, dtype).requires_grad_()
        k = torch.randn(s, b, groups, d, generator=gen).to(dev, dtype).requires_grad_()
        v = torch.randn(s, b, groups, d, generator=gen).to(dev, dtype).requires_grad_()
        grad = torch.randn(s, b, heads * d, generator=gen).to(dev, dtype)

        def clear_grads() -> None:
            for t in (q, k, v):
                t.grad = None

        def step(name: str) -> tuple[torch.Tensor, ...]:
            out = modules[name](q, k, v, None)
            out.backward(grad)
            return out.detach(), q.grad, k.grad, v.grad

        times = interleaved_medians(
            {name: (lambda name=name: (clear_grads(), step(name))) for name in modules},
            reps=reps,
            warmup=1,
            sync=synchronizer(dev),
        )
        peaks, results = {}, {}
        for name in modules:
            clear_grads()  # freed outside the profiled step: it counts its own gradients
            clear_megatron_buffer()
            peaks[name], results[name] = peak_bytes(lambda name=name: step(name), dev)
        clear_megatron_buffer()  # give back the unfused scores (GBs at 8K)
        diff = max(
            (a.float() - r.float()).abs().max().item()
            for a, r in zip(results["sdpa"], results["unfused"])
        )
        del results
        rows.append(
            {
                "name": f"attention fwd+bwd b{b} s{s} h{heads} g{groups} d{d} [{dev.type}]",
                "sdpa_ms": 1e3 * times["sdpa"],
                "unfused_ms": 1e3 * times["unfused"],
                "sdpa/unfused": times["sdpa"] / times["unfused"],
                "sdpa_MB": peaks["sdpa"] / 2**20,
                "unfused_MB": peaks["unfused"] / 2**20,
                "mem sdpa/unfused": peaks["sdpa"] / peaks["unfused"]
                if peaks["unfused"]
                else math.nan,
                "max_diff": f"{diff:.1e}",
            }
        )
    return rows


def main() -> None:
    from run_all import bench_main

    bench_main(run, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
