"""Sliced-mode ops: prefix_linear (masked GEMM), ordered_gather_many, FP8 prefix GEMM emulation.

Each op is checked against its plain-PyTorch formula (fp32 tight, bf16 loose), with
gradcheck, torch.library.opcheck, torch.compile, bad inputs, that the weight is read in
place (no copy of the prefix), and the pure-PyTorch fallback in a subprocess with
ELASTIC_PLUGIN_DISABLE_EXT=1.
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
from torch.profiler import ProfilerActivity, profile

import elastic_plugin.ops as ops
from elastic_plugin.ops._fp8 import relative_error

REPO = Path(__file__).resolve().parents[1]
LINEAR = torch.ops.elastic_plugin.prefix_linear.default
MANY = torch.ops.elastic_plugin.ordered_gather_many.default
EXTENSION_SPEC = importlib.util.find_spec("elastic_plugin._C")


def _expected_linear(x, w, b, n, k):
    y = x[..., :k].double() @ w[:n, :k].double().T
    return y if b is None else y + b[:n].double()


# --- the fallback, started first so it runs while the other tests do ------------------

_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    import elastic_plugin.ops as ops
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 4, 16, generator=gen)
    w = torch.randn(12, 16, generator=gen)
    b = torch.randn(12, generator=gen)
    perm = torch.randperm(12, generator=gen)
    many_in = [w, b, w.t().contiguous(), w.bfloat16()]
    cases = {
        "col": (x, w, b, 7, 16, ops.prefix_linear(x, w, b, 7, 16)),
        "row": (x, w, None, 12, 9, ops.prefix_linear(x, w, None, 12, 9)),
        "many": (many_in, perm, 5, [0, 0, 1, -2], ops.ordered_gather_many(many_in, perm, 5, [0, 0, 1, -2])),
    }
    errors = {}
    for label, call in {
        "k": lambda: torch.ops.elastic_plugin.prefix_linear(x, w, b, 3, 17),
        "dtype": lambda: torch.ops.elastic_plugin.prefix_linear(x.long(), w.long(), None, 3, 4),
        "many_perm": lambda: torch.ops.elastic_plugin.ordered_gather_many([w, w[:5]], perm, 12, [0, 0]),
    }.items():
        try:
            call()
        except (ValueError, TypeError) as exc:
            errors[label] = f"{type(exc).__name__}: {exc}"
    xd = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    wd = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    bd = torch.randn(5, dtype=torch.float64, requires_grad=True)
    checks = {
        "gradcheck": torch.autograd.gradcheck(lambda a, c, d: ops.prefix_linear(a, c, d, 3, 4), (xd, wd, bd)),
        "opcheck_linear": torch.library.opcheck(torch.ops.elastic_plugin.prefix_linear.default, (xd, wd, bd, 3, 4)),
        "opcheck_many": torch.library.opcheck(
            torch.ops.elastic_plugin.ordered_gather_many.default, ([wd, bd], torch.randperm(5), 3, [0, 0])),
    }
    torch.save(cases, sys.argv[1])
    print(json.dumps({"info": ops.backend_info(), "errors": errors, "checks": checks}))
    """
)


