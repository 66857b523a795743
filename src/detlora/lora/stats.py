"""Counters of adapter traffic: slot and host-cache hits and misses, reads, swaps and their time.

Plain monotonic counters that the engine keeps and a server exports (e.g. on /metrics); they
never decide anything, so they may differ between runs whose outputs are the same bits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class LoRAStats:
    slot_hits: int = 0  # a step needed an adapter that was already in a GPU slot
    slot_misses: int = 0  # a step needed an adapter that had to be copied into a slot
    host_hits: int = 0  # a slot copy found its adapter in the host cache
    host_misses: int = 0  # a slot copy had to wait for its adapter to be read from disk
    disk_loads: int = 0  # adapters read, checked and converted (needed now or prefetched)
    disk_seconds: float = 0.0  # wall time of those reads, summed over the reading threads
    swaps: int = 0  # adapters copied into a GPU slot (for a step, or ahead of one)
    prefetch_swaps: int = 0  # of those, copied ahead of the step that needs them
    swap_seconds: float = 0.0  # host time of starting slot copies, waits for disk included
    slot_evictions: int = 0  # adapters whose GPU slot was given to another one
    host_evictions: int = 0  # adapters dropped from the host cache to make room

    def as_dict(self) -> dict[str, int | float]:
        """The counters by name (every field a number: no deep copy needed; a server's engine
        loop reports them every iteration)."""
        return {name: getattr(self, name) for name in _FIELDS}


_FIELDS = tuple(f.name for f in dataclasses.fields(LoRAStats))
