"""Keeping the cyclic garbage collector off the objects alive now: for a block (a generate
call) or for good (the engine core process).

A full collection scans every object alive, and with torch, Triton and the engine loaded
the heap is large: collections that fall into a generate call pause it at random
(docs/decisions.md, "Many adapters: where a wave's time goes").
``gc.freeze`` moves every live object out of the collector's generations (they are still
freed by reference counting), ``gc.unfreeze`` moves them back: the collector then skips what
existed before the block and still finds the cycles made in it, and afterwards everything is
collectable again, as if nothing had happened.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """``gc.freeze()`` for the block, ``gc.unfreeze()`` after it; nothing when the heap is
    frozen already (by the caller, or in an engine core process, which freezes for good)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def freeze_heap_for_good() -> None:
    """Collect, then freeze every live object until the process ends: for a process that
    lives exactly as long as its engine (the engine core process, as vLLM's does)."""
    gc.collect()
    gc.freeze()
