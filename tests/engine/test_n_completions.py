"""SamplingParams(n=...): several completions of one prompt, in one RequestOutput."""

from __future__ import annotations

import pytest
from tests.helpers.engine_outputs import random_prompts

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), device="cpu", max_model_len=64)


def _completions(out):
    return [(c.index, c.token_ids, c.logprobs) for c in out.outputs]


def test_n_completions_come_back_indexed_in_one_output(llm):
    prompts = random_prompts(2, seed=11)
    params = SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=7, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == 2
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.prompt_token_ids == prompt and out.finished
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # different draws
    # Completion 0 is the n=1 completion of the same seed.
    single = llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=1.0, seed=7,
                                                     logprobs=0), use_tqdm=False)[0]
    assert _completions(single) == _completions(outs[0])[:1]


def test_n_completions_are_batch_invariant_and_repeat(llm):
    prompts = random_prompts(4, seed=12)
    params = SamplingParams(max_tokens=6, n=2, temperature=0.8, top_p=0.9, seed=3, logprobs=0)
    alone = llm.generate(prompts[1], params, use_tqdm=False)[0]
    batch = llm.generate(prompts[::-1], params, use_tqdm=False)
    again = llm.generate(prompts[1], params, use_tqdm=False)[0]
    assert _completions(alone) == _completions(batch[2]) == _completions(again)


def test_greedy_n_gives_identical_completions_and_n_is_checked(llm):
    out = llm.generate(random_prompts(1, seed=13), SamplingParams(temperature=0.0,
                                                                  max_tokens=5, n=2),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n must be"):
            SamplingParams(temperature=0.0, n=bad)


def test_per_prompt_n_keeps_prompts_and_completions_in_order(llm):
    prompts = random_prompts(3, seed=14)
    params = [SamplingParams(max_tokens=4, n=k, temperature=1.0, seed=k) for k in (2, 1, 3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [[c.index for c in o.outputs] for o in outs] == [[0, 1], [0], [0, 1, 2]]
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        again = llm.generate(prompt, sp, use_tqdm=False)[0]
        assert _completions(again) == _completions(out)


def test_the_prompt_is_scored_once_for_n_completions(llm):
    prompt = random_prompts(1, seed=13, lo=20, hi=21)[0]
    scored: list[int] = []
    runner = llm.engine.runner
    original = runner.prompt_logits
    runner.prompt_logits = lambda hidden: (scored.append(hidden.shape[0]), original(hidden))[1]
    try:
        params = SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=5, prompt_logprobs=1)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
    finally:
        runner.prompt_logits = original
    assert sum(scored) == len(prompt) - 1  # one completion's rows, not three
    one = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=5,
                                              prompt_logprobs=1), use_tqdm=False)[0]
    assert out.prompt_logprobs == one.prompt_logprobs


def test_cumulative_logprob_sums_the_chosen_tokens(llm):
    prompt = random_prompts(1, seed=14)[0]
    out = llm.generate(prompt, SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=2,
                                              logprobs=2), use_tqdm=False)[0]
    for c in out.outputs:
        chosen = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert c.cumulative_logprob == sum(chosen) and c.cumulative_logprob < 0
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert plain.outputs[0].cumulative_logprob is None
