"""generate steps with the heap alive before the call out of the collector's scans, and
leaves the collector as it found it: unfrozen after (also when a step raises), and a heap the
caller froze stays frozen."""

from __future__ import annotations

import gc

import pytest
from tests.helpers.engine_outputs import random_prompts

from detlora.config import SamplingParams
from detlora.engine.frozen_heap import frozen_heap
from detlora.entrypoints.llm import LLM

SP = SamplingParams(max_tokens=3, temperature=0.0)


@pytest.fixture
def llm(llama_dir):
    return LLM(str(llama_dir), device="cpu", max_model_len=64)


def _watch(llm):
    """The freeze count at every step."""
    counts = []
    step = llm.engine.step

    def counting():
        counts.append(gc.get_freeze_count())
        return step()

    llm.engine.step = counting
    return counts


def test_generate_freezes_the_heap_only_while_it_steps(llm):
    assert gc.get_freeze_count() == 0
    counts = _watch(llm)
    llm.generate(random_prompts(3, seed=1), SP, use_tqdm=False)
    assert counts and all(c > 0 for c in counts)
    assert gc.get_freeze_count() == 0


def test_a_failed_step_unfreezes(llm):
    def boom():
        raise RuntimeError("step failed")

    llm.engine.step = boom
    with pytest.raises(RuntimeError, match="step failed"):
        llm.generate(random_prompts(2, seed=2), SP, use_tqdm=False)
    assert gc.get_freeze_count() == 0
    assert not llm.engine.has_unfinished()


def test_a_heap_frozen_by_the_caller_stays_frozen(llm):
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        counts = _watch(llm)
        llm.generate(random_prompts(2, seed=3), SP, use_tqdm=False)
        # Neither unfrozen (0) nor frozen again with the call's objects (more); frozen
        # objects the call drops leave the count.
        assert counts and all(0 < c <= frozen for c in counts)
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_cycles_made_in_the_block_are_still_collected():
    class Node:
        pass

    with frozen_heap():
        a, b = Node(), Node()
        a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 2


def test_the_engine_core_process_freezes_its_heap_once_the_engine_is_up(llama_dir):
    # run_engine_core is the core process's entry point; here on a thread of this process,
    # with pipes as the front end would give it.
    import threading
    from multiprocessing import Pipe

    from detlora.engine.core_proc import run_engine_core
    from detlora.engine_args import EngineArgs

    to_core, core_in = Pipe()
    core_out, from_core = Pipe()
    config = EngineArgs(model=str(llama_dir), device="cpu", max_model_len=64)
    core = threading.Thread(target=run_engine_core, args=(core_in, core_out, config, None))
    core.start()
    try:
        assert from_core.poll(120), "the core never answered"
        kind, _ = from_core.recv()
        assert kind == "ready"
        assert gc.get_freeze_count() > 0
        to_core.send(("shutdown", False))
        core.join(60)
        assert not core.is_alive()
    finally:
        gc.unfreeze()
