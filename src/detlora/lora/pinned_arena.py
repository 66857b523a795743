"""Host memory for adapter images, carved out of a few large (pinned, on CUDA) chunks.

PyTorch's pinned-memory allocator rounds every allocation up to a power of two, which would
waste up to half of a host cache of adapters of assorted sizes. The arena asks it for chunks
whose size is a power of two already (no rounding) and hands out aligned byte ranges of them,
first fit, merging freed neighbours. A chunk that becomes empty is returned. Not thread-safe:
the caller holds its own lock.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 512  # bytes: every block starts on this boundary (any dtype, and DMA-friendly)
MIN_CHUNK = 256 << 20


@dataclass(frozen=True)
class ArenaBlock:
    chunk: int  # chunk id
    offset: int  # bytes into the chunk
    nbytes: int  # size reserved (aligned)
    data: torch.Tensor  # uint8 [nbytes] view of the chunk


class PinnedArena:
    def __init__(self, *, pin: bool, min_chunk_bytes: int = MIN_CHUNK) -> None:
        self.pin = pin
        self.min_chunk_bytes = min_chunk_bytes
        self._chunks: dict[int, torch.Tensor] = {}
        self._free: dict[int, list[tuple[int, int]]] = {}  # chunk -> sorted (offset, size)
        self._used: dict[int, int] = {}  # chunk -> bytes reserved
        self._next_id = 0

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the chunks held (what the arena costs the host)."""
        return sum(c.numel() for c in self._chunks.values())

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def alloc(self, nbytes: int) -> ArenaBlock:
        """A block of at least ``nbytes`` bytes (contents undefined)."""
        if nbytes < 1:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        size = -(-nbytes // ALIGN) * ALIGN
        for cid, extents in self._free.items():
            for k, (off, ext) in enumerate(extents):
                if ext >= size:
                    if ext == size:
                        del extents[k]
                    else:
                        extents[k] = (off + size, ext - size)
                    return self._block(cid, off, size)
        cid = self._new_chunk(size)
        off, ext = self._free[cid][0]
        self._free[cid][0] = (off + size, ext - size)
        if ext == size:
            del self._free[cid][0]
        return self._block(cid, off, size)

    def free(self, block: ArenaBlock) -> None:
        """Give a block back; the caller makes sure no copy still reads it."""
        extents = self._free[block.chunk]
        extents.append((block.offset, block.nbytes))
        extents.sort()
        merged: list[tuple[int, int]] = []
        for off, ext in extents:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + ext)
            else:
                merged.append((off, ext))
        self._free[block.chunk] = merged
        self._used[block.chunk] -= block.nbytes
        if self._used[block.chunk] == 0:
            del self._chunks[block.chunk], self._free[block.chunk], self._used[block.chunk]

    def _new_chunk(self, size: int) -> int:
        nbytes = max(self.min_chunk_bytes, 1 << (size - 1).bit_length())
        chunk = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        cid = self._next_id
        self._next_id += 1
        self._chunks[cid] = chunk
        self._free[cid] = [(0, nbytes)]
        self._used[cid] = 0
        return cid

    def _block(self, cid: int, off: int, size: int) -> ArenaBlock:
        self._used[cid] += size
        return ArenaBlock(cid, off, size, self._chunks[cid][off: off + size])
