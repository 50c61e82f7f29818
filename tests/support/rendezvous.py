"""A rendezvous store for ranks this test process starts itself.

Picking a "free" port and handing it to the ranks races with every other process on the host:
between the pick and rank 0's bind, another test's run can take it, and rank 0 dies at start-up
(CI saw exactly that). Here the store is bound first, on a port the OS assigns while binding,
and served from this process for as long as the ranks live; the ranks join as clients
(``TORCHELASTIC_USE_AGENT_STORE`` is how torchrun's own workers do it), so no port is ever
chosen and then bound by someone else. Launches through torchrun use ``--standalone`` for the
same reason.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

LOCALHOST = "127.0.0.1"


def serve_store(timeout_s: float = 600.0) -> dist.TCPStore:
    """A TCP store listening on a port the OS picked (``store.port``), served from this process."""
    return dist.TCPStore(
        LOCALHOST,
        0,
        None,
        True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def client_env(store: dist.TCPStore, rank: int, world_size: int) -> dict[str, str]:
    """The torchrun-style variables with which a rank's ``init_process_group("gloo")`` joins
    ``store`` as a client instead of binding the port itself."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": LOCALHOST,
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
