"""``max_tokens=None`` (vLLM's spelling for "no limit"): generate until max_model_len."""

import pytest

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM


def test_none_runs_to_max_model_len_and_the_same_bits(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", max_model_len=40)
    prompt = [5, 6, 7, 8, 9]
    out = llm.generate(prompt, SamplingParams(temperature=0.0,
                                              max_tokens=None, ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 40 - len(prompt) and out.finish_reason == "length"
    capped = llm.generate(prompt, SamplingParams(temperature=0.0,
                                                 max_tokens=35, ignore_eos=True, logprobs=0),
                          use_tqdm=False)[0].outputs[0]
    assert (capped.token_ids, capped.logprobs) == (out.token_ids, out.logprobs)
    # A limit below it still counts output tokens.
    short = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert short.token_ids == out.token_ids[:3] and short.finish_reason == "length"


def test_none_needs_room_for_max_model_len(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", max_model_len=200, num_kv_blocks=4,
              block_size=16)
    with pytest.raises(ValueError, match="up to max_model_len=200 output tokens"):
        llm.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=None), use_tqdm=False)
    SamplingParams(temperature=0.0,
                   max_tokens=None, min_tokens=50)  # no upper bound to check against
