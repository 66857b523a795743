"""Where a CUDA graph's adapter groups live in its static int32 input buffer.

Grouping tokens by adapter needs a host sync on the device, so the decode and step graphs
group on the host (``group_tokens_host``) and stage the result with their other inputs. The
layout: the per-token adapter slots and the token order sorted by adapter (one entry per row
each), then the groups' start, size and adapter (``max_groups`` entries each), and apart from
them the expands' row tiles (``row_tile_room`` entries at ``row_tiles_at``). A graph of
``rows`` rows reads views of the buffer; staging writes its pinned host twin.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from detlora.ops.adapter_groups import (
    AdapterGroups,
    group_tokens_array,
    group_tokens_host,
    max_row_tiles,
    row_tile_table_host,
)
from detlora.ops.lora_configs import expand_block_m


@dataclass(frozen=True)
class AdapterGroupLayout:
    token_adapter_at: int
    sorted_rows_at: int
    groups_at: int  # group_start, then group_size, then group_adapter
    max_groups: int
    num_adapters: int  # adapter slots
    row_tiles_at: int  # row_tile_room(max rows, num_adapters) entries

    def views(self, i32: torch.Tensor, rows: int, groups: int | None = None) -> AdapterGroups:
        """The groups of a ``rows``-row graph, as views of the device buffer ``i32``; with
        ``groups``, only the first that many (staging puts the groups with rows first, so
        such a graph serves the steps whose rows use no more groups)."""
        g, lo, gmax = min(rows, self.num_adapters + 1), self.groups_at, self.max_groups
        if groups is not None:
            g = min(g, groups)
        bm = expand_block_m(rows)
        tiles = self.row_tiles_at
        return AdapterGroups(
            token_adapter=i32[self.token_adapter_at: self.token_adapter_at + rows],
            sorted_rows=i32[self.sorted_rows_at: self.sorted_rows_at + rows],
            group_start=i32[lo: lo + g],
            group_size=i32[lo + gmax: lo + gmax + g],
            group_adapter=i32[lo + 2 * gmax: lo + 2 * gmax + g],
            num_adapters=self.num_adapters,
            row_tiles=i32[tiles: tiles + max_row_tiles(rows, bm, g)],
            row_block=bm,
        )

    def stage(self, h32: np.ndarray, token_adapter: list[int] | np.ndarray) -> int:
        """Write the groups of ``token_adapter`` (one slot per row, -1: none, padding
        included; a list, or an int array for thousands of rows) into the host twin
        ``h32``; returns how many groups have rows."""
        if isinstance(token_adapter, np.ndarray):
            rows, start, size, adapter = group_tokens_array(token_adapter, self.num_adapters)
        else:
            rows, start, size, adapter = group_tokens_host(token_adapter, self.num_adapters)
        n = len(token_adapter)
        h32[self.token_adapter_at: self.token_adapter_at + n] = token_adapter
        h32[self.sorted_rows_at: self.sorted_rows_at + n] = rows
        for i, values in enumerate((start, size, adapter)):
            lo = self.groups_at + i * self.max_groups
            h32[lo: lo + len(values)] = values
        tiles = row_tile_table_host(size, n, expand_block_m(n))
        h32[self.row_tiles_at: self.row_tiles_at + len(tiles)] = tiles
        return len(size) - size.count(0)


__all__ = ["AdapterGroupLayout"]
