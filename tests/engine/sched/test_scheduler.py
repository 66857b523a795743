"""Block manager and scheduler, without a model: sequences stepped by hand."""

import pytest

from detlora.config import SamplingParams
from detlora.engine.sched.block_manager import BlockManager, OutOfBlocksError
from detlora.engine.sched.scheduler import Scheduler
from detlora.engine.sched.sequence import FinishReason, Sequence, SequenceStatus


def make_seq(i: int, prompt_len: int, max_tokens: int = 8, lora=None) -> Sequence:
    return Sequence(seq_id=i, request_id=str(i), prompt=None,
                    prompt_token_ids=list(range(2, 2 + prompt_len)),
                    params=SamplingParams(temperature=0.0, max_tokens=max_tokens), sample_seed=i,
                    max_len=prompt_len + max_tokens, lora=lora)


def advance(sched: Scheduler, out, token: int = 5) -> None:
    """What the engine does after the model ran: count computed tokens, append samples."""
    for item in out.scheduled:
        item.seq.num_computed += item.num_tokens
        if item.samples:
            item.seq.append_token(token, None)
            if item.seq.num_output_tokens >= item.seq.params.max_tokens:
                sched.finish(item.seq, FinishReason.LENGTH)


def test_block_manager_allocate_free_refcounts():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_seq(0, 5), make_seq(1, 3)
    bm.allocate(a, 5)
    assert a.block_table == [0, 1] and bm.num_free == 2
    bm.allocate(a, 8)  # still two pages
    assert a.block_table == [0, 1]
    bm.allocate(b, 3)
    assert b.block_table == [2] and bm.ref_count(2) == 1
    assert bm.slot(a, 6) == 1 * 4 + 2
    with pytest.raises(OutOfBlocksError, match="needs 2 more KV blocks"):
        bm.allocate(b, 12)
    assert b.block_table == [2]  # all or nothing
    bm.free(a)
    assert a.block_table == [] and bm.num_free == 3 and bm.ref_count(0) == 0
    bm.allocate(b, 12)
    assert b.block_table == [2, 3, 1]  # FIFO free list; a frees its last page first
    with pytest.raises(ValueError):
        BlockManager(0, 4)


def test_prefill_then_decode_and_limits():
    bm = BlockManager(64, 4)
    s = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100, enable_chunked_prefill=True)
    seqs = [make_seq(i, 6, max_tokens=3) for i in range(3)]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    # max_num_seqs = 2: the third waits.
    assert [(x.seq.seq_id, x.num_tokens, x.samples) for x in out.scheduled] == \
        [(0, 6, True), (1, 6, True)]
    assert not out.is_decode_only and seqs[2].status is SequenceStatus.WAITING
    advance(s, out)
    out = s.schedule()
    assert out.is_decode_only and [x.num_tokens for x in out.scheduled] == [1, 1]
    advance(s, out)
    advance(s, s.schedule())  # third token: both finish
    assert seqs[0].is_finished and seqs[0].finish_reason is FinishReason.LENGTH
    assert bm.num_free == 64  # finished sequences gave their pages back
    out = s.schedule()
    assert [x.seq.seq_id for x in out.scheduled] == [2]


def test_chunked_prefill_splits_a_long_prompt():
    bm = BlockManager(64, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8, enable_chunked_prefill=True)
    long, short = make_seq(0, 20), make_seq(1, 3)
    s.add(long)
    s.add(short)
    chunks = []
    for _ in range(3):
        out = s.schedule()
        chunks.append([(x.seq.seq_id, x.num_tokens, x.samples) for x in out.scheduled])
        assert out.num_tokens <= 8
        advance(s, out)
    assert chunks[0] == [(0, 8, False)]
    assert chunks[1] == [(0, 8, False)]
    # The long prompt finishes (4 tokens, samples) and the short one fills the budget.
    assert chunks[2] == [(0, 4, True), (1, 3, True)]


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    bm = BlockManager(64, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10, enable_chunked_prefill=False)
    a, b = make_seq(0, 6), make_seq(1, 6)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(0, 6)]
    advance(s, out)
    out = s.schedule()  # a decodes (1) and b's 6 fit in the remaining 9
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(0, 1), (1, 6)]


def test_preemption_frees_pages_and_recomputes():
    bm = BlockManager(num_blocks=5, block_size=4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True)
    a, b = make_seq(0, 8, max_tokens=8), make_seq(1, 8, max_tokens=8)
    s.add(a)
    s.add(b)
    advance(s, s.schedule())  # both prefilled: 2 + 2 pages, one free
    for _ in range(4):
        out = s.schedule()
        advance(s, out)
        if out.preempted:
            break
    # b (the newest) was preempted when a needed a page: back in waiting, pages freed.
    assert out.preempted == (b,) and b.status is SequenceStatus.WAITING
    assert b.num_computed == 0 and b.block_table == [] and b.num_preemptions == 1
    assert s.waiting[0] is b and s.num_preemptions == 1
    generated = b.num_output_tokens
    while not a.is_finished:
        advance(s, s.schedule())
    out = s.schedule()
    # The recompute is one prefill of prompt + generated tokens.
    assert [(x.seq.seq_id, x.num_tokens) for x in out.scheduled] == [(1, 8 + generated)]


def test_a_sequence_preempts_itself_when_it_is_the_newest():
    bm = BlockManager(num_blocks=3, block_size=2)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True)
    a, b = make_seq(0, 2, max_tokens=2), make_seq(1, 4, max_tokens=4)
    s.add(a)
    s.add(b)
    advance(s, s.schedule())  # a: 1 page, b: 2 pages
    out = s.schedule()  # a needs a page for its 3rd token -> b (newest) goes first
    assert out.preempted == (b,) and [x.seq for x in out.scheduled] == [a]


def test_max_loras_limits_adapters_per_step():
    bm = BlockManager(64, 4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, enable_chunked_prefill=True,
                  max_loras=1)
    x, y = object(), object()
    seqs = [make_seq(0, 3, lora=x), make_seq(1, 3, lora=y), make_seq(2, 3, lora=x),
            make_seq(3, 3)]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    # y's request waits; x's second request and the base request go ahead of it.
    assert [q.seq.seq_id for q in out.scheduled] == [0, 2, 3]
    assert list(s.waiting) == [seqs[1]]
