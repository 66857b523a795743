"""The chunks a step touches on each sequence's fixed chunk grid (Mamba-2 layers).

A sequence's positions are cut into chunks of ``chunk_size`` at absolute multiples of it
(``detlora.ops.mamba_ssd``). A step that computes positions [start, end) of a sequence touches
chunks start // cs .. (end - 1) // cs; the plan lists them, host-built, for the scan kernels
and the torch reference alike. Plain torch (no Triton), so the model contract can import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ITEM_FIELDS = 7  # seq, slot, chunk, row0, off, n, rest (see ChunkPlan)


ROW_TILE = 16


def row_tile(chunk_size: int) -> int:
    """Rows of a chunk per tile of the scan kernels, aligned to the chunk's first row: 16
    for every chunk size, the smallest tensor-core tile, because a decode step computes the
    whole tile holding its one row (the same tile a prefill computes, for the same bits)."""
    del chunk_size
    return ROW_TILE


@dataclass(frozen=True)
class ChunkPlan:
    """Which chunks a step touches, built on the host from its sequences.

    ``items`` int32 [W, 7]: per (sequence, chunk), in sequence order then chunk order:
    (seq index, state slot, chunk index c, row0 = the step row of the chunk's row 0 (may be
    negative), off = first row computed now, n = rows computed after the step, rest = index
    into the scratch of later items, -1 for a sequence's first item). ``seq_items`` int32
    [B + 1]: sequence b's items are [seq_items[b], seq_items[b + 1]). ``first_tiles`` and
    ``rest_tiles`` int32 [*, 2]: (item, row tile) pairs holding rows computed now, for the
    first and the later items. ``pass_seqs`` int32: sequences whose state moves (a closed
    chunk or several items); ``open_items`` int32: each sequence's last item when it leaves
    rows in its open chunk. A plan may also list every sequence in both (a CUDA graph's,
    whose launches cannot change size): the kernels skip the ones with nothing to do, and a
    closed chunk's rows copied to the buffer are never read.
    """

    chunk_size: int
    items: torch.Tensor
    seq_items: torch.Tensor
    first_tiles: torch.Tensor
    rest_tiles: torch.Tensor
    pass_seqs: torch.Tensor
    open_items: torch.Tensor
    num_rest: int

    @property
    def num_items(self) -> int:
        return self.items.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_items.shape[0] - 1

    @classmethod
    def build(cls, query_start_loc: Sequence[int], seq_lens: Sequence[int],
              state_slots: Sequence[int], chunk_size: int,
              device: torch.device | str = "cpu") -> ChunkPlan:
        """The plan of a step whose sequence b computes rows [qsl[b], qsl[b+1]) at positions
        ending at ``seq_lens[b]`` (exclusive), with state slot ``state_slots[b]``."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        bm = row_tile(chunk_size)
        items: list[list[int]] = []
        seq_items = [0]
        first_tiles: list[list[int]] = []
        rest_tiles: list[list[int]] = []
        pass_seqs: list[int] = []
        open_items: list[int] = []
        rest = 0
        for b, slot in enumerate(state_slots):
            q = query_start_loc[b + 1] - query_start_loc[b]
            end = seq_lens[b]
            start = end - q
            if q < 1 or start < 0:
                raise ValueError(f"sequence {b} computes {q} rows ending at position {end}")
            c0, c1 = start // chunk_size, (end - 1) // chunk_size
            closes = False
            for c in range(c0, c1 + 1):
                base = c * chunk_size
                off, n = max(start - base, 0), min(end - base, chunk_size)
                w = len(items)
                items.append([b, slot, c, query_start_loc[b] + base - start, off, n,
                              -1 if c == c0 else rest])
                tiles = first_tiles if c == c0 else rest_tiles
                tiles.extend([w, t] for t in range(off // bm, (n - 1) // bm + 1))
                if c != c0:
                    rest += 1
                closes |= n == chunk_size
            seq_items.append(len(items))
            if closes or c1 > c0:
                pass_seqs.append(b)
            if items[-1][5] < chunk_size:
                open_items.append(len(items) - 1)

        def t(values: list, width: int | None = None) -> torch.Tensor:
            out = torch.tensor(values, dtype=torch.int32)
            if width is not None:
                out = out.reshape(-1, width)
            return out.to(device, non_blocking=True)

        return cls(chunk_size, t(items, ITEM_FIELDS), t(seq_items), t(first_tiles, 2),
                   t(rest_tiles, 2), t(pass_seqs), t(open_items), rest)


def decode_rows(positions: Sequence[int], state_slots: Sequence[int], chunk_size: int
                ) -> tuple[list[int], list[int]]:
    """A decode step's items and first tiles, flat (row b: one token at ``positions[b]``):
    what ``ChunkPlan.build`` gives such a step, in the fixed layout a decode graph stages."""
    items: list[int] = []
    tiles: list[int] = []
    bm = row_tile(chunk_size)
    for b, (pos, slot) in enumerate(zip(positions, state_slots, strict=True)):
        off = pos % chunk_size
        items += [b, slot, pos // chunk_size, b - off, off, off + 1, -1]
        tiles += [b, off // bm]
    return items, tiles


__all__ = ["ITEM_FIELDS", "ChunkPlan", "decode_rows", "row_tile"]
