"""Shared fixtures: one cache of persistent gloo rank pools for the whole session, because
starting a rank (Python + Megatron imports) costs 5-10 s and most tests need only a case run."""

from __future__ import annotations

import pytest

from elastic_plugin.testing.multirank import PoolCache


@pytest.fixture(scope="session")
def rank_pools():
    cache = PoolCache(max_ranks=4)
    yield cache
    cache.close()
