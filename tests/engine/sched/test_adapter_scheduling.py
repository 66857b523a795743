"""Adapter-aware admission: requests of running adapters join them, and no request waits for a
slot without bound, however popular the other adapters are."""

from __future__ import annotations

import pytest
from tests.engine.sched.test_scheduler import advance, make_seq

from detlora.engine.sched.block_manager import BlockManager
from detlora.engine.sched.scheduler import Scheduler


def _scheduler(max_loras: int, wait: int, seqs: int = 64) -> Scheduler:
    return Scheduler(BlockManager(1024, 4), max_num_seqs=seqs, max_num_batched_tokens=512,
                     enable_chunked_prefill=True, max_loras=max_loras, max_adapter_wait=wait)


def _steps_until_admitted(wait: int, steps: int = 300) -> int | None:
    """One slot; a popular adapter gets a new request every step, an unpopular one request
    at the start, behind the first popular one. The step at which the unpopular request first
    runs, or None."""
    s = _scheduler(max_loras=1, wait=wait)
    popular, rare = object(), object()
    s.add(make_seq(0, 3, max_tokens=6, lora=popular))
    target = make_seq(1, 3, max_tokens=6, lora=rare)
    s.add(target)
    for step in range(steps):
        s.add(make_seq(2 + step, 3, max_tokens=6, lora=popular))
        out = s.schedule()
        if any(item.seq is target for item in out.scheduled):
            return step
        assert len({item.seq.lora for item in out.scheduled}) <= 1
        advance(s, out)
    return None


def test_unpopular_adapter_is_not_starved():
    # Without the bound, the popular adapter's stream keeps its slot forever.
    assert _steps_until_admitted(wait=10**9) is None
    for wait in (0, 5, 20):
        step = _steps_until_admitted(wait)
        # Overdue after `wait` schedules, then the popular requests already running finish
        # (6 tokens each) and the slot is the unpopular one's.
        assert step is not None and step <= wait + 6 + 1, (wait, step)


def test_requests_of_running_adapters_join_them():
    s = _scheduler(max_loras=2, wait=64)
    a, b, c = object(), object(), object()
    seqs = [make_seq(i, 3, lora=lora) for i, lora in enumerate([a, b, c, a, c, b, a, None])]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    # a and b take the two slots; every request of theirs joins, c's wait in order.
    assert [q.seq.seq_id for q in out.scheduled] == [0, 1, 3, 5, 6, 7]
    assert list(s.waiting) == [seqs[2], seqs[4]]
    assert s.upcoming_adapters(4) == [c]


def test_overdue_request_blocks_only_adapters():
    """Behind an overdue request, base-model requests still run; other adapters wait, and so
    does a request that would keep a running adapter's slot longer; one bound to finish
    within that adapter's running requests joins it (the slot frees no later)."""
    s = _scheduler(max_loras=1, wait=0)
    x, y, z = object(), object(), object()
    running = make_seq(0, 3, max_tokens=50, lora=x)
    s.add(running)
    advance(s, s.schedule())
    later = [make_seq(1, 3, lora=y), make_seq(2, 3, max_tokens=60, lora=x), make_seq(3, 3),
             make_seq(4, 3, lora=z), make_seq(5, 3, max_tokens=49, lora=x),
             make_seq(6, 3, max_tokens=50, lora=x)]
    for q in later:
        s.add(q)
    out = s.schedule()
    # y is overdue at once (wait=0); x's running request may add 49 more tokens: the x
    # request of 49 tokens joins it, those of 60 and 50 would outlast it and wait, z may not
    # start; the base-model request runs.
    assert [q.seq.seq_id for q in out.scheduled] == [0, 3, 5]
    assert list(s.waiting) == [later[0], later[1], later[3], later[5]]


def test_a_wave_of_equal_requests_runs_together_behind_an_overdue_one():
    """Slots free at once (a wave ends): the oldest requests take them, the first that finds
    none is overdue, and the later requests of the adapters just admitted still join."""
    s = _scheduler(max_loras=2, wait=0)
    a, b, c = object(), object(), object()
    seqs = [make_seq(i, 3, max_tokens=4, lora=lora)
            for i, lora in enumerate([a, b, c, a, b, c, a])]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    assert [q.seq.seq_id for q in out.scheduled] == [0, 1, 3, 4, 6]
    steps = 1
    while not any(q.seq.lora is c for q in out.scheduled):
        advance(s, out)
        out = s.schedule()
        steps += 1
    # c's requests run as soon as a and b drain (4 tokens each), both at once.
    assert steps == 5 and [q.seq.seq_id for q in out.scheduled] == [2, 5]


def test_upcoming_adapters_skip_running_ones():
    s = _scheduler(max_loras=1, wait=64)
    x, y, z = object(), object(), object()
    for i, lora in enumerate([x, y, y, None, z, x]):
        s.add(make_seq(i, 3, lora=lora))
    assert s.upcoming_adapters(5) == [x, y, z]
    s.schedule()  # x runs
    assert s.upcoming_adapters(5) == [y, z] and s.upcoming_adapters(1) == [y]


def test_max_adapter_wait_checked():
    with pytest.raises(ValueError, match="max_adapter_wait must be an int >= 0"):
        _scheduler(1, -1)
