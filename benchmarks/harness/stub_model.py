"""An engine whose model computes nothing, to time the host's work alone on a CPU.

``stub_model(engine)`` gives the engine's runner decode and step graphs whose replay does
nothing (``engine_host_step``'s idea: each step's inputs are staged as on the GPU, in the
pinned-buffer twins, here on the CPU) and whose outputs are fixed logits with their greedy
head; a step no graph holds runs the model's forward, stubbed to return fixed logits too
(counted in the returned dict's ``eager_steps``: on the GPU such a step launches hundreds of
kernels). The sampler's full-vocabulary log-softmax (a decision's label logprobs, top
logprobs: on the GPU a kernel over [rows, V], on a CPU tens of milliseconds a step) returns
fixed values of the right shape; the sampler's other device work still runs (torch on the
CPU, small tensors). The engine runs ahead as with CUDA graphs.

With ``DETLORA_STUB_MODEL=1`` in the environment, ``install_from_env()`` (called at start-up by
``benchmarks/harness/sitecustomize/``) stubs the engine a server's engine process builds, so
a CPU server answers at the speed of its host code (and with ``DETLORA_STUB_MODEL_PROFILE=FILE``
its engine loop runs under cProfile, statistics in FILE at exit). Lab code: outputs are
meaningless.
"""

from __future__ import annotations

import os
from typing import Any

import torch

ENV = "DETLORA_STUB_MODEL"
PROFILE_ENV = "DETLORA_STUB_MODEL_PROFILE"  # also: profile the engine loop into this file


class _NoReplay:
    """A captured graph that computes nothing: its outputs stay the fixed ones."""

    def replay(self) -> None:
        pass

    def reset(self) -> None:
        pass


def stub_model(engine: Any) -> dict[str, int]:
    """Stub ``engine``'s graphs and forward (see the module docstring); returns the counter
    of eager steps (``{"eager_steps": n}``, updated in place)."""
    from detlora.engine.runner.step_graphs import StepGraphs

    runner, spec, c = engine.runner, engine.spec, engine.config
    graphs, step_graphs = runner.build_graphs(c.max_num_seqs, c.max_num_batched_tokens)
    g = torch.Generator().manual_seed(0)
    rows = max(graphs.buckets[-1], c.max_num_batched_tokens)
    logits = torch.randn(rows, spec.vocab_size, generator=g).to(engine.dtype)
    head = engine.sampler.greedy_head(logits)
    for key in graphs.graph_keys():
        graphs.graphs[key] = _NoReplay()
        graphs.outputs[key] = (logits[:key[0]], head[:key[0]])
    runner.graphs = graphs
    if isinstance(step_graphs, StepGraphs):
        for bucket in step_graphs.buckets:
            step_graphs.graphs[bucket] = _NoReplay()
            step_graphs.outputs[bucket] = (logits[:bucket[1]], head[:bucket[1]])
        runner.step_graphs = step_graphs
    counter = {"eager_steps": 0}
    hidden = torch.zeros(rows, spec.hidden_size, dtype=engine.dtype)

    def forward(batch: Any, upcast: bool = True) -> torch.Tensor:
        counter["eager_steps"] += 1
        return logits[: batch.logits_indices.numel()]

    def hidden_states(batch: Any) -> torch.Tensor:
        counter["eager_steps"] += 1
        return hidden[: batch.input_ids.numel()]

    sampler = engine.sampler
    real_log_softmax = sampler._log_softmax
    fixed_lp = torch.log_softmax(logits.float(), dim=-1)

    def log_softmax(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= rows and x.shape[1] == spec.vocab_size:
            return fixed_lp[: x.shape[0]]  # the device's work on the GPU: a stand-in here
        return real_log_softmax(x)

    sampler._log_softmax = log_softmax
    engine.model.forward = forward  # an instance attribute: nn.Module.__call__ finds it
    engine.model.hidden_states = hidden_states
    engine.run_ahead = True
    return counter


def install() -> None:
    from detlora.engine import core_proc

    init = core_proc.EngineCore.__init__

    def stubbed_init(self: Any, engine: Any, *args: Any, **kwargs: Any) -> None:
        # One thread: the stand-in torch ops are tiny, and on a busy host a thread pool's
        # waits for its other threads would be most of their time.
        torch.set_num_threads(1)
        stub_model(engine)
        init(self, engine, *args, **kwargs)

    core_proc.EngineCore.__init__ = stubbed_init
    profile = os.environ.get(PROFILE_ENV)
    if profile:  # the engine loop under cProfile, its statistics written when it returns
        import cProfile

        run = core_proc.EngineCore.run

        def profiled_run(self: Any) -> None:
            prof = cProfile.Profile()
            prof.enable()
            try:
                run(self)
            finally:
                prof.disable()
                prof.dump_stats(profile)

        core_proc.EngineCore.run = profiled_run


def install_from_env() -> bool:
    if not os.environ.get(ENV):
        return False
    try:
        install()
    except ImportError:  # a process without detlora on its path (a load client)
        return False
    return True


__all__ = ["ENV", "install", "install_from_env", "stub_model"]
