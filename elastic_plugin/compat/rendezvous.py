"""A free local TCP port: where a one-machine gloo world (a 1-rank run, a test's rank pool, a
torchrun child) rendezvouses without colliding with another run on the same host."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
