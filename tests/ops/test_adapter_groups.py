"""Token-to-adapter grouping: stable order, sizes, no host sync, range checks; the expands'
row tiles (each group's rows in tiles, numbered group by group, on the device and the host)."""

import numpy as np
import pytest
import torch

from detlora.ops.adapter_groups import (
    ROW_TILE_GROUP,
    group_tokens,
    group_tokens_array,
    group_tokens_host,
    max_row_tiles,
    row_tile_room,
    row_tile_table,
    row_tile_table_host,
)


def test_groups_rows_stably_by_adapter_with_nonempty_groups_first():
    ids = torch.tensor([2, -1, 0, 2, 0, -1, 2], dtype=torch.int32)
    g = group_tokens(ids, 4)
    assert g.num_groups == min(7, 4 + 1)
    sizes = g.group_size.tolist()
    adapters = g.group_adapter.tolist()
    seen = {a: sz for a, sz in zip(adapters, sizes, strict=True) if sz}
    assert seen == {-1: 2, 0: 2, 2: 3}
    assert all(sz > 0 for sz in sizes[:3]) and all(sz == 0 for sz in sizes[3:])
    for a, start, size in zip(adapters, g.group_start.tolist(), sizes, strict=True):
        rows = g.sorted_rows[start:start + size].tolist()
        assert rows == [i for i, v in enumerate(ids.tolist()) if v == a]  # stable


def test_group_axis_never_exceeds_rows():
    g = group_tokens(torch.tensor([3], dtype=torch.int32), 8)
    assert g.num_groups == 1 and g.group_adapter.tolist() == [3]


@pytest.mark.parametrize("bad,match", [(5, "adapter id 5, outside"), (-3, "adapter id -3")])
def test_out_of_range_ids_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        group_tokens(torch.tensor([0, bad], dtype=torch.int32), 4)


def test_other_bad_inputs_raise():
    with pytest.raises(ValueError, match="num_adapters must be an int in"):
        group_tokens(torch.tensor([0], dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="token_adapter must have 1 dimensions"):
        group_tokens(torch.zeros(2, 2, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="token_adapter must have dtype"):
        group_tokens(torch.zeros(2), 2)
    with pytest.raises(ValueError, match="at least one row"):
        group_tokens(torch.zeros(0, dtype=torch.int32), 2)


@pytest.mark.parametrize("ids,num_adapters", [
    ([2, -1, 0, 2, 0, -1, 2], 4), ([3], 8), ([-1, -1], 1), ([0, 1, 0, 1, -1], 2),
    ([1, 1, 1], 3), (list(range(-1, 7)) * 3, 7),
    # Past HOST_NUMPY_ROWS the host path counts and sorts with numpy: the same values.
    ([(k * 7) % 5 - 1 for k in range(600)], 4), ([2] * 300 + [-1] * 5, 3),
])
def test_host_grouping_gives_the_device_grouping(ids, num_adapters):
    g = group_tokens(torch.tensor(ids, dtype=torch.int32), num_adapters)
    host = group_tokens_host(ids, num_adapters)
    assert host == (g.sorted_rows.tolist(), g.group_start.tolist(), g.group_size.tolist(),
                    g.group_adapter.tolist())
    rows, *groups = group_tokens_array(np.asarray(ids, dtype=np.int64), num_adapters)
    assert (rows.tolist(), *groups) == host


def test_slot_counts_past_the_row_tile_packing_raise():
    from detlora.config import MAX_ADAPTER_SLOTS
    from detlora.engine_args import EngineArgs

    ids = torch.zeros(2, dtype=torch.int32)
    assert group_tokens(ids, MAX_ADAPTER_SLOTS).num_adapters == MAX_ADAPTER_SLOTS
    with pytest.raises(ValueError, match="num_adapters must be an int in"):
        group_tokens(ids, MAX_ADAPTER_SLOTS + 1)
    with pytest.raises(ValueError, match="num_adapters must be an int in"):
        group_tokens_host([0], MAX_ADAPTER_SLOTS + 1)
    with pytest.raises(ValueError, match="max_loras"):
        EngineArgs(model="m", max_loras=MAX_ADAPTER_SLOTS + 1)


def test_host_grouping_bad_inputs_raise():
    with pytest.raises(ValueError, match="adapter id 4, outside"):
        group_tokens_host([0, 4], 4)
    with pytest.raises(ValueError, match="adapter id -2, outside"):
        group_tokens_host([0] * 300 + [-2], 4)
    with pytest.raises(ValueError, match="adapter id 4, outside"):
        group_tokens_array(np.array([0, 4]), 4)
    with pytest.raises(ValueError, match="num_adapters must be an int in"):
        group_tokens_host([0], 0)
    with pytest.raises(ValueError, match="at least one row"):
        group_tokens_host([], 2)


def row_tiles_by_hand(sizes: list[int], block_m: int) -> list[tuple[int, int]]:
    return [(g, i) for g, n in enumerate(sizes) for i in range(-(-n // block_m))]


@pytest.mark.parametrize("ids,num_adapters", [
    ([2, -1, 0, 2, 0, -1, 2], 4), ([3], 8), ([0] * 64, 64), (list(range(64)), 64),
    ([i % 5 - 1 for i in range(40)], 6), ([0] * 17 + [1] * 16 + [2], 3),
])
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_row_tiles_number_each_groups_tiles_in_group_order(ids, num_adapters, block_m):
    g = group_tokens(torch.tensor(ids, dtype=torch.int32), num_adapters)
    sizes = g.group_size.tolist()
    want = row_tiles_by_hand(sizes, block_m)
    table = g.row_tiles_for(block_m).tolist()
    assert len(table) == max_row_tiles(len(ids), block_m, g.num_groups) >= len(want)
    assert [(e // ROW_TILE_GROUP, e % ROW_TILE_GROUP) for e in table[:len(want)]] == want
    assert all(e == -1 for e in table[len(want):])
    assert row_tile_table_host(sizes, len(ids), block_m) == table
    assert row_tile_table(g.group_size, len(ids), block_m).tolist() == table


def test_groups_carry_the_row_tiles_of_the_expands_row_block():
    for m, bm in ((1, 16), (64, 16), (300, 16), (2048, 16), (2049, 64), (4096, 64)):
        g = group_tokens(torch.zeros(m, dtype=torch.int32), 8)
        assert g.row_block == bm
        assert g.row_tiles.tolist()[: -(-m // bm)] == list(range(-(-m // bm)))


def test_row_tile_room_holds_every_smaller_batch():
    for slots in (1, 8, 64):
        room = row_tile_room(512, slots)
        for m in range(1, 513):
            g = group_tokens(torch.zeros(m, dtype=torch.int32), slots)
            assert g.row_tiles.shape[0] <= room
