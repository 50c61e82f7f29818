"""elastic_plugin.compat: each CPU/gloo patch does what Megatron needs, and only when asked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest


def _run_python(code: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.integration
def test_patches_make_cuda_assumptions_work_on_cpu():
    out = _run_python("""
        import json, torch
        from elastic_plugin.compat import enable_cpu_megatron, applied_patches
        patches = enable_cpu_megatron()
        assert enable_cpu_megatron() == patches  # idempotent
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
        # RNG tracker: forks are reproducible and differ from the default stream
        import megatron.core.parallel_state as ps
        import torch.distributed as dist
        from elastic_plugin.parallel import init_distributed
        init_distributed()
        ps.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(5)
        with get_cuda_rng_tracker().fork():
            a = torch.rand(4)
        model_parallel_cuda_manual_seed(5)
        with get_cuda_rng_tracker().fork():
            b = torch.rand(4)
        t = torch.empty(3, device="cuda")
        u = torch.ones(2).to("cuda:0")
        s = torch.cuda.Stream(); e = s.record_event(); e.synchronize()
        print(json.dumps({
            "n": len(patches), "same_fork": bool(torch.equal(a, b)),
            "empty_device": str(t.device), "to_device": str(u.device),
            "type": torch.zeros(1).type(), "cast": torch.zeros(1).type(torch.float64).dtype.__repr__(),
            "mamba": any(p.startswith("mamba:") for p in patches),
        }))
    """)
    info = json.loads(out)
    assert info["n"] > 10 and info["mamba"]
    assert info["same_fork"]
    assert info["empty_device"] == "cpu" and info["to_device"] == "cpu"
    assert info["type"] == "torch.cuda.FloatTensor"
    assert info["cast"] == "torch.float64"  # casts through .type(dtype) still work


@pytest.mark.integration
def test_no_patches_when_cuda_is_available():
    out = _run_python("""
        import torch
        torch.cuda.is_available = lambda: True
        orig = torch.cuda.get_rng_state
        from elastic_plugin.compat import enable_cpu_megatron
        print(len(enable_cpu_megatron()), torch.cuda.get_rng_state is orig)
    """)
    assert out == "0 True"


@pytest.mark.integration
def test_environment_variable_opt_in():
    code = """
        import elastic_plugin
        from elastic_plugin.compat import applied_patches
        print(len(applied_patches()))
    """
    assert int(_run_python(code, {"ELASTIC_PLUGIN_CPU": "1"})) > 10
    assert int(_run_python(code, {"ELASTIC_PLUGIN_CPU": "0"})) == 0


@pytest.mark.integration
def test_gloo_uneven_all_gather_and_list_reduce_scatter(rank_pools):
    pool = rank_pools.get(2)
    gathered = pool.run("tests.support.cases:uneven_all_gather")
    scattered = pool.run("tests.support.cases:list_reduce_scatter")
    expected = [[0.0], [1.0, 1.0]]
    assert all(g == expected for g in gathered)
    # piece r summed over senders: (1+2) * (r+1)
    assert scattered == [[3.0], [6.0, 6.0]]


def test_a_meta_device_context_still_works_after_the_patches():
    """transformers' ``from_pretrained`` builds under ``with torch.device("meta")``; after the
    factory patches that context must still reach every factory (it found them by identity in
    a set built after the patch, so RoPE buffers came out real and uninitialised)."""
    import torch

    from elastic_plugin.compat import enable_cpu_megatron

    enable_cpu_megatron()
    with torch.device("meta"):
        made = [torch.zeros(2), torch.arange(3), torch.empty(1), torch.full((2,), 1.0)]
    assert all(t.is_meta for t in made)
    assert torch.zeros(2, device="cuda").device.type == "cpu"  # the patch itself still applies
