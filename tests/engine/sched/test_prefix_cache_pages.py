"""Prefix caching in the block manager and the scheduler, without a model."""

import pytest

from detlora.config import SamplingParams
from detlora.engine.sched.block_hashes import UNREAD, extend_page_keys
from detlora.engine.sched.block_manager import BlockManager
from detlora.engine.sched.scheduler import Scheduler
from detlora.engine.sched.sequence import Sequence
from detlora.lora.request import LoRARequest


def seq_of(i: int, tokens: list[int], lora=None, **params) -> Sequence:
    return Sequence(seq_id=i, request_id=str(i), prompt=None, prompt_token_ids=list(tokens),
                    params=SamplingParams(max_tokens=8, **{"temperature": 0.0, **params}),
                    sample_seed=i,
                    max_len=len(tokens) + 8, lora=lora)


def computed(bm: BlockManager, seq: Sequence) -> Sequence:
    """Give ``seq`` pages for all its tokens and count them computed (what a step does)."""
    bm.allocate(seq, len(seq.token_ids))
    seq.num_computed = len(seq.token_ids)
    bm.register(seq)
    return seq


PREFIX = list(range(10, 18))  # two pages of 4


def test_a_shared_prefix_is_found_and_shared():
    bm = BlockManager(16, 4, enable_caching=True)
    a = computed(bm, seq_of(0, [*PREFIX, 1, 2]))
    assert bm.num_cached_pages == 2  # the third page is not full
    b = seq_of(1, [*PREFIX, 3, 4, 5])
    hit = bm.cached_prefix(b)
    assert hit == a.block_table[:2]
    free = bm.num_free
    assert bm.can_admit(b, hit, len(b.token_ids))
    bm.share(b, hit)
    assert b.num_computed == 8 and b.block_table == hit and bm.num_free == free
    assert all(bm.ref_count(p) == 2 for p in hit)
    bm.allocate(b, len(b.token_ids))
    assert len(b.block_table) == 3 and b.block_table[2] not in a.block_table
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (11, 8)


def test_the_last_token_is_always_computed():
    bm = BlockManager(16, 4, enable_caching=True)
    computed(bm, seq_of(0, [*PREFIX, 1]))
    # The same 8 tokens: only the first page is taken, so the step has a row to sample.
    assert len(bm.cached_prefix(seq_of(1, PREFIX))) == 1
    assert len(bm.cached_prefix(seq_of(2, [*PREFIX, 7]))) == 2
    assert bm.cached_prefix(seq_of(3, [99, *PREFIX])) == []  # a different first token


def test_adapters_have_separate_caches():
    bm = BlockManager(16, 4, enable_caching=True)
    tox = LoRARequest("tox", 1, "/a/tox")
    computed(bm, seq_of(0, [*PREFIX, 1], lora=tox))
    assert bm.cached_prefix(seq_of(1, [*PREFIX, 1])) == []  # base model
    assert bm.cached_prefix(seq_of(2, [*PREFIX, 1], lora=LoRARequest("tox", 2, "/a/tox"))) == []
    assert bm.cached_prefix(seq_of(3, [*PREFIX, 1], lora=LoRARequest("x", 1, "/a/y"))) == []
    assert len(bm.cached_prefix(seq_of(4, [*PREFIX, 1], lora=LoRARequest("tox", 1,
                                                                         "/a/tox")))) == 2


def test_page_keys_stop_at_an_unread_token_and_chain():
    keys = extend_page_keys([], [1, 2, 3, 4, 5, 6, UNREAD, 8, 9], 3, None)
    assert len(keys) == 2  # the third page holds the unread token
    again = extend_page_keys([], [1, 2, 3, 7, 5, 6], 3, None)
    assert again[0] == keys[0] and again[1] != keys[1]  # page 2's key covers page 1 too


