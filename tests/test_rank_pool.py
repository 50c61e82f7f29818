"""The test rank pool itself: a rank that fails while joining the world is reported with its
traceback (CI once saw only "ranks [0] died"), and the ranks join through a store the pool
serves, so no port is picked and then lost to another process."""

from __future__ import annotations

import pytest

from tests.support.multirank import MultiRankError, RankPool
from tests.support.rendezvous import client_env, serve_store


@pytest.mark.integration
def test_a_start_up_failure_names_the_rank_and_its_error() -> None:
    with pytest.raises(MultiRankError) as failure:
        RankPool(2, start_timeout=120, env={"ELASTIC_PLUGIN_THREADS_PER_RANK": "many"})
    message = str(failure.value)
    assert "start-up failed on ranks [0, 1]" in message
    assert "invalid literal for int() with base 10: 'many'" in message


def test_ranks_join_the_served_store_as_clients() -> None:
    store = serve_store(timeout_s=5)
    env = client_env(store, 1, 2)
    assert env["MASTER_PORT"] == str(store.port) and store.port > 0
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # rank 0 must not bind the port itself
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("1", "2", "1")
