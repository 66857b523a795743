"""The pages of one KV group: a FIFO free list, reference counts and the content-key cache
(``BlockManager``'s bookkeeping, for ``GroupedBlockManager``'s groups).

Pages are handed out from the front of the free list and go back to its end, so page numbers
depend only on the order of allocations and frees. A page nobody references keeps its content
key while it waits in the free list and loses it only when it is handed out again (the least
recently freed cached page is evicted first).
"""

from __future__ import annotations

from collections import OrderedDict


class PagePool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # A FIFO queue that also drops a revived page in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_count = [0] * num_blocks
        self._cached: dict[bytes, int] = {}  # content key -> page
        self._key_of: dict[int, bytes] = {}  # page -> its content key, for registered pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """A fresh page (reference count 1); a cached one loses its key."""
        block, _ = self._free.popitem(last=False)
        key = self._key_of.pop(block, None)
        if key is not None:  # evict: the page's old K/V are about to be overwritten
            del self._cached[key]
        self._ref_count[block] = 1
        return block

    def release(self, block: int) -> None:
        """Drop one reference; a page nobody references goes back to the free list."""
        count = self._ref_count[block]
        if count < 1:
            raise RuntimeError(f"KV block {block} freed more often than it was allocated")
        self._ref_count[block] = count - 1
        if count == 1:
            self._free[block] = None

    def hold(self, block: int) -> None:
        """One more reference to a cached page (revived from the free list if unused)."""
        if self._ref_count[block] == 0:
            del self._free[block]
        self._ref_count[block] += 1

    def ref_count(self, block: int) -> int:
        return self._ref_count[block]

    def lookup(self, key: bytes) -> int | None:
        return self._cached.get(key)

    def register(self, block: int, key: bytes) -> None:
        """Cache ``block`` under ``key`` unless the key or the page is cached already."""
        if key not in self._cached and block not in self._key_of:
            self._cached[key] = block
            self._key_of[block] = key

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def reset_cache(self) -> None:
        self._cached.clear()
        self._key_of.clear()
