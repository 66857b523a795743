"""Token-to-adapter grouping shared by the LoRA kernels.

Semantics:
    Given ``token_adapter`` ([M] ints, -1 = no adapter, else a slot in [0, num_adapters)), the
    rows are grouped by adapter id, stably:

        keys = token_adapter + 1                       # 0 = no adapter
        sorted_rows = torch.argsort(keys, stable=True)
        counts = torch.bincount(keys, minlength=num_adapters + 1)

    Groups with rows come first; the kernels launch ``num_groups = min(M, num_adapters + 1)``
    programs along their group axis, which always covers every non-empty group. Building the
    groups needs no host synchronisation (unless ``validate=True``), so it can run once per
    engine step and serve every layer, and it can be captured in a CUDA graph.

    With a group cap (``group_programs``, the shrink's), a kernel launches ``min(cap,
    num_groups)`` programs along that axis instead and program z takes groups z, z + cap, z + 2
    cap, ... up to the first group without rows (all later ones are empty too): the launch no
    longer grows with the adapter slots when few of them are in use, and every group is still
    taken by exactly one program.

    The expands launch along the batch's row tiles instead (``row_tile_programs``): group g
    with n_g rows takes ceil(n_g / BLOCK_M) row tiles, numbered in group order; there are at
    most ceil(M / BLOCK_M) + num_groups - 1 of them, and program t takes row tiles t, t + P,
    ... of the P launched. ``row_tiles`` lists them (built with the groups, for the expands'
    BLOCK_M): entry t is group * 65536 + the tile's index in its group, -1 past the last, so
    a program finds its tile with one load. Which program computes a tile never changes its
    bits.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from detlora.config import MAX_ADAPTER_SLOTS
from detlora.ops.checks import check_tensor
from detlora.ops.lora_configs import expand_block_m

ROW_TILE_GROUP = 1 << 16  # a row_tiles entry: group * ROW_TILE_GROUP + tile in the group


@dataclass(frozen=True)
class AdapterGroups:
    """Rows of a batch grouped by adapter slot; built by :func:`group_tokens`."""

    token_adapter: torch.Tensor  # int32 [M], -1 = no adapter
    sorted_rows: torch.Tensor  # int32 [M], row indices grouped by adapter (stable)
    group_start: torch.Tensor  # int32 [G], offset of each group in sorted_rows
    group_size: torch.Tensor  # int32 [G], rows in each group (0 = unused)
    group_adapter: torch.Tensor  # int32 [G], adapter slot of each group, -1 = none
    num_adapters: int  # adapter slots the ids index into
    row_tiles: torch.Tensor  # int32 [max_row_tiles(M, row_block, G)] (module docstring)
    row_block: int  # the row tile ``row_tiles`` counts in

    @property
    def num_rows(self) -> int:
        return self.token_adapter.shape[0]

    @property
    def num_groups(self) -> int:
        return self.group_size.shape[0]

    @property
    def device(self) -> torch.device:
        return self.token_adapter.device

    def row_tiles_for(self, block_m: int) -> torch.Tensor:
        """``row_tiles`` counted in ``block_m``-row tiles (built on the device where that is
        not ``row_block``: tests and experiments that choose their own tiles)."""
        if block_m == self.row_block:
            return self.row_tiles
        return row_tile_table(self.group_size, self.num_rows, block_m)


def group_tokens(
    token_adapter: torch.Tensor, num_adapters: int, *, validate: bool = True
) -> AdapterGroups:
    """Group rows by adapter id. ``validate`` checks the id range (one host sync)."""
    check_tensor(
        "token_adapter", token_adapter, ndim=1, dtypes=(torch.int32, torch.int64, torch.int16)
    )
    _check_num_adapters(num_adapters)
    m = token_adapter.shape[0]
    if m == 0:
        raise ValueError("token_adapter must have at least one row, got 0")
    if validate:
        lo, hi = int(token_adapter.min()), int(token_adapter.max())
        if lo < -1 or hi >= num_adapters:
            bad = lo if lo < -1 else hi
            raise ValueError(
                f"token_adapter holds adapter id {bad}, outside [-1, {num_adapters - 1}] "
                f"(-1 = no adapter, {num_adapters} adapter slots)"
            )
    keys = token_adapter.to(torch.int64) + 1
    counts = torch.bincount(keys, minlength=num_adapters + 1)[: num_adapters + 1]
    starts = torch.cumsum(counts, 0) - counts
    sorted_rows = torch.argsort(keys, stable=True).to(torch.int32)
    # Non-empty groups first (stable), then keep as many as can be non-empty.
    order = torch.argsort((counts == 0).to(torch.int8), stable=True)
    num_groups = min(m, num_adapters + 1)
    order = order[:num_groups]
    sizes = counts[order]
    return AdapterGroups(
        token_adapter=token_adapter.to(torch.int32).contiguous(),
        sorted_rows=sorted_rows.contiguous(),
        group_start=starts[order].to(torch.int32).contiguous(),
        group_size=sizes.to(torch.int32).contiguous(),
        group_adapter=(order - 1).to(torch.int32).contiguous(),
        num_adapters=num_adapters,
        row_tiles=row_tile_table(sizes, m, expand_block_m(m)),
        row_block=expand_block_m(m),
    )


def max_row_tiles(num_rows: int, block_m: int, num_groups: int) -> int:
    """The most row tiles ``num_groups`` groups of ``num_rows`` rows in all can take: every
    group but one adds at most one partial tile."""
    return -(-num_rows // block_m) + num_groups - 1


def row_tile_room(max_rows: int, num_adapters: int) -> int:
    """Entries that hold the row tiles of any batch of up to ``max_rows`` rows (row tiles of
    16 rows or more)."""
    return max_row_tiles(max_rows, 16, min(max_rows, num_adapters + 1))


def row_tile_table(group_size: torch.Tensor, num_rows: int, block_m: int) -> torch.Tensor:
    """int32 [max_row_tiles]: the row tiles of groups of ``group_size`` rows (module
    docstring), on ``group_size``'s device, without a host sync."""
    g = group_size.shape[0]
    tiles = (group_size.to(torch.int64) + block_m - 1) // block_m
    ends = torch.cumsum(tiles, 0)
    t = torch.arange(max_row_tiles(num_rows, block_m, g), device=group_size.device)
    group = torch.searchsorted(ends, t, right=True)  # groups that end at or before t
    first = (ends - tiles)[group.clamp(max=g - 1)]
    return torch.where(group < g, group * ROW_TILE_GROUP + t - first, -1).to(torch.int32)


