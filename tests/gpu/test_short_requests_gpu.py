"""Short requests on CUDA (issue 51): hundreds of one-token prompts a step replay the large
step graphs and run ahead wave after wave with the bits of each request alone; decisions in
bulk are the bits of each state alone; a step-graph capture that fails keeps the decode
graphs and the smaller step graphs."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.bf16_llama import write_bf16_llama
from tests.helpers.tiny_chat_model import build_tiny_chat_model

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

pytestmark = pytest.mark.gpu

VOCAB = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("short_gpu") / "model"
    write_bf16_llama(path, vocab=VOCAB, hidden=256, layers=2, heads=4, kv_heads=2,
                     head_dim=64, inter=512, proj_std=0.06, down_std=0.04)
    return path


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (int(k),), generator=g).tolist()
            for k in torch.randint(10, 20, (n,), generator=g)]


def test_waves_of_one_token_prompts_replay_large_step_graphs_with_the_bits_alone(
        model_dir, monkeypatch):
    import detlora.engine.runner.step_graphs as sg

    replays: list[tuple[int, int] | None] = []
    run = sg.StepGraphs.run
    monkeypatch.setattr(sg.StepGraphs, "run", lambda self, step: replays.append(
        self.bucket_for(step)) or run(self, step))
    llm = LLM(str(model_dir), determinism="batch_invariant", max_model_len=256)
    prompts = _prompts(700, 1)
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    engine = llm.engine
    assert (4096, 256) in replays  # 256 prompts of 10-19 tokens in one step, one replay
    assert engine.num_admitted_ahead >= 256  # the next wave prefilled while one was read
    alone = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts[::50]]
    for a, b in zip(alone, outs[::50], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_decisions_in_bulk_are_the_bits_of_each_state_alone(tmp_path):
    model, adapters = build_tiny_chat_model(tmp_path / "chat")
    llm = LLM(str(model), enable_lora=True, max_lora_rank=8, max_model_len=256)
    lora = LoRARequest("a", 1, str(adapters[0]))
    questions = {"toxic": {"type": "noul", "criteria": "Is this comment toxic?"},
                 "mood": {"type": "choice", "criteria": ["calm", "angry"]}}
    states = [f"the customer is angry {k}" if k % 2 else f"the state is calm {k}"
              for k in range(300)]
    bulk = llm.decide(states, questions, instructions="Judge.", lora_request=lora,
                      use_tqdm=False)
    for k in range(0, 300, 37):
        alone = llm.decide(states[k], questions, instructions="Judge.", lora_request=lora)
        assert alone.answers == bulk[k].answers and alone.fingerprint == bulk[k].fingerprint


def test_a_failed_large_step_graph_capture_keeps_the_other_graphs(model_dir, monkeypatch):
    import detlora.engine.runner.step_graphs as sg

    capture = sg.StepGraphs.capture

    def failing(self, pool, captured=None):
        if self.t_max > 2048:
            raise torch.cuda.OutOfMemoryError("no room for the largest bucket (test)")
        return capture(self, pool, captured)

    monkeypatch.setattr(sg.StepGraphs, "capture", failing)
    with pytest.warns(RuntimeWarning, match="steps up to 2048 tokens replay graphs"):
        llm = LLM(str(model_dir), determinism="batch_invariant", max_model_len=256)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.step_graphs is not None
    assert runner.step_graphs.t_max == 2048
    sp = SamplingParams(max_tokens=2, temperature=0.0, logprobs=0)
    outs = llm.generate(_prompts(300, 2), sp, use_tqdm=False)  # eager steps past 2048
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs)


def test_prompt_logprobs_replay_step_graphs_with_the_eager_bits(model_dir, monkeypatch):
    """lm-eval's loglikelihood requests (prompt logprobs, one token out) replay step graphs,
    which leave every row's hidden state for the scoring, and give the eager engine's bits:
    prompt logprobs, token and its logprob, in bulk and alone."""
    import detlora.engine.runner.step_graphs as sg

    scoring: list[tuple[int, int] | None] = []
    run = sg.StepGraphs.run
    monkeypatch.setattr(sg.StepGraphs, "run", lambda self, step: (
        scoring.append(self.bucket_for(step)) if step.prompt_rows else None) or run(self, step))
    prompts = _prompts(300, 3)
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1, prompt_logprobs=1)
    outs = {}
    for eager in (False, True):
        llm = LLM(str(model_dir), determinism="batch_invariant", max_model_len=256,
                  enforce_eager=eager)
        outs[eager] = llm.generate(prompts, sp, use_tqdm=False)
        if not eager:
            assert scoring, "no scoring step replayed a graph"
            alone = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts[::60]]
            for a, b in zip(alone, outs[False][::60], strict=True):
                assert a.prompt_logprobs == b.prompt_logprobs
                assert a.outputs[0].logprobs == b.outputs[0].logprobs
        del llm
        torch.cuda.empty_cache()
    for a, b in zip(outs[False], outs[True], strict=True):
        assert a.prompt_logprobs == b.prompt_logprobs
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