def test_freed_pages_stay_cached_until_handed_out_last_page_first():
    bm = BlockManager(4, 4, enable_caching=True)
    a = computed(bm, seq_of(0, [*PREFIX, 1, 2, 3, 4]))  # three full pages, all cached
    pages = list(a.block_table)
    bm.free(a)
    assert bm.num_free == 4 and bm.num_cached_pages == 3
    # Still found after the free; taking them back revives them from the free list.
    b = seq_of(1, [*PREFIX, 1, 2, 3, 4, 9])
    hit = bm.cached_prefix(b)
    assert hit == pages
    bm.share(b, hit)
    assert bm.num_free == 1
    bm.free(b)
    # A page for something new evicts the page freed longest ago: the never-used page 3,
    # then a's last page (freed first), keeping the shared prefix longest.
    other = seq_of(2, [50] * 8)
    bm.allocate(other, 8)
    assert other.block_table == [3, pages[2]]
    assert bm.num_cached_pages == 2
    assert bm.cached_prefix(seq_of(3, [*PREFIX, 1, 2, 3, 4, 0])) == pages[:2]


def test_a_duplicate_page_keeps_the_first_registration():
    bm = BlockManager(16, 4, enable_caching=True)
    a = computed(bm, seq_of(0, [*PREFIX, 1]))
    b = computed(bm, seq_of(1, [*PREFIX, 2]))  # computed beside a, without sharing
    assert bm.num_cached_pages == 2
    assert bm.cached_prefix(seq_of(2, [*PREFIX, 3])) == a.block_table[:2]
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 16


def test_reset_and_disabled():
    bm = BlockManager(16, 4, enable_caching=True)
    computed(bm, seq_of(0, [*PREFIX, 1]))
    bm.reset_cache()
    assert bm.num_cached_pages == 0 and bm.cached_prefix(seq_of(1, [*PREFIX, 1])) == []
    off = BlockManager(16, 4)
    computed(off, seq_of(0, [*PREFIX, 1]))
    assert off.num_cached_pages == 0 and off.cached_prefix(seq_of(1, [*PREFIX, 1])) == []


def test_can_admit_counts_revived_pages_against_the_free_list():
    bm = BlockManager(3, 4, enable_caching=True)
    a = computed(bm, seq_of(0, [*PREFIX, 1]))  # all three pages; two cached
    bm.free(a)
    b = seq_of(1, [*PREFIX, 5, 6, 7, 8, 9])  # 13 tokens: 4 pages, 2 of them cached
    hit = bm.cached_prefix(b)
    assert len(hit) == 2
    assert bm.can_admit(b, hit, 12)  # 3 pages: the 2 revived + 1 new = 3 free
    assert not bm.can_admit(b, hit, 13)  # a fourth page does not exist


def scheduler(bm: BlockManager, budget: int = 64) -> Scheduler:
    return Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=budget,
                     enable_chunked_prefill=True)


def test_the_scheduler_starts_a_prompt_after_its_cached_pages():
    bm = BlockManager(32, 4, enable_caching=True)
    s = scheduler(bm)
    first = seq_of(0, [*PREFIX, 1, 2])
    s.add(first)
    out = s.schedule()
    assert [(x.num_tokens, x.samples) for x in out.scheduled] == [(10, True)]
    first.num_computed += 10
    first.append_token(7, None)
    bm.register(first)
    second, logprobs = seq_of(1, [*PREFIX, 3]), seq_of(2, [*PREFIX, 3], prompt_logprobs=0)
    s.add(second)
    s.add(logprobs)
    out = s.schedule()
    got = {x.seq.seq_id: x.num_tokens for x in out.scheduled}
    # The running first decodes; the second computes 1 token after 8 cached; the prompt
    # logprobs request computes every position, so it takes nothing from the cache.
    assert got == {0: 1, 1: 1, 2: 9}
    assert second.num_computed == 8 and second.num_cached_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert logprobs.num_computed == 0 and logprobs.num_cached_tokens is None


