"""Tensor-parallel ranks as threads of the test process, joined by a real gloo group.

``run_ranks(size, fn)`` calls ``fn(group)`` on ``size`` threads, one per rank of one
``TensorParallelGroup`` on the CPU, and returns their results in rank order (re-raising the
first failure). Layers and models then run their real collectives without spawning
processes, which keeps these tests cheap; the engine's worker processes have their own tests.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from detlora.distributed.group import TensorParallelGroup

T = TypeVar("T")


def run_ranks(size: int, fn: Callable[[TensorParallelGroup], T]) -> list[T]:
    if size == 1:
        return [fn(TensorParallelGroup.single("cpu"))]
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timeout, wait_for_workers=False)
    results: list = [None] * size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            client = store if rank == 0 else dist.TCPStore(
                "127.0.0.1", store.port, size, False, timeout=timeout)
            group = TensorParallelGroup.create(client, rank, size, "cpu", timeout=timeout)
            with torch.inference_mode():
                results[rank] = fn(group)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a rank thread did not finish")
    return results
