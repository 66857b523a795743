"""The host cache of adapters and its arena: read once, kept, evicted by count and bytes."""

from __future__ import annotations

import threading

import pytest
import torch
from tests.helpers.adapter_files import tiny_model, write_adapter

from detlora.lora.host_cache import HostAdapterCache, available_host_memory
from detlora.lora.manager import LoRAManager
from detlora.lora.pinned_arena import ALIGN, PinnedArena
from detlora.lora.request import LoRARequest
from detlora.lora.stats import LoRAStats


def test_arena_first_fit_merge_and_release():
    arena = PinnedArena(pin=False, min_chunk_bytes=4096)
    a, b, c = arena.alloc(1000), arena.alloc(ALIGN), arena.alloc(2000)
    assert (a.offset, b.offset, c.offset) == (0, 1024, 1536) and a.nbytes == 1024
    assert arena.reserved_bytes == 4096 and arena.used_bytes == 1024 + 512 + 2048
    a.data.fill_(1)
    c.data.fill_(3)
    assert int(a.data.sum()) == 1024  # blocks do not overlap
    arena.free(b)
    assert arena.alloc(300).offset == 1024  # first fit reuses the hole
    big = arena.alloc(10_000)  # larger than a chunk: a chunk of its own, a power of two
    assert big.chunk != a.chunk and arena.reserved_bytes == 4096 + 16384
    arena.free(big)
    assert arena.reserved_bytes == 4096  # an empty chunk goes back
    with pytest.raises(ValueError, match="positive"):
        arena.alloc(0)


@pytest.fixture
def adapters(tmp_path):
    return [LoRARequest(f"ad{i}", i, str(write_adapter(tmp_path / f"ad{i}", seed=i, r=2 + i,
                                                       alpha=8)))
            for i in (1, 2, 3, 4)]


def _cache(model, **kw) -> tuple[HostAdapterCache, LoRAStats]:
    manager = LoRAManager(model, max_cpu_loras=4)
    stats = LoRAStats()
    args = dict(dtype=torch.float32, max_adapters=None, max_bytes=None, pin=False, stats=stats)
    return HostAdapterCache(manager.convert, **{**args, **kw}), stats


def test_read_once_then_cached(adapters):
    cache, stats = _cache(tiny_model())
    image, cached = cache.get(adapters[0])
    assert not cached and stats.disk_loads == 1 and image.hash
    cache.release(image)
    again, cached = cache.get(adapters[0])
    assert cached and again is image and stats.disk_loads == 1
    cache.release(again)
    assert cache.cached() == [1] and cache.num_bytes >= image.nbytes


def test_count_and_byte_limits_evict_least_recent(adapters):
    cache, stats = _cache(tiny_model(), max_adapters=2)
    for r in adapters[:3]:
        cache.release(cache.get(r)[0])
    assert cache.cached() == [2, 3] and stats.host_evictions == 1
    one = cache.get(adapters[1])[0]
    cache.release(one)
    cache, stats = _cache(tiny_model(), max_bytes=one.block.nbytes + 1)
    for r in adapters[:2]:
        cache.release(cache.get(r)[0])
    assert len(cache.cached()) == 1 and stats.host_evictions == 1


def test_held_images_are_not_evicted(adapters):
    cache, _ = _cache(tiny_model(), max_adapters=1)
    held, _ = cache.get(adapters[0])
    other, _ = cache.get(adapters[1])  # over the limit: the held one stays
    assert cache.cached() == [1, 2]
    cache.release(held)
    cache.release(other)
    cache.release(cache.get(adapters[2])[0])
    assert cache.cached() == [3]


def test_prefetch_reads_on_worker_threads(adapters):
    seen = []
    model = tiny_model()
    manager = LoRAManager(model)

    def convert(req):
        seen.append(threading.current_thread().name)
        return manager.convert(req)

    stats = LoRAStats()
    cache = HostAdapterCache(convert, dtype=torch.float32, max_adapters=None, max_bytes=None,
                             pin=False, stats=stats)
    assert cache.prefetch(adapters[:2]) == 2 and cache.prefetch(adapters[:2]) == 0
    for r in adapters[:2]:
        image, _ = cache.get(r)  # waits for the read under way
        cache.release(image)
    assert all(name.startswith("detlora-adapter-read") for name in seen)
    assert stats.disk_loads == 2 and cache.ready(1) and cache.ready(2)
    cache.shutdown()


def _wait_ready(cache, ids, timeout=30.0):
    import time

    end = time.monotonic() + timeout
    while not all(cache.ready(i) for i in ids):
        assert time.monotonic() < end, f"reads of {ids} did not finish"
        time.sleep(0.01)


def test_finished_reads_leave_the_pending_set(adapters):
    """A read ahead that finished is cached, not pending: it does not count against
    max_adapters when the window moves on (the next adapters are read ahead), and the
    pending set does not grow with every adapter ever read."""
    cache, stats = _cache(tiny_model(), max_adapters=2)
    a, b, c, d = adapters
    assert cache.prefetch([a, b]) == 2
    _wait_ready(cache, [1, 2])
    assert cache.prefetch([c, d]) == 2  # a and b are cached, outside the window: room
    _wait_ready(cache, [3, 4])
    cache.prefetch([c, d])
    assert not cache._pending and stats.disk_loads == 4
    assert sorted(cache.cached()) == [3, 4]
    cache.shutdown()


def test_failed_prefetch_is_reported_once_then_retried(tmp_path, adapters):
    cache, _ = _cache(tiny_model())
    bad = LoRARequest("bad", 9, str(write_adapter(tmp_path / "bad", use_dora=True)))
    cache.prefetch([bad])
    with pytest.raises(ValueError, match="DoRA"):
        cache.get(bad)
    assert not cache.failed(9) and 9 not in cache.cached()
    write_adapter(tmp_path / "bad")  # fixed on disk: the next get reads it again
    image, cached = cache.get(bad)
    assert not cached and image.hash
    cache.release(image)


def test_drop_discards_the_image(adapters):
    cache, _ = _cache(tiny_model())
    cache.release(cache.get(adapters[0])[0])
    assert cache.drop(1) and not cache.drop(1) and cache.cached() == []
    assert cache.num_bytes == 0 and cache.reserved_bytes == 0


def test_available_host_memory_is_positive():
    assert available_host_memory() > 0


def test_a_dropped_manager_is_freed_without_the_cycle_collector(adapters):
    """The reader threads hold the converter, not the manager: dropping the manager frees it
    (and its model) at once, even after reads ran on those threads."""
    import gc
    import weakref

    manager = LoRAManager(tiny_model())
    manager.prefetch(adapters[:2])
    for r in adapters[:2]:
        manager.load(r)
    ref = weakref.ref(manager)
    gc.disable()
    try:
        del manager
        assert ref() is None
    finally:
        gc.enable()