def test_a_preempted_sequence_takes_back_its_own_pages():
    bm = BlockManager(32, 4, enable_caching=True)
    s = scheduler(bm)
    seq = seq_of(0, [*PREFIX, 1, 2, 3, 4, 5])
    s.add(seq)
    s.schedule()
    seq.num_computed = len(seq.token_ids)
    seq.append_token(6, None)
    s._preempt(s.running.pop())  # what the scheduler does when pages run out
    assert seq.num_computed == 0 and seq.block_table == []
    out = s.schedule()
    # 14 tokens: three full pages come back from the cache, two tokens are computed.
    assert [x.num_tokens for x in out.scheduled] == [2]
    assert seq.num_computed == 12 and seq.num_cached_tokens == 0  # set at first admission


def _step(s: Scheduler, bm: BlockManager) -> dict[int, int]:
    """Schedule one step and count its tokens computed (what the engine does after a step);
    sampled tokens are not appended, so a finished prompt shows no further tokens."""
    out = s.schedule()
    for x in out.scheduled:
        x.seq.num_computed += x.num_tokens
        bm.register(x.seq)
    return {x.seq.seq_id: x.num_tokens for x in out.scheduled if x.num_tokens}


def test_a_page_being_computed_is_waited_for_not_computed_twice():
    bm = BlockManager(32, 4, enable_caching=True)
    s = scheduler(bm)
    first, same, other = seq_of(0, [*PREFIX, 1]), seq_of(1, [*PREFIX, 2]), seq_of(2, [5] * 9)
    for seq in (first, same, other):
        s.add(seq)
    # The second shares the first's two pages, which this very step computes: it waits and
    # keeps its place; the unrelated prompt is admitted behind it.
    assert _step(s, bm) == {0: 9, 2: 9}
    assert list(s.waiting) == [same]
    got = _step(s, bm)  # the first's pages are registered now
    assert got == {1: 1} and same.num_cached_tokens == 8
    assert same.block_table[:2] == first.block_table[:2]
    assert bm._computing == {}  # every mark cleared by registration


def test_a_chunked_prefill_is_followed_page_by_page():
    bm = BlockManager(32, 4, enable_caching=True)
    s = scheduler(bm, budget=8)
    prompt = [*PREFIX, 20, 21, 22, 23, 1]  # three full pages and a token
    leader, follower = seq_of(0, prompt), seq_of(1, [*prompt[:-1], 2])
    s.add(leader)
    s.add(follower)
    steps = [_step(s, bm) for _ in range(3)]
    # Step 2 leaves budget over, but the follower's next page (the third) is the leader's
    # chunk in that step: it waits, then takes all three pages from the cache and computes
    # only its own last token.
    assert steps == [{0: 8}, {0: 5}, {1: 1}]
    assert follower.num_cached_tokens == 12 and bm.num_hit_tokens == 12


def test_marks_are_cleared_when_the_computing_sequence_leaves():
    for leave in ("preempt", "abort", "finish"):
        bm = BlockManager(32, 4, enable_caching=True)
        s = scheduler(bm)
        leader, follower = seq_of(0, [*PREFIX, 1]), seq_of(1, [*PREFIX, 2])
        s.add(leader)
        s.schedule()  # the leader is admitted; its pages are not computed yet
        assert bm._computing
        if leave == "preempt":
            s._preempt(s.running.pop())
        elif leave == "abort":
            s.abort_all()
            s.add(leader)
        else:
            bm.free(leader, register=False)
            s.running.remove(leader)
        assert bm._computing == {}, leave
        s.add(follower)
        assert not bm.next_page_computing(follower, bm.cached_prefix(follower)), leave


@pytest.mark.parametrize("flag", ["yes", 1])
def test_enable_prefix_caching_must_be_a_bool(flag, tmp_path):
    from detlora.engine_args import EngineArgs

    with pytest.raises(ValueError, match="enable_prefix_caching must be a bool or None"):
        EngineArgs(str(tmp_path), enable_prefix_caching=flag)


def test_the_default_is_on_at_batch_invariant_only(tmp_path):
    from detlora.engine_args import EngineArgs

    on = [EngineArgs(str(tmp_path), determinism=d).resolved_prefix_caching
          for d in (None, "batch_invariant", "run_to_run", "fast")]
    assert on == [True, True, False, False]
    assert EngineArgs(str(tmp_path), determinism="fast",
                        enable_prefix_caching=True).resolved_prefix_caching
