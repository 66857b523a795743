"""Engines release what they hold when dropped, at once: no reference cycle keeps the model,
the KV cache or the CUDA graphs alive until Python's cyclic GC runs (on the H200 a dropped
engine kept 118 GiB until ``gc.collect()``, and the next engine found no room). The GC is
off in these tests, so anything kept in a cycle stays visible. ``shutdown()`` (and ``with
LLM(...)``) frees the same explicitly; a failed construction holds nothing either.

The CPU runs no CUDA graphs, so the graph objects are built without capture
(``ModelRunner.build_graphs``): what they reference is what a captured engine keeps.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from detlora.config import SamplingParams
from detlora.engine.runner import kv_sizing
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest


@pytest.fixture
def no_gc():
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if was:
        gc.enable()


def _llm(llama_dir, **kw):
    return LLM(str(llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu",
               max_model_len=64, max_num_batched_tokens=64, **kw)


def _watch(llm):
    """Weak references to the engine and what holds memory in it."""
    e = llm.engine
    return {"llm": weakref.ref(llm), "engine": weakref.ref(e), "runner": weakref.ref(e.runner),
            "model": weakref.ref(e.model), "weight": weakref.ref(e.model.embed_tokens.weight),
            "kv": weakref.ref(e.runner.kv_cache.k[0]), "sampler": weakref.ref(e.sampler),
            "graphs": weakref.ref(e.runner.graphs) if e.runner.graphs is not None else None}


def _alive(refs) -> list[str]:
    return [k for k, r in refs.items() if r is not None and r() is not None]


def _with_graphs(llm):
    """Give the runner the decode and step graph objects a CUDA engine captures (uncaptured:
    the runner would try to replay them, so no step runs after this)."""
    runner = llm.engine.runner
    runner.graphs, runner.step_graphs = runner.build_graphs(8, 64)
    assert runner.step_graphs is not None


def test_a_dropped_engine_with_graphs_is_freed_without_the_gc(no_gc, llama_dir,
                                                              llama_adapters):
    llm = _llm(llama_dir)
    out = llm.generate([[3, 4, 5], [6, 7]], SamplingParams(max_tokens=3),
                       [LoRARequest("a0", 1, str(llama_adapters[0])), None], use_tqdm=False)
    assert len(out) == 2
    _with_graphs(llm)  # after generating: the CPU cannot replay them
    refs = _watch(llm)
    del llm, out
    assert _alive(refs) == []


def test_shutdown_releases_everything_while_the_llm_is_still_referenced(no_gc, llama_dir):
    llm = _llm(llama_dir)
    llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2), use_tqdm=False)
    _with_graphs(llm)
    refs = _watch(llm)
    llm.shutdown()
    assert _alive(refs) == ["llm", "engine"]
    assert llm.engine.is_shut_down
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()  # again: nothing to do


def test_with_llm_releases_on_exit(no_gc, llama_dir):
    with _llm(llama_dir) as llm:
        refs = _watch(llm)
        out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert out[0].finished
    assert _alive(refs) == ["llm", "engine"]
    del llm
    assert _alive(refs) == []


def test_a_failed_construction_holds_nothing(no_gc, llama_dir, monkeypatch):
    """The model is loaded, then building the runner fails: the error (kept with its
    traceback, as a notebook keeps sys.last_traceback) must not keep the model alive."""
    import detlora.engine.llm_engine as engine_module

    seen = []

    class Failing(engine_module.ModelRunner):
        def __init__(self, model, **kw):
            seen.append(weakref.ref(model.embed_tokens.weight))
            raise ValueError("no room for the KV cache (test)")

    monkeypatch.setattr(engine_module, "ModelRunner", Failing)
    with pytest.raises(ValueError, match="no room") as caught:
        _llm(llama_dir)
    assert caught.value.__traceback__ is not None
    assert len(seen) == 1 and seen[0]() is None


def test_repeated_engines_in_one_process(no_gc, llama_dir):
    """Build, generate, drop, ten times: each engine is gone before the next is built."""
    previous = None
    for k in range(10):
        llm = _llm(llama_dir, seed=k)
        out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert out[0].finished
        if previous is not None:
            assert _alive(previous) == []
        previous = _watch(llm)
        del llm, out
    assert _alive(previous) == []


def test_no_room_message_names_the_holder():
    gib = 2**30
    common = dict(total=140 * gib, gpu_memory_utilization=0.85, max_num_batched_tokens=8192)
    held = kv_sizing.no_room_message(free=20 * gib, allocated_before=110 * gib,
                                     other=1 * gib, engine_peak=9 * gib, **common)
    assert held.startswith("no GPU memory left for the KV cache: gpu_memory_utilization=0.85 "
                           "allows 119.00 GiB of 140.00 GiB, and 20.00 GiB are free now; "
                           "110.00 GiB were already allocated by this process before this "
                           "engine was built")
    assert "shutdown()" in held
    assert held.index("110.00") < held.index("peak at 9.00 GiB") < held.index(
        "1.00 GiB are used outside")  # the largest holder first
    own = kv_sizing.no_room_message(free=1 * gib, allocated_before=0, other=2 * gib,
                                    engine_peak=117 * gib, **common)
    assert own.split("; ")[1].startswith("this engine's model and a profiling step of 8192 "
                                         "tokens peak at 117.00 GiB (lower "
                                         "max_num_batched_tokens")
    others = kv_sizing.no_room_message(free=1 * gib, allocated_before=0, other=100 * gib,
                                       engine_peak=17 * gib, **common)
    assert others.split("; ")[1].startswith("100.00 GiB are used outside PyTorch's allocator "
                                            "(other processes")