@pytest.fixture(scope="module")
def _fallback_child(tmp_path_factory):
    path = tmp_path_factory.mktemp("fallback") / "cases.pt"
    env = {**os.environ, ops.DISABLE_ENV: "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield proc, path
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


# --- prefix_linear ----------------------------------------------------------------------

LINEAR_CASES = [
    # (label, x shape, weight shape, n, k, with bias)
    ("column-parallel", (4, 6, 64), (48, 64), 20, 64, True),
    ("row-parallel", (4, 6, 64), (48, 64), 48, 37, False),
    ("both, x wider than k", (5, 64), (48, 64), 33, 29, True),
    ("x exactly k wide", (7, 29), (48, 64), 48, 29, True),
    ("1-D x", (64,), (48, 64), 10, 50, True),
    ("full", (3, 64), (48, 64), 48, 64, True),
    ("n = 0", (3, 64), (48, 64), 0, 64, True),
    ("k = 0", (3, 64), (48, 64), 5, 0, True),
    ("no tokens", (0, 64), (48, 64), 5, 10, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", LINEAR_CASES, ids=[c[0] for c in LINEAR_CASES])
def test_prefix_linear_matches_sliced_matmul(case, dtype: torch.dtype) -> None:
    _, x_shape, w_shape, n, k, with_bias = case
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(x_shape, generator=gen).to(dtype)
    w = torch.randn(w_shape, generator=gen).to(dtype)
    b = torch.randn(w_shape[0], generator=gen).to(dtype) if with_bias else None
    y = ops.prefix_linear(x, w, b, n, k)
    expected = _expected_linear(x, w, b, n, k)
    assert y.dtype == dtype and y.shape == (*x_shape[:-1], n)
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    else:  # one rounding of the output to 16 bits, plus accumulation order
        assert relative_error(y, expected) < 1e-2
        torch.testing.assert_close(y.double(), expected, rtol=2e-2, atol=6e-2)


def test_prefix_linear_ignores_everything_outside_the_prefix() -> None:
    """NaN outside weight[:n, :k], x[..., :k] and bias[:n] must not reach the output."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 40, generator=gen)
    w = torch.randn(30, 40, generator=gen)
    b = torch.randn(30, generator=gen)
    n, k = 17, 23
    clean = ops.prefix_linear(x, w, b, n, k)
    x[:, k:] = float("nan")
    w[n:, :] = float("nan")
    w[:, k:] = float("nan")
    b[n:] = float("nan")
    poisoned = ops.prefix_linear(x, w, b, n, k)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)


def test_prefix_linear_non_contiguous_inputs() -> None:
    """x whose leading dims do not flatten (copied, correctly) and a transposed weight."""
    gen = torch.Generator().manual_seed(18)
    x = torch.randn(6, 4, 20, generator=gen).transpose(0, 1)
    w = torch.randn(20, 12, generator=gen).t()
    b = torch.randn(24, generator=gen)[::2]
    y = ops.prefix_linear(x, w, b, 7, 15)
    torch.testing.assert_close(y.double(), _expected_linear(x, w, b, 7, 15), rtol=1e-5, atol=1e-5)


def _bytes_allocated(fn) -> tuple[int, set[str]]:
    """Bytes the CPU allocator handed out while fn ran, and the aten ops it called."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocated = sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())
    return allocated, {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefix_linear_reads_the_weight_in_place(dtype: torch.dtype) -> None:
    """Only the output is allocated (no sliced copy of the weight, nor of x)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(32, 512, generator=gen).to(dtype)
    w = torch.randn(512, 512, generator=gen).to(dtype)
    for n, k in ((256, 512), (512, 256), (300, 200)):
        out_bytes = 32 * n * x.element_size()
        copy_bytes = n * k * w.element_size()
        allocated, called = _bytes_allocated(lambda: ops.prefix_linear(x, w, None, n, k))
        assert allocated <= out_bytes + 1024, (n, k, allocated, out_bytes)
        assert not {"aten::contiguous", "aten::clone", "aten::copy_"} & called, called
        # The measurement does see a sliced copy when there is one.
        copied, _ = _bytes_allocated(lambda: x[:, :k] @ w[:n, :k].clone().T)
        assert copied >= out_bytes + copy_bytes


def test_prefix_linear_gradients() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 9, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(7, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, generator=gen, requires_grad=True)
    n, k = 5, 6
    assert torch.autograd.gradcheck(lambda *a: ops.prefix_linear(*a, n, k), (x, w, b))
    assert torch.autograd.gradgradcheck(lambda *a: ops.prefix_linear(*a, n, k), (x, w, b))
    assert torch.autograd.gradcheck(lambda a, c: ops.prefix_linear(a, c, None, 7, 3), (x, w))

    # Same gradients as autograd through the sliced formula; zeros outside the prefix.
    grad_out = torch.randn(2, 3, n, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad(ops.prefix_linear(x, w, b, n, k), (x, w, b), grad_out)
    want = torch.autograd.grad(x[..., :k] @ w[:n, :k].T + b[:n], (x, w, b), grad_out)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)
    gx, gw, gb = got
    assert gx.shape == x.shape and gw.shape == w.shape and gb.shape == b.shape
    assert not gx[..., k:].any() and not gw[n:].any() and not gw[:, k:].any() and not gb[n:].any()
    assert gw[:n, :k].abs().min() > 0


def test_prefix_linear_backward_bf16_matches_fp32() -> None:
    gen = torch.Generator().manual_seed(4)
    x32 = torch.randn(16, 64, generator=gen)
    w32 = torch.randn(48, 64, generator=gen)
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = x32.to(dtype).detach().requires_grad_(True)
        w = w32.to(dtype).detach().requires_grad_(True)
        ops.prefix_linear(x, w, None, 30, 40).square().sum().backward()
        grads[dtype] = (x.grad, w.grad)
    for g16, g32 in zip(grads[torch.bfloat16], grads[torch.float32]):
        assert g16.dtype == torch.bfloat16
        assert relative_error(g16, g32) < 2e-2


def test_prefix_linear_opcheck() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 10, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(6, 10, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, generator=gen, requires_grad=True)
    for args in [
        (x, w, b, 4, 7),
        (x, w, None, 6, 10),
        (x.detach().bfloat16(), w.detach().bfloat16(), None, 2, 3),
    ]:
        result = torch.library.opcheck(LINEAR, args)
        assert set(result.values()) == {"SUCCESS"}, result


# --- ordered_gather_many ----------------------------------------------------------------


def _layer(gen: torch.Generator) -> tuple[list[torch.Tensor], list[int]]:
    """An FFN-like layer plus awkward layouts, dtypes and sizes (several tasks per tensor)."""
    fc1 = torch.randn(96, 300, generator=gen)
    tensors = [
        fc1,  # rows (contiguous rows)
        torch.randn(96, generator=gen),  # bias
        torch.randn(300, 96, generator=gen).bfloat16(),  # columns: last-dim path (SIMD if present)
        fc1.t(),  # strided rows
        torch.randn(2, 96, 5, 3, generator=gen).permute(3, 1, 0, 2),  # middle dim, offset tables
        (torch.randn(96, 4, generator=gen) * 9).to(torch.int8),
        torch.randn(4, 96, generator=gen, dtype=torch.float64)[:, ::1],
        torch.complex(torch.randn(96, 3, generator=gen), torch.randn(96, 3, generator=gen)).to(
            torch.complex128
        ),
        torch.randn(0, 96, generator=gen),  # empty
    ]
    dims = [0, 0, -1, 0, 1, 0, 1, 0, 1]
    return tensors, dims


@pytest.mark.parametrize("k", [0, 1, 50, 96])
def test_ordered_gather_many_matches_index_select(k: int) -> None:
    gen = torch.Generator().manual_seed(6)
    tensors, dims = _layer(gen)
    perm = torch.randperm(96, generator=gen)
    outs = ops.ordered_gather_many(tensors, perm, k, dims)
    assert len(outs) == len(tensors)
    for out, t, d in zip(outs, tensors, dims):
        expected = t.index_select(d, perm[:k])
        assert out.dtype == t.dtype and out.is_contiguous()
        assert torch.equal(out, expected)
        assert out.data_ptr() != t.data_ptr() or out.numel() == 0
    ref = ops.reference_ordered_gather_many(tensors, perm, k, dims)
    assert all(torch.equal(a, b) for a, b in zip(outs, ref))


def test_ordered_gather_many_large_and_empty_list() -> None:
    gen = torch.Generator().manual_seed(7)
    big = [torch.randn(1024, 515, generator=gen), torch.randn(515, 1024, generator=gen).bfloat16()]
    perm = torch.randperm(1024, generator=gen)
    outs = ops.ordered_gather_many(big, perm, 700, [0, 1])
    assert torch.equal(outs[0], big[0][perm[:700]]) and torch.equal(outs[1], big[1][:, perm[:700]])
    assert ops.ordered_gather_many([], perm, 3, []) == []


def test_ordered_gather_many_autograd() -> None:
    gen = torch.Generator().manual_seed(8)
    a = torch.randn(6, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, generator=gen, requires_grad=True)
    c = torch.randn(3, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    perm = torch.randperm(6, generator=gen)
    fn = lambda *ts: ops.ordered_gather_many(list(ts), perm, 4, [0, 0, 1])  # noqa: E731
    assert torch.autograd.gradcheck(fn, (a, b, c))
    # Only one output used: the others get zero / no gradient, the used one scatters back.
    out = ops.ordered_gather_many([a, b, c], perm, 4, [0, 0, 1])
    (ga, gc) = torch.autograd.grad(out[2].sum(), (a, c), allow_unused=True)
    assert ga is None or not ga.any()
    expected = torch.zeros_like(c)
    expected[:, perm[:4]] = 1.0
    assert torch.equal(gc, expected)


def test_ordered_gather_many_opcheck() -> None:
    gen = torch.Generator().manual_seed(9)
    tensors = [
        torch.randn(5, 3, dtype=torch.float64, generator=gen, requires_grad=True),
        torch.randn(4, 5, generator=gen).t(),
        torch.randint(0, 9, (2, 5), generator=gen),
    ]
    for k in (0, 3):
        result = torch.library.opcheck(
            MANY, (tensors, torch.randperm(5, generator=gen), k, [0, 0, -1])
        )
        assert set(result.values()) == {"SUCCESS"}, result


# --- torch.compile ------------------------------------------------------------------------


def test_torch_compile_fullgraph_forward_and_backward() -> None:
    """Inductor on a graph of just the two ops (extern kernels, no C++ codegen), then both
    ops and the FP8 emulation forward + backward through AOT autograd (no graph break)."""
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(4, 16, generator=gen, requires_grad=True)
    w = torch.randn(12, 16, generator=gen, requires_grad=True)
    b = torch.randn(12, generator=gen, requires_grad=True)
    perm = torch.randperm(12, generator=gen)

    ops_only = torch.compile(
        lambda x, w, b, p: (
            ops.prefix_linear(x, w, b, 7, 15),
            ops.ordered_gather_many([w, b], p, 5, [0, 0]),
        ),
        fullgraph=True,
        dynamic=False,
    )
    with torch.no_grad():
        y, (w5, b5) = ops_only(x, w, b, perm)
        assert torch.equal(y, ops.prefix_linear(x, w, b, 7, 15))
        assert torch.equal(w5, w[perm[:5]]) and torch.equal(b5, b[perm[:5]])

    def step(x, w, b, perm):
        w_sorted, b_sorted = ops.ordered_gather_many([w, b], perm, 12, [0, 0])
        y = ops.prefix_linear(x, w_sorted, b_sorted, 8, 10).relu()
        with torch.no_grad():
            y8 = ops.fp8_prefix_linear(x, w_sorted, 8, 10, "row")
        return y, y8

    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="aot_eager")
    y, y8 = compiled(x, w, b, perm)
    y_ref, y8_ref = step(x, w, b, perm)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(y8, y8_ref)
    grads = torch.autograd.grad(y.sum(), (x, w, b))
    grads_ref = torch.autograd.grad(y_ref.sum(), (x, w, b))
    for g, e in zip(grads, grads_ref):
        torch.testing.assert_close(g, e)


# --- FP8 emulation ------------------------------------------------------------------------


def test_quantize_e4m3_per_tensor_and_per_row() -> None:
    gen = torch.Generator().manual_seed(12)
    t = torch.randn(6, 33, generator=gen) * torch.logspace(-2, 2, 6).unsqueeze(1)
    q, s = ops.quantize_e4m3(t, "tensor")
    assert q.dtype == torch.float8_e4m3fn and q.shape == t.shape and s.shape == ()
    assert s == t.abs().max() / ops.E4M3_MAX and q.float().abs().max() == ops.E4M3_MAX
    qr, sr = ops.quantize_e4m3(t, "row", dim=-1)
    assert sr.shape == (6, 1)
    torch.testing.assert_close(sr, t.abs().amax(1, keepdim=True) / ops.E4M3_MAX)
    assert torch.equal(qr.float().abs().amax(1), torch.full((6,), ops.E4M3_MAX))
    # E4M3 keeps 3 mantissa bits: relative rounding error <= 2^-4 for normal values.
    back = ops.dequantize_e4m3(qr, sr)
    normal = t.abs() >= sr * 2.0**-6
    assert ((back - t).abs() <= t.abs() * 2.0**-4 + 1e-12)[normal].all()
    # Columns share a scale with dim=0.
    _, sc = ops.quantize_e4m3(t, "row", dim=0)
    assert sc.shape == (1, 33)
    # All zeros: scale 1, no NaN.
    qz, sz = ops.quantize_e4m3(torch.zeros(3, 4), "row")
    assert torch.equal(sz, torch.ones(3, 1)) and not qz.float().any()


def test_fp8_prefix_linear_error_and_scaling() -> None:
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(256, 512, generator=gen)
    w = torch.randn(384, 512, generator=gen)
    n, k = 300, 400
    exact = x[:, :k] @ w[:n, :k].T
    err_tensor = relative_error(ops.fp8_prefix_linear(x, w, n, k, "tensor"), exact)
    err_row = relative_error(ops.fp8_prefix_linear(x, w, n, k, "row"), exact)
    # Measured 3.8% / 3.7% on this data: E4M3's 3 mantissa bits on both operands.
    assert 0.02 < err_tensor < 0.06 and 0.02 < err_row < 0.06
    assert err_row <= err_tensor * 1.02

    # Outlier rows (a few hot tokens and weight rows).  E4M3 is a float format, so one
    # tensor scale is fine while all magnitudes fit its normal range (2^-6..448, ~4.5
    # decades); past that, a tensor scale pushes ordinary rows into subnormals, which
    # per-row scales avoid.  Hence outliers 3e4 x the rest.
    x_out, w_out = x.clone(), w.clone()
    x_out[::37] *= 3e4
    w_out[::41] *= 3e4
    exact_out = x_out[:, :k] @ w_out[:n, :k].T
    y_tensor = ops.fp8_prefix_linear(x_out, w_out, n, k, "tensor")
    y_row = ops.fp8_prefix_linear(x_out, w_out, n, k, "row")
    # Overall (dominated by the outlier products) both stay near 4%...
    assert relative_error(y_tensor, exact_out) < 0.06 and relative_error(y_row, exact_out) < 0.06
    # ...but the ordinary tokens x ordinary weight rows lose precision with one scale
    # (measured 20.0% vs 3.7%), and so does the average token (15.9% vs 3.9%).
    rows = torch.ones(256, dtype=torch.bool)
    rows[::37] = False
    cols = torch.ones(n, dtype=torch.bool)
    cols[::41] = False
    block_tensor = relative_error(y_tensor[rows][:, cols], exact_out[rows][:, cols])
    block_row = relative_error(y_row[rows][:, cols], exact_out[rows][:, cols])
    assert block_row < 0.06 and block_tensor > 2 * block_row

    def mean_token_error(y: torch.Tensor) -> float:
        return float(((y - exact_out).norm(dim=1) / exact_out.norm(dim=1)).mean())

    assert mean_token_error(y_row) < 0.06 and mean_token_error(y_tensor) > 2 * mean_token_error(
        y_row
    )


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_fp8_emulation_matches_torch_scaled_mm(scaling: str) -> None:
    """The emulation and torch._scaled_mm (runnable on CPU at small sizes) agree."""
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("torch._scaled_mm is absent")
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(2, 8, 64, generator=gen)
    w = torch.randn(48, 80, generator=gen)
    emu = ops.fp8_prefix_linear(x, w, 32, 48, scaling, method="emulate")
    ref = ops.fp8_prefix_linear(x, w, 32, 48, scaling, method="scaled_mm")
    assert emu.shape == ref.shape == (2, 8, 32) and emu.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(emu, ref, rtol=1e-5, atol=1e-4)
    bf = ops.fp8_prefix_linear(x.bfloat16(), w.bfloat16(), 32, 48, scaling)
    assert bf.dtype == torch.bfloat16 and relative_error(bf, emu) < 2e-2


def test_fp8_prefix_linear_reads_only_the_prefix_and_handles_empty() -> None:
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(5, 20, generator=gen)
    w = torch.randn(9, 20, generator=gen)
    clean = ops.fp8_prefix_linear(x, w, 6, 11, "row")
    x[:, 11:] = float("inf")
    w[6:] = float("nan")
    w[:, 11:] = float("nan")
    assert torch.equal(ops.fp8_prefix_linear(x, w, 6, 11, "row"), clean)
    assert ops.fp8_prefix_linear(x, w, 0, 11).shape == (5, 0)
    assert not ops.fp8_prefix_linear(x, w, 6, 0, "row").any()
    assert ops.fp8_prefix_linear(x[:0], w, 6, 11, "tensor").shape == (0, 6)


# --- bad inputs -----------------------------------------------------------------------------

_X, _W, _B = torch.randn(3, 8), torch.randn(6, 8), torch.randn(6)
LINEAR_BAD = [
    ("k > K", (_X, _W, _B, 6, 9), ValueError, ["k must be in [0, weight.size(1)=8]"]),
    ("n > N", (_X, _W, _B, 7, 8), ValueError, ["n must be in [0, weight.size(0)=6]"]),
    ("n negative", (_X, _W, None, -1, 8), ValueError, ["n must be in"]),
    ("x narrower than k", (_X[:, :5], _W, None, 6, 6), ValueError, ["k must be <= x.size(-1)=5"]),
    ("integer dtype", (_X.long(), _W.long(), None, 6, 8), TypeError, ["x must be", "int64"]),
    ("dtype mismatch", (_X, _W.double(), None, 6, 8), TypeError, ["weight dtype", "differs"]),
    ("bias dtype", (_X, _W, _B.double(), 6, 8), TypeError, ["bias dtype"]),
    ("device mismatch", (_X, _W.to("meta"), None, 6, 8), ValueError, ["weight is on meta"]),
    ("bias device", (_X, _W, _B.to("meta"), 6, 8), ValueError, ["bias is on meta"]),
    ("weight 1-D", (_X, _B, None, 6, 6), ValueError, ["weight must be 2-D"]),
    (
        "bias shape",
        (_X, _W, _B[:4], 4, 8),
        ValueError,
        ["bias must be 1-D of size weight.size(0)=6"],
    ),
    ("0-d x", (_X.sum(), _W, None, 6, 0), ValueError, ["x must have at least 1 dimension"]),
]


@pytest.mark.parametrize("entry", ["wrapper", "torch.ops"])
@pytest.mark.parametrize("case", LINEAR_BAD, ids=[c[0] for c in LINEAR_BAD])
def test_prefix_linear_bad_inputs(case, entry: str) -> None:
    _, args, exc_type, words = case
    call = ops.prefix_linear if entry == "wrapper" else LINEAR
    with pytest.raises(exc_type) as info:
        call(*args)
    for word in words:
        assert word in str(info.value)


_P = torch.tensor([3, 0, 5, 1, 2, 4])
MANY_BAD = [
    (
        "dims length",
        ([_W, _B], _P, 2, [0]),
        ValueError,
        ["dims must have one entry per tensor (2 tensors)"],
    ),
    (
        "perm beyond one tensor",
        ([_W, _W[:4]], _P, 3, [0, 0]),
        ValueError,
        ["perm[:k]", "tensors[1].size(dims[1])=4"],
    ),
    ("dim out of range", ([_W, _B], _P, 2, [0, 1]), ValueError, ["dims[1] must be in [-1, 0]"]),
    ("tensor device", ([_W, _B.to("meta")], _P, 2, [0, 0]), ValueError, ["tensors[1] is on meta"]),
    ("perm dtype", ([_W], _P.int(), 2, [0]), TypeError, ["perm must be an int64"]),
    ("k too big", ([_W], _P, 7, [0]), ValueError, ["k must be in [0, len(perm)=6]"]),
    (
        "0-d tensor",
        ([_W, _B.sum()], _P, 2, [0, 0]),
        ValueError,
        ["tensors[1] must have at least 1 dimension"],
    ),
]


@pytest.mark.parametrize("entry", ["wrapper", "torch.ops"])
@pytest.mark.parametrize("case", MANY_BAD, ids=[c[0] for c in MANY_BAD])
def test_ordered_gather_many_bad_inputs(case, entry: str) -> None:
    _, args, exc_type, words = case
    call = ops.ordered_gather_many if entry == "wrapper" else MANY
    with pytest.raises(exc_type) as info:
        call(*args)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("call", "exc_type", "words"),
    [
        (lambda: ops.ordered_gather_many(_W, _P, 2, [0]), TypeError, ["tensors must be a list"]),
        (
            lambda: ops.ordered_gather_many([_W, "w"], _P, 2, [0, 0]),
            TypeError,
            ["tensors[1] must be a torch.Tensor"],
        ),
        (
            lambda: ops.ordered_gather_many([_W], _P, 2, [0.0]),
            TypeError,
            ["dims[0] must be an int"],
        ),
        (lambda: ops.prefix_linear(_X, _W, None, 6.0, 8), TypeError, ["n must be an int"]),
        (
            lambda: ops.prefix_linear(_X, _W, [1.0], 6, 8),
            TypeError,
            ["bias must be a torch.Tensor or None"],
        ),
        (
            lambda: ops.fp8_prefix_linear(_X, _W, 6, 8, "block"),
            ValueError,
            ["scaling must be one of"],
        ),
        (
            lambda: ops.fp8_prefix_linear(_X, _W, 6, 8, method="te"),
            ValueError,
            ["method must be one of"],
        ),
        (
            lambda: ops.fp8_prefix_linear(_X, _W, 6, 8, out_dtype=torch.int8),
            TypeError,
            ["out_dtype must be"],
        ),
        (
            lambda: ops.fp8_prefix_linear(_X, _W, 6, 9),
            ValueError,
            ["k must be in [0, weight.size(1)=8]"],
        ),
        (lambda: ops.fp8_prefix_linear(_X.int(), _W.int(), 6, 8), TypeError, ["x must be"]),
        (lambda: ops.quantize_e4m3(_X.long()), TypeError, ["t must be float16"]),
        (lambda: ops.quantize_e4m3(_X, "row", dim=2), ValueError, ["dim must be in [-2, 1]"]),
    ],
)
def test_wrapper_and_fp8_bad_inputs(call, exc_type, words) -> None:
    with pytest.raises(exc_type) as info:
        call()
    for word in words:
        assert word in str(info.value)


# --- backends ------------------------------------------------------------------------------


def test_kernels_registered_for_every_device() -> None:
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in ("elastic_plugin::prefix_linear", "elastic_plugin::ordered_gather_many"):
        assert has(name, "Meta") and has(name, "Autograd"), name  # fake rule, autograd
        for key in ("CPU", "CUDA"):  # compiled kernels, or the fallback's device-generic one
            assert has(name, key) or (
                ops.backend() == "pytorch" and has(name, "CompositeExplicitAutograd")
            ), key


@pytest.mark.integration
def test_fallback_backend_gives_same_results(_fallback_child) -> None:
    proc, path = _fallback_child
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["info"]["backend"] == "pytorch" and ops.DISABLE_ENV in report["info"]["reason"]
    cases = torch.load(path)
    for label in ("col", "row"):
        x, w, b, n, k, y = cases[label]
        torch.testing.assert_close(
            y.double(), _expected_linear(x, w, b, n, k), rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(ops.prefix_linear(x, w, b, n, k), y)  # this process agrees
    tensors, perm, k, dims, outs = cases["many"]
    for out, t, d in zip(outs, tensors, dims):
        assert torch.equal(out, t.index_select(d, perm[:k]))
    errors = report["errors"]
    assert (
        errors["k"].startswith("ValueError")
        and "k must be in [0, weight.size(1)=16]" in errors["k"]
    )
    assert errors["dtype"].startswith("TypeError") and "x must be" in errors["dtype"]
    assert errors["many_perm"].startswith("ValueError") and "tensors[1]" in errors["many_perm"]
    assert report["checks"]["gradcheck"] is True
    for key in ("opcheck_linear", "opcheck_many"):
        assert set(report["checks"][key].values()) == {"SUCCESS"}, report["checks"][key]


# --- CUDA (skipped without a GPU) ------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_prefix_linear_and_gather_many(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(16)
    x = torch.randn(4, 33, 256, generator=gen).to(dtype).cuda()
    w = torch.randn(192, 256, generator=gen).to(dtype).cuda()
    b = torch.randn(192, generator=gen).to(dtype).cuda()
    for n, k in ((100, 256), (192, 130), (64, 64)):
        y = ops.prefix_linear(x, w, b, n, k)
        assert y.device == x.device
        assert relative_error(y.cpu(), _expected_linear(x.cpu(), w.cpu(), b.cpu(), n, k)) < 1e-2
    perm = torch.randperm(192, generator=gen).cuda()
    outs = ops.ordered_gather_many([w, b, w.t()], perm, 150, [0, 0, 1])
    for out, t, d in zip(outs, [w, b, w.t()], [0, 0, 1]):
        assert torch.equal(out, t.index_select(d, perm[:150]))
    with pytest.raises(ValueError, match="perm is on cpu|tensors\\[0\\] is on"):
        ops.ordered_gather_many([w], perm.cpu(), 3, [0])


@needs_cuda
@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_cuda_fp8_matches_cpu_emulation(scaling: str) -> None:
    gen = torch.Generator().manual_seed(17)
    x = torch.randn(64, 256, generator=gen)
    w = torch.randn(128, 256, generator=gen)
    emu = ops.fp8_prefix_linear(x, w, 96, 160, scaling, out_dtype=torch.bfloat16, method="emulate")
    gpu = ops.fp8_prefix_linear(x.cuda(), w.cuda(), 96, 160, scaling, out_dtype=torch.bfloat16)
    assert relative_error(gpu.cpu(), emu) < 1e-2


# --- the benchmark (plumbing only, tiny sizes) ----------------------------------------------


def test_bench_masked_gemm_runs_tiny() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import bench_masked_gemm
    finally:
        sys.path.remove(str(REPO / "bench"))
    rows = bench_masked_gemm.run(reps=1, tokens=8, width=64)
    names = [r["name"] for r in rows]
    assert any("gemm" in name for name in names) and any("gather_many" in name for name in names)
    for row in rows:
        ratios = [v for key, v in row.items() if "/" in key]
        assert ratios and all(v > 0 for v in ratios), row


def test_quantize_e4m3_never_divides_by_a_zero_scale() -> None:
    """An amax so small that amax / 448 underflows (a nearly all-zero row) gets scale 1, like
    an all-zero one, not a division by zero."""
    from elastic_plugin.ops import quantize_e4m3

    t = torch.tensor([[1e-44, 0.0], [0.0, 0.0], [0.5, -1.0]])
    for scaling in ("tensor", "row"):
        fp8, scales = quantize_e4m3(t[:2] if scaling == "tensor" else t, scaling)
        assert torch.isfinite(fp8.float()).all() and (scales > 0).all(), (scaling, scales)
    _, scales = quantize_e4m3(t, "row")
    assert scales.flatten().tolist() == [1.0, 1.0, pytest.approx(1.0 / 448)]
