"""The decode graphs' static inputs: what a step stages equals the eager ForwardBatch, padded.

Graph capture needs CUDA (tests/gpu replays the graphs); the staging runs anywhere.
"""

import dataclasses

import torch

from detlora.engine.runner.decode_graphs import NARROW_GROUPS, DecodeGraphs
from detlora.engine.runner.step_inputs import StepInputs
from detlora.ops.adapter_groups import group_tokens


def _step(tables: list[list[int]], adapters: list[int]) -> StepInputs:
    b = len(tables)
    seq_lens = [5 + 7 * i for i in range(b)]
    return StepInputs(
        input_ids=[100 + i for i in range(b)], positions=[s - 1 for s in seq_lens],
        slot_mapping=[t[-1] * 16 + (s - 1) % 16 for t, s in zip(tables, seq_lens, strict=True)],
        token_adapter=adapters, block_tables=tables, seq_lens=seq_lens,
        query_start_loc=list(range(b + 1)), logits_indices=list(range(b)),
    )


def _graphs(num_adapters: int | None) -> DecodeGraphs:
    return DecodeGraphs(lambda batch: batch.input_ids, device=torch.device("cpu"),
                        max_num_seqs=20, max_blocks_per_seq=9, max_model_len=36,
                        num_adapters=num_adapters)


def test_staged_inputs_are_the_step_padded_to_its_bucket():
    g = _graphs(num_adapters=3)
    # A wide step first, then a narrower one: stale table columns must not matter, and
    # every padded row must be a harmless one-token context with no adapter.
    g.stage(_step([[7, 8, 9, 1, 2, 3, 4]] * 9, [0] * 9), 16)
    step = _step([[3, 1], [5], [2, 6, 4], [9]], [2, -1, 2, 0])
    bucket = g.bucket_for(step.num_seqs)
    assert bucket == 4
    g.stage(step, 8)  # a larger bucket than needed: four padding rows
    assert g.input_ids[:8].tolist() == step.input_ids + [0] * 4
    assert g.positions[:8].tolist() == step.positions + [0] * 4
    assert g.slot_mapping[:8].tolist() == step.slot_mapping + [-1] * 4
    assert g.seq_lens[:8].tolist() == step.seq_lens + [1] * 4
    for i, row in enumerate(step.block_tables):
        assert g.block_tables[i, : len(row)].tolist() == row
    assert g.block_tables[4:8, 0].tolist() == [0] * 4
    views = g._batch(8).lora.groups
    ref = group_tokens(torch.tensor(step.token_adapter + [-1] * 4, dtype=torch.int32), 3)
    for name in ("token_adapter", "sorted_rows", "group_start", "group_size", "group_adapter"):
        assert torch.equal(getattr(views, name), getattr(ref, name)), name


def test_staging_without_lora_touches_no_groups():
    g = _graphs(num_adapters=None)
    step = _step([[1], [2, 3]], [-1, -1])
    g.stage(step, 2)
    assert g.input_ids[:2].tolist() == step.input_ids
    assert g.seq_lens[:2].tolist() == step.seq_lens


def test_fed_rows_read_the_tokens_the_previous_step_left_on_the_device():
    g = _graphs(num_adapters=None)
    g.set_feed(torch.tensor([50.0, 51.0, 52.0, 53.0], dtype=torch.float64))  # greedy head ids
    # Row 0 takes the previous step's row 2, row 2 its row 0; row 1 has its id on the host.
    step = dataclasses.replace(_step([[1], [2], [3]], [-1] * 3), input_ids=[-3, 7, -1])
    g.stage(step, 4)
    assert g._batch(4).input_ids.tolist() == [52, 7, 50, 0]
    g.stage(_step([[1], [2]], [-1] * 2), 2)  # an ordinary step: no row is fed
    assert g._batch(2).input_ids.tolist() == [100, 101]


def test_many_slots_add_a_narrow_graph_per_bucket_that_holds_more_groups():
    assert all(groups is None for _, groups in _graphs(num_adapters=8).graph_keys())
    g = _graphs(num_adapters=16)
    keys = g.graph_keys()
    assert [b for b, groups in keys if groups is None] == g.buckets
    assert [b for b, groups in keys if groups == NARROW_GROUPS] == [b for b in g.buckets
                                                                    if b > NARROW_GROUPS]


def test_a_step_on_few_adapters_replays_the_narrow_graph_with_its_groups_first():
    g = _graphs(num_adapters=16)
    g.graphs = dict.fromkeys(g.graph_keys())  # as captured (capture needs CUDA)
    one = _step([[1]] * 5, [9] * 5)
    assert g.stage(one, 8) == 2  # adapter 9 and the padding rows' "none"
    assert g.key_for(8, 2) == (8, NARROW_GROUPS)
    narrow = g._batch(8, NARROW_GROUPS).lora.groups
    full = g._batch(8).lora.groups
    assert narrow.num_groups == NARROW_GROUPS and full.num_groups == 8
    assert torch.equal(narrow.group_size, full.group_size[:NARROW_GROUPS])
    assert sorted(narrow.group_adapter.tolist()) == [-1, 9]
    assert narrow.row_tiles.tolist() == full.row_tiles[: narrow.row_tiles.shape[0]].tolist()
    assert g.stage(_step([[1]] * 4, [9, 4, 9, 4]), 4) == 2  # no padding: two adapters
    assert g.stage(_step([[1]] * 3, [9, 4, 9]), 4) == 3  # and the padding row's "none"
    assert g.key_for(4, 3) == (4, None)
    assert g.key_for(1, 1) == (1, None)  # a bucket of one row has no narrow graph
