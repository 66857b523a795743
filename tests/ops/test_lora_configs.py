"""What decides a shrink row's bits must not depend on the row count for ordered_bi."""

import pytest

from detlora.config import LoRAReduction
from detlora.ops.lora_configs import shrink_config, vllm_default_shrink_config

ROWS = (1, 2, 3, 7, 16, 64, 128, 257, 1024, 4096, 8192)


@pytest.mark.parametrize("hidden,n", [(2048, 16), (3072, 48), (4096, 192), (1000, 8)])
def test_ordered_bi_tree_is_fixed_per_hidden_size(hidden, n):
    trees = {(c.chunk_size(hidden), c.block_k, c.group_chunks)
             for c in (shrink_config("ordered_bi", m, hidden, n) for m in ROWS)}
    assert len(trees) == 1
    covers = {shrink_config("ordered_bi", m, hidden, n).cta_covers for m in ROWS}
    assert covers <= {"chunk", "group", "all"}


def test_ordered_varies_its_split_with_rows_but_atomic_is_vllms_default():
    splits = {shrink_config("ordered", m, 3072, 48).split_k for m in ROWS}
    assert len(splits) > 1
    assert vllm_default_shrink_config(1).split_k == 64
    assert vllm_default_shrink_config(128).split_k == 8
    # Trimmed to chunks that hold work: 3072 / 256-wide K blocks = 12 real chunks.
    assert shrink_config("atomic", 1, 3072, 16).split_k == 12


def test_unknown_reduction_is_a_clear_error():
    with pytest.raises(ValueError, match="reduction must be one of"):
        shrink_config("fastest", 1, 3072, 16)
    assert LoRAReduction.parse("tree") is LoRAReduction.TREE


def test_expand_tiles_narrow_at_decode_and_keep_block_r_per_rank():
    from detlora.ops.lora_configs import EXPAND_SMALL_TILE_ROWS, expand_config

    decode = expand_config(EXPAND_SMALL_TILE_ROWS, 16, 3072)
    prefill = expand_config(EXPAND_SMALL_TILE_ROWS + 1, 16, 3072)
    assert (decode.block_m, decode.block_n) == (16, 128)
    assert (prefill.block_m, prefill.block_n) == (64, 128)
    assert (expand_config(1, 16, 3072).block_m, expand_config(1, 16, 48).block_n) == (16, 64)
    short = expand_config(16, 16, 3072)  # up to 16 rows: narrower columns, more programs
    assert (short.block_m, short.block_n) == (16, 64)
    for rank in (1, 16, 24, 64, 128):  # the rank step: a function of the rank alone
        assert len({expand_config(m, rank, 3072).block_r for m in (1, 16, 64, 129, 4096)}) == 1
