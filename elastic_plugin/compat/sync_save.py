"""A synchronous dist-checkpoint save collects its write results in this process.

Megatron-Core's ``FileSystemWriterAsync`` (the writer behind every ``torch_dist`` save, also a
synchronous one) hands each rank's write results to ``filesystem_async.get_write_results_queue()``:
a ``multiprocessing.Manager`` queue started with *spawn* at a process's first save, so that an
asynchronous save's writer process can report back. The fresh manager process has to import torch
to unpickle the first result: the first save of every process waits for it (measured: 3.1 s idle,
8-12 s while other ranks compete for the cores; later saves take 0.4 s). A synchronous save writes
in threads of the saving process, so an in-process ``queue.Queue`` carries the same results.
Asynchronous saves (Megatron-LM's ``--async-save``) keep Megatron's manager queue.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator


@contextlib.contextmanager
def in_process_write_results() -> Iterator[None]:
    """Within the block, synchronous saves pass write results through an in-process queue."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:  # another Megatron-Core layout: its own queue, as it is
        yield
        return
    if not hasattr(filesystem_async, "_results_queue"):
        yield
        return
    outer = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = outer
