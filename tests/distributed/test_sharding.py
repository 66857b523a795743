"""How layers are cut over tensor-parallel ranks, and the group's collectives (gloo, threads)."""

import pytest
import torch
from tests.helpers.tp_threads import run_ranks

from detlora.distributed.sharding import (
    check_shardable,
    check_size,
    even_shard,
    kv_head_shard,
    vocab_shard_rows,
)


def test_sizes_are_powers_of_two_up_to_eight():
    assert [check_size(s) for s in (1, 2, 4, 8)] == [1, 2, 4, 8]
    for bad in (0, 3, 6, 16, 2.0, True, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size must be one of"):
            check_size(bad)


def test_heads_split_evenly_and_kv_heads_replicate_past_their_count():
    assert [even_shard(32, r, 4) for r in range(4)] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert [kv_head_shard(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # 2 KV heads over 8 ranks: ranks 0-3 read head 0, ranks 4-7 head 1 (4 query heads each
    # of 32 split 8 ways: rank r's heads 4r..4r+3 belong to KV head (4r) // 16 = r // 4).
    assert [kv_head_shard(2, r, 8) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    with pytest.raises(ValueError, match="replicated evenly"):
        kv_head_shard(3, 0, 4)


def test_vocabulary_shards_are_aligned_and_cover_it():
    assert vocab_shard_rows(128256, 1) == 128256
    assert vocab_shard_rows(128256, 8) == 16032
    rows = vocab_shard_rows(151937, 4)
    assert rows % 16 == 0 and 4 * rows >= 151937 > 3 * rows


def test_unshardable_models_are_refused_naming_the_dimension():
    check_shardable(num_heads=32, num_kv_heads=8, intermediate_size=14336, size=8)
    with pytest.raises(ValueError, match=r"num_attention_heads=12 does not split.*"
                       r"intermediate_size \(down_proj's K\) = 100.*"
                       r"Sizes that keep them: 1, 2, 4$"):
        check_shardable(num_heads=12, num_kv_heads=4, intermediate_size=100, size=8)


def test_group_collectives_move_bits_in_rank_order():
    def collectives(group):
        x = torch.full((2, 3), float(group.rank)) + torch.tensor([0.1, 0.2, 0.3])
        gathered = group.all_gather(x)
        summed = group.all_reduce(torch.tensor([group.rank + 1.0]))
        sent = group.broadcast(torch.tensor([10.0 * (group.rank + 1)]), src=1)
        return gathered, summed, sent

    for gathered, summed, sent in run_ranks(4, collectives):
        assert gathered.shape == (4, 2, 3)
        want = torch.arange(4.0)[:, None, None] + torch.tensor([0.1, 0.2, 0.3])
        assert torch.equal(gathered, want.expand(4, 2, 3))
        assert summed.item() == 10.0 and sent.item() == 20.0
