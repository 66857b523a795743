"""KV pages in groups (engine/sched/grouped_block_manager.py), without a model: window groups
release pages behind the window and never allocate them on a cache hit; a hit needs every
group's pages; with one full group the manager hands out the pages ``BlockManager`` does,
step by step under the scheduler."""

import random

import pytest
from tests.engine.sched.test_scheduler import advance, make_seq

from detlora.engine.sched.block_manager import BlockManager, OutOfBlocksError
from detlora.engine.sched.grouped_block_manager import GroupedBlockManager
from detlora.engine.sched.scheduler import Scheduler


def _computed(bm, seq, n):
    """The engine's bookkeeping after a step that computed up to ``n`` tokens."""
    seq.num_computed = n
    bm.register(seq)


def test_window_group_releases_pages_behind_the_window():
    bm = GroupedBlockManager([20, 6], [None, 8], 4)
    s = make_seq(0, 20)
    bm.allocate(s, 20)
    assert s.block_table == [0, 1, 2, 3, 4] and s.group_tables == [[0, 1, 2, 3, 4]]
    _computed(bm, s, 20)  # the next query (position 20) sees 13..20: pages 0-2 are behind
    assert s.group_tables == [[-1, -1, -1, 3, 4]] and s.block_table == [0, 1, 2, 3, 4]
    assert bm.num_free_of(1) == 4 and bm.num_free == 15
    with pytest.raises(OutOfBlocksError, match="in group 1"):
        bm.allocate(s, 44)  # six new pages: group 1 has four
    s.append_token(5, None)
    bm.allocate(s, 21)
    assert s.group_tables == [[-1, -1, -1, 3, 4, 5]]
    assert bm.slot(s, 20, group=1) == 5 * 4
    _computed(bm, s, 21)  # position 21 sees 14..21: page 3 (12..15) still in the window
    assert s.group_tables == [[-1, -1, -1, 3, 4, 5]]
    bm.free(s)
    assert bm.num_free_of(1) == 6 and bm.num_free == 20
    assert s.block_table == [] and s.group_tables == [] and s.released == []


def test_cache_hit_takes_only_the_window_pages():
    bm = GroupedBlockManager([20, 12], [None, 6], 4, enable_caching=True)
    a = make_seq(0, 30)
    bm.allocate(a, 30)
    _computed(bm, a, 30)
    full_a = list(a.block_table)
    bm.free(a)
    b = make_seq(1, 0)
    b.token_ids = list(a.token_ids[:26]) + [99] * 6  # shares 6 full pages (24 tokens)
    cached = bm.cached_prefix(b)
    assert len(cached) == 6 and cached.groups[0] == full_a[:6]
    # Computing from 24 on needs keys from 24 - 6 + 1 = 19: pages 4 and 5 of the window group.
    assert cached.groups[1][:4] == [-1] * 4 and all(p >= 0 for p in cached.groups[1][4:])
    assert bm.can_admit(b, cached, 32)
    bm.share(b, cached)
    assert b.num_computed == 24 and b.released == [0, 4]
    bm.allocate(b, 32)
    assert len(b.block_table) == len(b.group_tables[0]) == 8
    bm.free(b)
    assert bm.num_free_of(0) == 20 and bm.num_free_of(1) == 12


def test_a_hit_needs_every_group_and_shortens_to_what_it_holds():
    bm = GroupedBlockManager([20, 5], [None, 6], 4, enable_caching=True)
    a = make_seq(0, 30)
    for n in [*range(4, 30, 4), 30]:  # chunks of 4: the window group releases as it goes
        bm.allocate(a, n)
        _computed(bm, a, n)
        assert sum(p >= 0 for p in a.group_tables[0]) <= 3
    held = [p for p in a.group_tables[0] if p >= 0]
    bm.free(a)
    # Another sequence takes every free window page: the cached ones are evicted first.
    c = make_seq(2, 20)
    c.token_ids = [50 + i for i in range(20)]
    bm.allocate(c, 20)
    assert set(held) <= set(c.group_tables[0])
    b = make_seq(1, 0)
    b.token_ids = [*a.token_ids[:29], 99]
    assert len(bm.cached_prefix(b)) == 0  # every full page is cached, but no window page
    bm.free(c)


@pytest.mark.parametrize("seed", [0, 1])
def test_one_full_group_hands_out_blockmanagers_pages(seed):
    """The same workload under the scheduler over BlockManager and over a one-group
    GroupedBlockManager: the same steps, tables, preemptions and free pages."""
    rnd = random.Random(seed)
    lens = [rnd.randint(1, 26) for _ in range(12)]
    runs = []
    for manager in (BlockManager(12, 4, enable_caching=True),
                    GroupedBlockManager([12], [None], 4, enable_caching=True)):
        sched = Scheduler(manager, max_num_seqs=5, max_num_batched_tokens=20,
                          enable_chunked_prefill=True)
        seqs = [make_seq(i, n, max_tokens=6) for i, n in enumerate(lens)]
        for i in range(6):  # shared prefixes: the cache has work
            seqs[i + 6].token_ids = list(seqs[i].token_ids)
            seqs[i + 6].prompt_token_ids = list(seqs[i].prompt_token_ids)
        for q in seqs:
            sched.add(q)
        trace = []
        while sched.has_unfinished():
            out = sched.schedule()
            trace.append([(x.seq.seq_id, x.num_tokens, list(x.seq.block_table))
                          for x in out.scheduled])
            advance(sched, out)
            for x in out.scheduled:
                manager.register(x.seq)
        runs.append((trace, manager.num_free, sched.num_preemptions,
                     manager.num_hit_tokens))
    assert runs[0] == runs[1]
    assert runs[0][2] > 0 and runs[0][3] > 0  # preemptions and cache hits happened


def test_bad_arguments():
    with pytest.raises(ValueError, match="one page count per group"):
        GroupedBlockManager([4, 4], [None], 4)
    with pytest.raises(ValueError, match="windows must be"):
        GroupedBlockManager([4], [0], 4)