def row_tile_table_host(group_size: Sequence[int], num_rows: int, block_m: int) -> list[int]:
    """:func:`row_tile_table` on host ints (the graphs stage it with the groups)."""
    # Groups with rows come first: the empty ones after them add no tile.
    out = [g * ROW_TILE_GROUP + i for g, n in enumerate(itertools.takewhile(bool, group_size))
           for i in range(-(-n // block_m))]
    return out + [-1] * (max_row_tiles(num_rows, block_m, len(group_size)) - len(out))


def group_programs(num_groups: int, group_cap: int | None) -> tuple[int, int]:
    """(programs along a kernel's group axis, its ``GROUP_CAP`` constexpr): one program per
    group and 0 (no loop) without a cap or where it does not bind (no more groups than the
    cap: the looping variant is slower there); else ``group_cap`` programs that loop."""
    check_cap(group_cap)
    if group_cap is None:
        return num_groups, 0
    if num_groups <= group_cap:
        return num_groups, 0
    return group_cap, group_cap


def row_tile_programs(num_rows: int, block_m: int, num_groups: int,
                      cap: int | None) -> tuple[int, bool]:
    """(programs along an expand's row-tile axis, whether they loop): one per row tile the
    batch can have, ceil(M / block_m) + num_groups - 1 (each group adds at most one partial
    tile), or with a cap at most ceil(M / block_m) + cap, looping over the rest."""
    check_cap(cap)
    tiles = -(-num_rows // block_m)
    most = tiles + num_groups - 1
    if cap is None:
        return most, False
    programs = min(most, tiles + cap)
    return programs, programs < most


def _check_num_adapters(num_adapters: int) -> None:
    if isinstance(num_adapters, bool) or not isinstance(num_adapters, int) or not (
            1 <= num_adapters <= MAX_ADAPTER_SLOTS):
        raise ValueError(f"num_adapters must be an int in [1, {MAX_ADAPTER_SLOTS}], got "
                         f"{num_adapters!r}")


def check_cap(cap: int | None) -> None:
    """A group cap is None or a positive int."""
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(f"group_cap must be None or a positive int, got {cap!r}")


# Above this many rows ``group_tokens_host`` counts and sorts with numpy.
HOST_NUMPY_ROWS = 256


def group_tokens_host(
    token_adapter: Sequence[int], num_adapters: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """:func:`group_tokens` on host ints, for inputs that start on the host (a decode step's
    adapter slots): (sorted_rows, group_start, group_size, group_adapter), the same values."""
    _check_num_adapters(num_adapters)
    if not token_adapter:
        raise ValueError("token_adapter must have at least one row, got 0")
    if len(token_adapter) > HOST_NUMPY_ROWS:  # a prefill step's thousands of rows: numpy
        rows, *groups = group_tokens_array(np.asarray(token_adapter, dtype=np.int64),
                                           num_adapters)
        return (rows.tolist(), *groups)  # type: ignore[return-value]
    lo, hi = min(token_adapter), max(token_adapter)
    if lo < -1 or hi >= num_adapters:
        _raise_bad_slot(token_adapter, num_adapters)
    # Per-step host work: C-level builtins over the rows and the slots.
    counts = [0] * (num_adapters + 1)
    for a in token_adapter:
        counts[a + 1] += 1
    sorted_rows = sorted(range(len(token_adapter)), key=token_adapter.__getitem__)  # stable
    return (sorted_rows, *_groups_of(counts, len(token_adapter), num_adapters))


def group_tokens_array(
    token_adapter: np.ndarray, num_adapters: int
) -> tuple[np.ndarray, list[int], list[int], list[int]]:
    """:func:`group_tokens_host` of a 1-D integer numpy array, its sorted rows an int64
    array: a step graph stages thousands of rows without converting them to Python ints
    (numpy's call costs ~us, a row ~ns)."""
    _check_num_adapters(num_adapters)
    n = token_adapter.shape[0]
    if n == 0:
        raise ValueError("token_adapter must have at least one row, got 0")
    if int(token_adapter.min()) < -1 or int(token_adapter.max()) >= num_adapters:
        _raise_bad_slot(token_adapter.tolist(), num_adapters)
    slots = token_adapter.astype(np.int64, copy=False)
    counts = np.bincount(slots + 1, minlength=num_adapters + 1).tolist()
    return (np.argsort(slots, kind="stable"), *_groups_of(counts, n, num_adapters))


def _raise_bad_slot(token_adapter: Sequence[int], num_adapters: int) -> None:
    bad = next(a for a in token_adapter if not -1 <= a < num_adapters)
    raise ValueError(
        f"token_adapter holds adapter id {bad}, outside [-1, {num_adapters - 1}] "
        f"(-1 = no adapter, {num_adapters} adapter slots)"
    )


def _groups_of(counts: list[int], num_rows: int,
               num_adapters: int) -> tuple[list[int], list[int], list[int]]:
    """(group_start, group_size, group_adapter) from the rows per slot (slot -1 first):
    groups with rows first, then empty ones up to min(rows, num_adapters + 1)."""
    starts = [end - c for end, c in zip(itertools.accumulate(counts), counts, strict=True)]
    used = [k for k, c in enumerate(counts) if c]
    order = used
    num_groups = min(num_rows, num_adapters + 1)
    if len(used) < num_groups:
        order = used + [k for k, c in enumerate(counts) if not c][: num_groups - len(used)]
    return ([starts[k] for k in order], [counts[k] for k in order],
            [k - 1 for k in order])
