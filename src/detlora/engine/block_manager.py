"""Paged KV cache bookkeeping: which pages (blocks) each sequence owns.

Pages are handed out from a FIFO free list, so the page numbers a run uses depend only on the
order of allocations and frees (attention reads pages through the block table, so page numbers
never change bits; the order just keeps runs easy to compare). Every page has a reference
count; today each page has one owner, and prefix caching will later share pages by raising it.
"""

from __future__ import annotations

from collections import deque

from detlora.engine.sequence import Sequence


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation needs more free pages than there are."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_count = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New pages ``seq`` needs so that its first ``num_tokens`` tokens have slots."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to cover ``num_tokens`` tokens (all or nothing)."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            raise OutOfBlocksError(
                f"sequence {seq.request_id} needs {need} more KV blocks, "
                f"only {len(self._free)} of {self.num_blocks} are free"
            )
        for _ in range(need):
            block = self._free.popleft()
            self._ref_count[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; pages nobody references go back to the free list."""
        for block in seq.block_table:
            count = self._ref_count[block]
            if count < 1:
                raise RuntimeError(f"KV block {block} freed more often than it was allocated")
            self._ref_count[block] = count - 1
            if count == 1:
                self._free.append(block)
        seq.block_table = []

    def ref_count(self, block: int) -> int:
        return self._ref_count[block]

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot (page * block_size + offset) of ``seq``'s token at ``position``."""
        return seq.block_table[position // self.block_size] * self.block_size + (
            position % self.block_size
        )
