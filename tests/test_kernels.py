"""ordered_gather: C++/CUDA extension and PyTorch fallback agree with index_select.

Covers dtypes, dims, non-contiguous layouts, autograd (gradcheck), torch.library.opcheck,
torch.compile(fullgraph=True), bad-input errors, the backend report, and the fallback
path (in a subprocess with ELASTIC_PLUGIN_DISABLE_EXT=1).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import elastic_plugin.ops as ops

REPO = Path(__file__).resolve().parents[1]
OP = torch.ops.elastic_plugin.ordered_gather.default
# Where the compiled extension would load from (None if it was not built/installed).
EXTENSION_SPEC = importlib.util.find_spec("elastic_plugin._C")

DTYPES = [
    torch.bool,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex128,
    torch.float8_e4m3fn,
]


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    base = torch.randn(shape, generator=gen, dtype=torch.float64) * 50
    if dtype == torch.bool:
        return base > 0
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype)
    return base.to(dtype)


def _expected(src: torch.Tensor, perm: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    if src.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # compare bit patterns
        return src.view(torch.uint8).index_select(dim, perm[:k]).view(src.dtype)
    return src.index_select(dim, perm[:k])


def _assert_same(
    out: torch.Tensor, src: torch.Tensor, perm: torch.Tensor, k: int, dim: int
) -> None:
    expected = _expected(src, perm, k, dim)
    assert out.dtype == src.dtype and out.shape == expected.shape
    assert out.is_contiguous()
    if out.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        out, expected = out.view(torch.uint8), expected.view(torch.uint8)
    assert torch.equal(out, expected)


def _layouts(gen: torch.Generator, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Contiguous and non-contiguous views, incl. ones needing offset tables."""
    x3 = _random((6, 7, 5), dtype, gen)
    x4 = _random((3, 4, 5, 6), dtype, gen)
    return [
        ("contiguous 3-D", x3),
        ("transposed", x3.transpose(0, 2)),
        ("step slice", x3[:, ::2, 1:]),
        ("permuted 4-D", x4.permute(2, 0, 3, 1)),  # outer and inner do not collapse
        ("expanded", _random((1, 7, 5), dtype, gen).expand(4, 7, 5)),
        ("1-D", _random((9,), dtype, gen)),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_index_select_every_dim_and_layout(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    for _name, src in _layouts(gen, dtype):
        for dim in range(-src.dim(), src.dim()):
            n = src.shape[dim]
            perm = torch.randperm(n, generator=gen)
            for k in (0, 1, n // 2, n):
                out = ops.ordered_gather(src, perm, k, dim)
                _assert_same(out, src, perm, k, dim)
            if dim == 0:
                ref = ops.reference_ordered_gather(src, perm, n // 2, dim)
                _assert_same(ref, src, perm, n // 2, dim)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float32, torch.float64, torch.uint8], ids=str
)
def test_large_inputs_parallel_and_vector_paths(dtype: torch.dtype) -> None:
    """Big enough for several threads, the prefetching/SIMD last-dim loop and its tails."""
    gen = torch.Generator().manual_seed(1)
    src = _random((97, 1031), dtype, gen)
    for dim, k in ((0, 50), (1, 517), (1, 1031), (-1, 3)):
        perm = torch.randperm(src.shape[dim], generator=gen)
        _assert_same(ops.ordered_gather(src, perm, k, dim), src, perm, k, dim)
    # The last element of the storage is read without touching bytes past it.
    last = torch.full((src.shape[1],), src.shape[1] - 1)
    _assert_same(ops.ordered_gather(src, last, 33, 1), src, last, 33, 1)
    # A transposed (strided-row) source.
    srct = src.t()
    perm = torch.randperm(srct.shape[0], generator=gen)
    _assert_same(ops.ordered_gather(srct, perm, 600, 0), srct, perm, 600, 0)


def test_perm_prefix_semantics_duplicates_and_strided_perm() -> None:
    gen = torch.Generator().manual_seed(2)
    src = torch.randn(8, 3, generator=gen)
    perm = torch.tensor([5, 5, 0, 7, 1, 2, 3, 4, 6])  # a repeat is allowed, as in index_select
    _assert_same(ops.ordered_gather(src, perm, 4, 0), src, perm, 4, 0)
    strided = torch.randperm(16, generator=gen)[::2] % 8
    _assert_same(ops.ordered_gather(src, strided, 5, 0), src, strided, 5, 0)
    out = ops.ordered_gather(src, torch.arange(8), 8, 0)
    assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()  # always a new tensor


def test_conjugate_view_is_resolved() -> None:
    src = torch.randn(4, 3, dtype=torch.complex64).conj()
    perm = torch.tensor([2, 0, 1, 3])
    assert torch.equal(ops.ordered_gather(src, perm, 2, 0), src.resolve_conj()[[2, 0]])


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gradcheck_float64(dim: int) -> None:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(5, 4, 3, dtype=torch.float64, generator=gen)
    src = (
        base.transpose(0, 2).detach().requires_grad_(True)
        if dim == 1
        else base.requires_grad_(True)
    )
    perm = torch.randperm(src.shape[dim], generator=gen)
    k = src.shape[dim] - 1
    assert torch.autograd.gradcheck(lambda s: ops.ordered_gather(s, perm, k, dim), (src,))
    assert torch.autograd.gradgradcheck(lambda s: ops.ordered_gather(s, perm, k, dim), (src,))


def test_backward_scatters_into_kept_rows_only() -> None:
    src = torch.randn(5, 2, requires_grad=True)
    perm = torch.tensor([3, 1, 4, 0, 2])
    ops.ordered_gather(src, perm, 2, 0).sum().backward()
    expected = torch.zeros(5, 2)
    expected[[3, 1]] = 1.0
    assert torch.equal(src.grad, expected)


def test_opcheck() -> None:
    gen = torch.Generator().manual_seed(4)
    cases = [
        (
            torch.randn(6, 5, dtype=torch.float64, generator=gen, requires_grad=True),
            torch.randperm(6, generator=gen),
            3,
            0,
        ),
        (
            torch.randn(4, 6, 3, generator=gen).transpose(0, 1),
            torch.randperm(4, generator=gen),
            2,
            1,
        ),
        (torch.randint(0, 9, (3, 5), generator=gen), torch.randperm(5, generator=gen), 0, -1),
    ]
    for args in cases:
        result = torch.library.opcheck(OP, args)
        assert set(result.values()) == {"SUCCESS"}, result


def test_torch_compile_fullgraph() -> None:
    """Inductor on a graph of just the op (no C++ codegen, so no slow compiler run), then
    forward + backward through AOT autograd with surrounding ops (fake rule + autograd)."""
    gen = torch.Generator().manual_seed(5)
    src = torch.randn(6, 8, generator=gen, requires_grad=True)
    perm = torch.randperm(8, generator=gen)

    gather = torch.compile(
        lambda x, p: ops.ordered_gather(x, p, 5, 1), fullgraph=True, dynamic=False
    )
    with torch.no_grad():
        assert torch.equal(gather(src, perm), src[:, perm[:5]])

    def step(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return (ops.ordered_gather(x, p, 5, 1) * 3.0).sin()

    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="aot_eager")
    out = compiled(src, perm)
    torch.testing.assert_close(out, step(src, perm))
    (grad_compiled,) = torch.autograd.grad(out.sum(), src)
    (grad_eager,) = torch.autograd.grad(step(src, perm).sum(), src)
    torch.testing.assert_close(grad_compiled, grad_eager)


BAD_INPUTS = [
    # (description, call args, exception type, words the message must contain)
    (
        "perm 2-D",
        lambda x: (x, torch.zeros(2, 3, dtype=torch.long), 1, 0),
        ValueError,
        ["perm", "1-D"],
    ),
    (
        "perm int32",
        lambda x: (x, torch.arange(4, dtype=torch.int32), 1, 0),
        TypeError,
        ["perm", "int64"],
    ),
    (
        "k negative",
        lambda x: (x, torch.arange(4), -1, 0),
        ValueError,
        ["k must be in [0, len(perm)=4]"],
    ),
    (
        "k too big",
        lambda x: (x, torch.arange(4), 5, 0),
        ValueError,
        ["k must be in [0, len(perm)=4]"],
    ),
    ("dim too big", lambda x: (x, torch.arange(4), 1, 2), ValueError, ["dim must be in [-2, 1]"]),
    (
        "dim too small",
        lambda x: (x, torch.arange(4), 1, -3),
        ValueError,
        ["dim must be in [-2, 1]"],
    ),
    (
        "perm value too big",
        lambda x: (x, torch.tensor([0, 4, 1]), 2, 0),
        ValueError,
        ["perm[:k]", "max 4"],
    ),
    (
        "perm value negative",
        lambda x: (x, torch.tensor([-1, 2]), 2, 0),
        ValueError,
        ["perm[:k]", "min -1"],
    ),
    (
        "perm on meta device",
        lambda x: (x, torch.arange(4, device="meta"), 1, 0),
        ValueError,
        ["perm is on meta"],
    ),
    (
        "0-d src",
        lambda x: (x.sum(), torch.arange(1), 1, 0),
        ValueError,
        ["src", "at least 1 dimension"],
    ),
]


@pytest.mark.parametrize("entry", ["wrapper", "torch.ops"])
@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument(case, entry: str) -> None:
    _, make_args, exc_type, words = case
    args = make_args(torch.randn(4, 3))
    call = ops.ordered_gather if entry == "wrapper" else OP
    with pytest.raises(exc_type) as info:
        call(*args)
    for word in words:
        assert word in str(info.value)


def test_out_of_range_value_beyond_k_is_ignored() -> None:
    """Only perm[:k] is read, so entries after k may be anything."""
    src = torch.randn(4, 3)
    perm = torch.tensor([1, 0, 99])
    _assert_same(ops.ordered_gather(src, perm, 2, 0), src, perm, 2, 0)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("not a tensor", torch.arange(2), 1, 0), ["src must be a torch.Tensor"]),
        ((torch.randn(2), [0, 1], 1, 0), ["perm must be a torch.Tensor"]),
        ((torch.randn(2), torch.arange(2), 1.0, 0), ["k must be an int"]),
        ((torch.randn(2), torch.arange(2), True, 0), ["k must be an int"]),
        ((torch.randn(2), torch.arange(2), 1, "0"), ["dim must be an int"]),
        ((torch.randn(2).to_sparse(), torch.arange(2), 1, 0), ["src must be a strided"]),
    ],
)
def test_wrapper_type_errors(args, words) -> None:
    with pytest.raises(TypeError) as info:
        ops.ordered_gather(*args)
    for word in words:
        assert word in str(info.value)


def test_backend_report_matches_the_build() -> None:
    info = ops.backend_info()
    assert ops.backend() == info["backend"] and info["backend"] in ops.BACKENDS
    assert info["reason"]
    if os.environ.get(ops.DISABLE_ENV):
        pytest.skip(f"{ops.DISABLE_ENV} is set in this test run")
    if EXTENSION_SPEC is not None:
        import elastic_plugin._C as ext

        assert info["backend"] == ("cpp+cuda" if ext.WITH_CUDA else "cpp"), info
        assert Path(info["extension_path"]).resolve() == Path(EXTENSION_SPEC.origin).resolve()
        assert info["built_for_torch"] == torch.__version__
        has_cuda_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(
            "elastic_plugin::ordered_gather", "CUDA"
        )
        assert has_cuda_kernel  # compiled, or the PyTorch stand-in of a CPU-only build
    else:
        assert info["backend"] == "pytorch" and "could not be imported" in info["reason"]


# --- the pure-PyTorch fallback, in fresh processes -------------------------------------

_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    import elastic_plugin.ops as ops
    gen = torch.Generator().manual_seed(7)
    src = torch.randn(6, 9, 4, generator=gen)
    cases = {}
    for name, x, dim in [("rows", src, 0), ("mid", src, 1), ("last", src, -1), ("t", src.transpose(0, 1), 1),
                         ("bf16", src.bfloat16(), 1), ("int", (src * 9).long(), 2)]:
        perm = torch.randperm(x.shape[dim], generator=gen)
        cases[name] = (x, perm, x.shape[dim] // 2 + 1, dim, ops.ordered_gather(x, perm, x.shape[dim] // 2 + 1, dim))
    errors = {}
    for label, args in {"k": (src, torch.arange(6), 7, 0), "perm": (src, torch.tensor([0, 6]), 2, 0),
                        "dim": (src, torch.arange(6), 1, 3)}.items():
        try:
            torch.ops.elastic_plugin.ordered_gather(*args)
        except (ValueError, TypeError) as exc:
            errors[label] = f"{type(exc).__name__}: {exc}"
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    perm = torch.randperm(5, generator=gen)
    checks = {
        "gradcheck": torch.autograd.gradcheck(lambda s: ops.ordered_gather(s, perm, 3, 0), (x,)),
        "opcheck": torch.library.opcheck(torch.ops.elastic_plugin.ordered_gather.default, (x, perm, 3, 0)),
    }
    torch.save(cases, sys.argv[1])
    print(json.dumps({"info": ops.backend_info(), "errors": errors, "checks": checks}))
    """
)


@pytest.fixture(scope="module")
def _child_processes(tmp_path_factory):
    """Start the child script (integration tier: a fresh interpreter): once with the
    extension disabled and, if it is built, once with the SIMD loops switched off."""
    variants = {"fallback": {ops.DISABLE_ENV: "1"}}
    if EXTENSION_SPEC is not None:
        variants["no_simd"] = {"ELASTIC_PLUGIN_NO_SIMD": "1", ops.DISABLE_ENV: ""}
    tmp = tmp_path_factory.mktemp("children")
    procs = {}
    for name, extra_env in variants.items():
        env = {**os.environ, **extra_env, "PYTHONPATH": str(REPO)}
        procs[name] = (
            subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(tmp / f"{name}.pt")],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
            tmp / f"{name}.pt",
        )
    yield procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def child_runs(_child_processes) -> dict[str, tuple[dict, dict]]:
    results = {}
    for name, (proc, path) in _child_processes.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name} child failed:\n{stderr[-3000:]}"
        report = json.loads(stdout.strip().splitlines()[-1])
        results[name] = (report, torch.load(path))
    return results


def _check_child(report: dict, cases: dict) -> None:
    for _name, (src, perm, k, dim, out) in cases.items():
        _assert_same(out, src, perm, k, dim)
        _assert_same(
            ops.ordered_gather(src, perm, k, dim), src, perm, k, dim
        )  # this process agrees
    assert (
        report["errors"]["k"].startswith("ValueError") and "k must be in" in report["errors"]["k"]
    )
    assert (
        report["errors"]["perm"].startswith("ValueError") and "perm[:k]" in report["errors"]["perm"]
    )
    assert (
        report["errors"]["dim"].startswith("ValueError")
        and "dim must be in" in report["errors"]["dim"]
    )
    assert report["checks"]["gradcheck"] is True
    assert set(report["checks"]["opcheck"].values()) == {"SUCCESS"}


@pytest.mark.integration
def test_fallback_backend_gives_same_results(child_runs) -> None:
    report, cases = child_runs["fallback"]
    assert report["info"]["backend"] == "pytorch"
    assert ops.DISABLE_ENV in report["info"]["reason"]
    _check_child(report, cases)


@pytest.mark.integration
def test_scalar_cpu_path_without_simd(child_runs) -> None:
    if "no_simd" not in child_runs:
        pytest.skip("extension not built")
    report, cases = child_runs["no_simd"]
    assert report["info"]["backend"] in ("cpp", "cpp+cuda")
    _check_child(report, cases)


# --- CUDA (skipped without a GPU) ----------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.complex128], ids=str
)
def test_cuda_matches_index_select(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(8)
    for _name, src_cpu in _layouts(gen, dtype) + [("big", _random((67, 1029), dtype, gen))]:
        src = src_cpu.cuda()
        for dim in range(src.dim()):
            perm = torch.randperm(src.shape[dim], generator=gen).cuda()
            k = max(1, src.shape[dim] // 2)
            out = ops.ordered_gather(src, perm, k, dim)
            assert out.device == src.device
            _assert_same(out.cpu(), src_cpu, perm.cpu(), k, dim)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bad_inputs() -> None:
    src = torch.randn(4, 3, device="cuda")
    with pytest.raises(ValueError, match=r"perm\[:k\] values"):
        OP(src, torch.tensor([0, 4], device="cuda"), 2, 0)
    with pytest.raises(ValueError, match="perm is on cpu"):
        OP(src, torch.arange(4), 2, 0)


# --- the benchmark runner's plumbing (no timing runs) -------------------------------


def test_bench_runner_discovers_and_prints(capsys) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import run_all
        from _timing import interleaved_medians
    finally:
        sys.path.remove(str(REPO / "bench"))
    assert "bench_gather" in run_all.discover()
    assert run_all._select(run_all.discover(), ["gather"]) == ["bench_gather"]
    with pytest.raises(SystemExit):
        run_all._select(run_all.discover(), ["nope"])
    calls = []
    medians = interleaved_medians(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, reps=3, warmup=1
    )
    assert (
        set(medians) == {"a", "b"}
        and calls.count("a") == 4
        and calls[2:4] == ["a", "b"]
        and calls[4:6] == ["b", "a"]
    )
    run_all.print_table([{"name": "x", "t_ms": 1.5}, {"name": "y", "ratio": 0.25}])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "t_ms", "ratio"] and "0.250" in lines[3]


def test_bench_gather_traffic_bound_counts_whole_lines() -> None:
    """The bench's lower bound on bytes read: whole 64-byte lines along the contiguous axis."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import bench_gather
    finally:
        sys.path.remove(str(REPO / "bench"))
    src = torch.zeros(4, 64)  # 256 bytes = 4 lines per row
    kept = torch.tensor([0, 1, 17])  # elements 0, 1 in line 0; element 17 in line 1
    assert bench_gather.min_source_bytes(src, 1, kept) == 4 * 2 * 64
    assert (
        bench_gather.min_source_bytes(src.t(), 0, kept) == 4 * 2 * 64
    )  # rows of a transposed view
    assert bench_gather.min_source_bytes(src, 0, torch.tensor([3, 1])) == 2 * 64 * 4  # whole rows


def test_gpu_check_script_is_valid_bash() -> None:
    """scripts/gpu_check.sh is the one prepared call for a lent GPU: it must at least parse."""
    proc = subprocess.run(
        ["bash", "-n", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
