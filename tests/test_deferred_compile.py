"""compat/deferred_compile.py: Megatron-Core's ``torch.compile`` decorations compile on first
call, with the decorator's options, and torch's own ``torch.compile`` is back after the import;
a process that imports the plugin then Megatron-Core imports no compiler until a fused function
runs, and on CPU (``enable_cpu_megatron``) the fused functions run uncompiled."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from elastic_plugin.compat import deferred_compile
from elastic_plugin.compat.deferred_compile import DeferCompileFinder

_MODULE = """
import torch

@torch.compile
def plain(x):
    return x * 2 + 1

@torch.compile(dynamic=False, backend="eager")
def with_options(x):
    return x - 3

module = torch.compile(torch.nn.Identity())
"""


@pytest.fixture
def probe_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A package ``defer_probe`` whose module decorates with ``torch.compile``, its imports
    hooked, and a stand-in for torch's compile that records what it was asked to compile."""
    (tmp_path / "defer_probe").mkdir()
    (tmp_path / "defer_probe" / "__init__.py").write_text("")
    (tmp_path / "defer_probe" / "kernels.py").write_text(textwrap.dedent(_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    compiled: list[tuple[object, dict]] = []

    def recording_compile(model=None, **options):
        compiled.append((model, options))
        return model

    monkeypatch.setattr(deferred_compile, "_real_compile", recording_compile)
    monkeypatch.setattr(deferred_compile, "_eager", False)  # as before the CPU patches
    finder = DeferCompileFinder("defer_probe.")
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    yield compiled
    sys.modules.pop("defer_probe.kernels", None)
    sys.modules.pop("defer_probe", None)


def test_decorated_functions_compile_on_their_first_call_with_their_options(probe_package):
    torch_compile = torch.compile
    from defer_probe import kernels

    assert torch.compile is torch_compile  # restored after the import
    assert [type(m).__name__ for m, _ in probe_package] == ["Identity"]  # a module: at once
    x = torch.arange(4.0)
    assert torch.equal(kernels.plain(x), x * 2 + 1)
    assert torch.equal(kernels.plain(x), x * 2 + 1)
    assert torch.equal(kernels.with_options(x), x - 3)
    assert [(getattr(m, "__name__", ""), o) for m, o in probe_package[1:]] == [
        ("plain", {}),  # once, however often it is called
        ("with_options", {"dynamic": False, "backend": "eager"}),
    ]
    assert kernels.plain.__name__ == "plain" and kernels.plain.__wrapped__(x).equal(x * 2 + 1)


def test_run_eagerly_leaves_functions_uncompiled(probe_package):
    from defer_probe import kernels

    assert deferred_compile.run_eagerly() is False  # returns the previous setting
    x = torch.arange(4.0)
    assert torch.equal(kernels.plain(x), x * 2 + 1)
    assert [type(m).__name__ for m, _ in probe_package] == ["Identity"]  # nothing else compiled
    assert deferred_compile.run_eagerly(False) is True  # compiled again from the next call on
    assert torch.equal(kernels.plain(x), x * 2 + 1)
    assert [getattr(m, "__name__", "") for m, _ in probe_package[1:]] == ["plain"]


def test_modules_outside_the_prefix_are_not_touched(tmp_path, monkeypatch):
    (tmp_path / "other_probe.py").write_text("import torch\ncompile_seen = torch.compile\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", [DeferCompileFinder("defer_probe."), *sys.meta_path])
    import other_probe

    assert other_probe.compile_seen is torch.compile
    sys.modules.pop("other_probe", None)


def test_install_is_idempotent(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    deferred_compile.install("defer_probe.")
    deferred_compile.install("defer_probe.")
    hooks = [f for f in sys.meta_path if isinstance(f, DeferCompileFinder)]
    assert [f.prefix for f in hooks].count("defer_probe.") == 1


_GEGLU_PROBE = """
import json, sys, torch
if {cpu}:
    from elastic_plugin.compat import enable_cpu_megatron
    enable_cpu_megatron()
import elastic_plugin
import megatron.core.fusions.fused_bias_geglu as geglu
import elastic_plugin.elastic.train, elastic_plugin.models.builder
loaded = lambda: sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
before = loaded()
y = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
a, b = torch.chunk(y, 2, -1)
want = torch.nn.functional.gelu(a, approximate="tanh") * b
diff = (geglu.geglu(y) - want).abs().max().item()  # the first call: compiled here, or not on CPU
print(json.dumps({{"before": before, "after": loaded(), "diff": diff,
                  "deferred": hasattr(geglu.geglu, "__wrapped__")}}))
"""


@pytest.mark.integration
@pytest.mark.parametrize("cpu", [False, True], ids=["as-shipped", "cpu-patches"])
def test_the_training_stack_imports_no_compiler_and_a_fused_function_compiles_when_called(cpu):
    proc = subprocess.run(
        [sys.executable, "-c", _GEGLU_PROBE.format(cpu=cpu)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["before"] == [] and got["deferred"]
    # compiled (Inductor) on the first call; on CPU run as written, no compiler imported at all
    assert got["after"] == ([] if cpu else ["torch._dynamo", "torch._inductor"])
    assert got["diff"] < 1e-6
