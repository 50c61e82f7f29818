"""The extension's build facts, read from the library (ops/_binary.py), and the set-up scripts that
compile the CUDA ops everywhere and assert them (scripts/cuda_toolkit.py, scripts/check_extension.py).

`make install` runs the real assertion after every build; these tests keep its parts honest: the
fatbin reader against the architectures the build recorded, the CUDA kernel's registration
against its ``.cu`` file, the checker's verdicts on good and bad builds, and the toolkit search
on fake toolkits (a shell-script ``nvcc``).
"""

from __future__ import annotations

import importlib.util
import os
import stat
from pathlib import Path

import pytest
import torch

import elastic_plugin.ops as ops

REPO = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_extension = _load("check_extension")
cuda_toolkit = _load("cuda_toolkit")
INFO = ops.backend_info()
CUDA_BUILD = bool(INFO["cuda_kernels"]) and not os.environ.get(ops.DISABLE_ENV)


@pytest.mark.skipif(not CUDA_BUILD, reason="the extension was built without its CUDA part")
def test_the_library_holds_a_cubin_per_architecture_it_was_built_for() -> None:
    asked = INFO["cuda_arch_list"]
    assert asked, "no _C.CUDA_ARCHS: a library built before setup.py recorded it; make install"
    assert INFO["cuda_targets"] == ops.arch_targets(asked)
    assert ops.fatbin_targets(INFO["extension_path"]) == INFO["cuda_targets"]


@pytest.mark.skipif(not CUDA_BUILD, reason="the extension was built without its CUDA part")
def test_every_cuda_op_of_a_cu_file_is_registered_from_that_file() -> None:
    wanted = check_extension.cuda_ops_in_sources()
    assert wanted.get("ordered_gather") == "gather_cuda.cu"
    sources = {op: ops.kernel_sources(op, "CUDA") for op in wanted}
    assert check_extension.problems(INFO, INFO["cuda_targets"], sources, wanted) == []
    # the CPU kernel comes from a .cpp file, as the dispatcher records it
    assert [Path(p).name for p in ops.kernel_sources("ordered_gather", "CPU")] == ["gather_cpu.cpp"]


def test_a_library_without_cuda_code_has_no_targets_and_a_non_elf_file_is_refused(tmp_path) -> None:
    torch_lib = Path(torch.__file__).parent / "lib" / "libshm.so"
    assert ops.fatbin_targets(torch_lib) == []
    text = tmp_path / "not_elf.so"
    text.write_text("hello")
    with pytest.raises(ValueError, match="ELF64"):
        ops.fatbin_targets(text)


def test_arch_lists_map_to_cubins_and_ptx() -> None:
    assert ops.arch_targets("8.0;9.0;10.0") == ["sm_80", "sm_90", "sm_100"]
    assert ops.arch_targets("9.0a, 10.0+PTX") == ["sm_90", "compute_100", "sm_100"]
    with pytest.raises(ValueError, match="sm_90"):
        ops.arch_targets("sm_90")


def _built(targets: list[str], backend: str = "cpp+cuda") -> dict:
    return {
        "backend": backend,
        "reason": "test",
        "cuda_kernels": backend == "cpp+cuda",
        "cuda_targets": targets,
    }


def test_the_checker_names_each_way_a_build_falls_short() -> None:
    wanted = {"ordered_gather": "gather_cuda.cu"}
    good_sources = {"ordered_gather": ["/x/csrc/gather_cuda.cu"]}
    expected = ["sm_80", "sm_90", "sm_100"]
    problems = check_extension.problems
    assert problems(_built(expected), expected, good_sources, wanted) == []
    missing = problems(_built(["sm_80", "sm_90"]), expected, good_sources, wanted)
    assert len(missing) == 1 and "sm_100" in missing[0]
    cpu_only = problems(_built([], "cpp"), expected, {"ordered_gather": ["/x/_gather.py"]}, wanted)
    assert any("'cpp'" in p for p in cpu_only)
    assert any("_gather.py" in p and "gather_cuda.cu" in p for p in cpu_only)
    assert problems(_built([], "pytorch"), expected, {}, wanted)[0].startswith(
        "the extension is not"
    )
    # a C++-only build asked for (ELASTIC_PLUGIN_SKIP_CUDA=1) passes only without CUDA kernels
    assert problems(_built([], "cpp"), None, {}, wanted) == []
    assert problems(_built(expected), None, good_sources, wanted)


def _fake_toolkit(root: Path, release: str) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime.h").write_text("")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    return root


def test_the_toolkit_search_takes_only_torchs_cuda_major_version(tmp_path, monkeypatch) -> None:
    old = _fake_toolkit(tmp_path / "cuda12", "12.4")
    new = _fake_toolkit(tmp_path / "cuda13", "13.0")
    monkeypatch.setattr(cuda_toolkit, "system_candidates", lambda: [str(old), str(new)])
    assert cuda_toolkit.find_system_toolkit("13.0") == (str(new), f"nvcc 13.0 in {new}")
    monkeypatch.setattr(cuda_toolkit, "system_candidates", lambda: [str(old)])
    root, note = cuda_toolkit.find_system_toolkit("13.0")
    assert root is None and "cuda12 (CUDA 12.4)" in note


def test_the_compiler_pins_are_torchs_cuda(tmp_path) -> None:
    pins = cuda_toolkit.pinned()
    assert set(pins) == {
        "nvidia-cuda-nvcc",
        "nvidia-cuda-crt",
        "nvidia-nvvm",
        "nvidia-cuda-cccl",
    }
    if torch.version.cuda is not None:
        cuda_toolkit.check_pins(pins, torch.version.cuda)  # the repository's pins fit its torch
    with pytest.raises(SystemExit, match="pin the wheels of CUDA 12.8"):
        cuda_toolkit.check_pins(pins, "12.8")
    loose = tmp_path / "requirements-cuda.txt"
    loose.write_text("nvidia-cuda-nvcc\n")
    with pytest.raises(SystemExit, match="not pinned"):
        cuda_toolkit.pinned(loose)
