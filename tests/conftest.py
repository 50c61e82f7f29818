"""Shared fixtures: one cache of persistent gloo rank pools for the whole session, because
starting a rank (Python + Megatron imports) costs 5-10 s and most tests need only a case run."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_plugin.testing.multirank import PoolCache

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"


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
