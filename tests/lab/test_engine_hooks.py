"""The engine attributes that lab modules hook or read (profile_engine, stub_model, and the
experiments run_ahead_cases, first_cache_hit, pdl_decode, prefill_host, shared_inflight_pages)
exist on a CPU engine, so that moving or renaming them fails here, not on the GPU machine."""

import inspect
import sys
from dataclasses import replace

import pytest

from benchmarks.suites import engine as be

HOOKS = ("step", "run_ahead", "num_steps_ahead", "model", "spec.vocab_size",
         "scheduler.schedule", "block_manager.next_page_computing",
         "block_manager.num_hit_tokens", "sampler.launch", "sampler._log_softmax",
         "runner.execute",
         "runner.forward_batch", "runner.graphs", "runner.graph_error")


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab-hooks")
    shape = replace(be.ModelShape(), hidden=64, layers=1, heads=4, kv_heads=2, head_dim=16,
                    intermediate=128, vocab=256, rank=4, alpha=8)
    plan = replace(be.BenchPlan(), shape=shape, prompts=2, prompt_len=4, output_len=2,
                   throughput_batches=(2,))
    be.write_model(root / "model", shape)
    return be.make_engine(root / "model", "batch_invariant", plan, device="cpu")


@pytest.mark.parametrize("chain", HOOKS)
def test_engine_has(tiny_llm, chain):
    obj = tiny_llm.engine
    for name in chain.split("."):
        assert hasattr(obj, name), f"LLM.engine.{chain}: no {name!r}"
        obj = getattr(obj, name)


def test_the_engine_module_builds_step_inputs(tiny_llm):
    module = sys.modules[type(tiny_llm.engine).__module__]
    assert callable(module.build_step_inputs)  # profile_engine and prefill_host wrap it


def test_decode_graphs_have_what_the_profiler_reads():
    """runner.graphs is None on a CPU; its class (CUDA only) must keep these names."""
    from detlora.engine.runner.decode_graphs import DecodeGraphs

    for name in ("stage", "bucket_for"):
        assert callable(getattr(DecodeGraphs, name, None)), name
    assert "self.graphs" in inspect.getsource(DecodeGraphs.__init__)


def test_the_sampler_launch_takes_what_the_profiler_passes_on(tiny_llm):
    """profile_engine replaces sampler.launch with a wrapper that passes each keyword on: a
    new one must reach the wrapper too (``fed`` once did not, and only the GPU found out)."""
    from benchmarks.suites import profile_engine

    wrapper = inspect.getsource(profile_engine)
    launch = inspect.signature(tiny_llm.engine.sampler.launch).parameters
    for name in launch:
        if name not in ("logits", "requests"):
            assert f"{name}={name}" in wrapper, f"profile_engine does not pass {name!r} on"
