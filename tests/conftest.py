"""Shared fixtures: one cache of persistent gloo rank pools for the whole session, because
starting a rank (Python + Megatron imports) costs 5-10 s and most tests need only a case run."""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.multirank import PoolCache

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
# The suite computes the same numbers on every machine: an automatic precision (training.bf16
# unset) is FP32 here even where the CPU has BF16 units (compat.host.fast_bf16); tests of the
# detection set their own value. Ranks and commands the tests start inherit it.
os.environ.setdefault("ELASTIC_PLUGIN_CPU_BF16", "0")


@pytest.fixture(scope="session")
def rank_pools():
    cache = PoolCache(max_ranks=4)
    yield cache
    cache.close()


@pytest.fixture(scope="session")
def tiny():
    """The built-in tiny model config (every layer kind)."""
    from elastic_plugin.models.config import load_config

    return load_config(CONFIGS / "tiny.yaml").model


@pytest.fixture(scope="session")
def nano():
    """Nemotron Nano v3's model config (for counting; never built)."""
    from elastic_plugin.models.config import load_config

    return load_config(CONFIGS / "nemotron_nano_v3.yaml").model


# ------------------------------------------------------------------ tiers
# The suite runs in two tiers (CONTRIBUTING.md, "Tests"): the unit tier is in-process, the
# integration tier starts processes (torchrun, rank pools, the CLI in a fresh interpreter).
# A test is in the integration tier when it is marked ``integration`` or uses ``rank_pools``.
# A unit-tier test that starts a Python process (itself or through a fixture it uses) fails, so
# the unit tier stays fast by construction.
_PROCESS_FIXTURES = {"rank_pools"}
_LAUNCHERS = ("python", "torchrun", "elastic-plugin")
_running: list[pytest.Item] = []


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


def _launches_python(args) -> bool:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args or ())
    if not argv or not argv[0]:
        return False
    first = os.fsdecode(argv[0])
    return os.path.basename(first.split()[0]).startswith(_LAUNCHERS) or first == sys.executable


_STDLIB = os.path.dirname(os.__file__)


def _launched_by_a_dependency() -> bool:
    """Whether the launch comes from an installed library (torch's Inductor compiles in worker
    processes, Megatron's checkpoint writer starts a queue manager): those are implementation
    details of in-process code, not a test starting a program."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name == __file__ or (name.startswith(_STDLIB) and "site-packages" not in name):
            frame = frame.f_back  # subprocess / multiprocessing themselves, or this guard
            continue
        return "site-packages" in name
    return False


def _refuse_in_unit_tier(what: str) -> None:
    item = _running[-1] if _running else None
    if (
        item is not None
        and item.get_closest_marker("integration") is None
        and not _launched_by_a_dependency()
    ):
        pytest.fail(
            f"{item.nodeid} starts {what} in the unit tier: mark it @pytest.mark.integration "
            "or run the code in-process",
            pytrace=False,
        )


def pytest_configure(config):
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def guarded_popen(self, args, *a, **kw):
        if _launches_python(args):
            _refuse_in_unit_tier(f"a process {args!r}")
        popen_init(self, args, *a, **kw)

    def guarded_start(self):
        # a forked worker (Megatron's checkpoint writers) shares this interpreter; a spawned
        # one starts Python afresh, as a rank pool does
        method = self._start_method or multiprocessing.get_start_method(allow_none=True) or "fork"
        if method != "fork":
            _refuse_in_unit_tier(f"a {method} multiprocessing worker")
        process_start(self)

    subprocess.Popen.__init__ = guarded_popen  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = guarded_start  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()
