"""SamplingParams(prompt_logprobs=N): every prompt token scored, as Hugging Face scores it, with
the same bits alone, in a batch, in chunks and after preemption."""

from __future__ import annotations

import warnings

import pytest
import torch
from tests.helpers.engine_outputs import random_prompts

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest


def _hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logits = model(torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]


def test_prompt_logprobs_match_hugging_face_and_peft(llama_dir, llama_adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(3, seed=21)
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=1, max_lora_rank=8, device="cpu")
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    lora = LoRARequest("a", 1, str(llama_adapters[0]))
    base = AutoModelForCausalLM.from_pretrained(str(llama_dir)).eval()
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(llama_dir)),
                                      str(llama_adapters[0])).eval()
    for hf, adapter in ((base, None), (tuned, lora)):
        for prompt, out in zip(prompts, llm.generate(prompts, sp, adapter, use_tqdm=False),
                               strict=True):
            scored = out.prompt_logprobs
            assert scored[0] is None and len(scored) == len(prompt)
            mine = torch.tensor([d[t].logprob for d, t in zip(scored[1:], prompt[1:],
                                                              strict=True)])
            torch.testing.assert_close(mine, _hf_prompt_logprobs(hf, prompt), rtol=0,
                                       atol=1e-4)
            for entry, token in zip(scored[1:], prompt[1:], strict=True):
                # The prompt token first, then the top 3 (the prompt token once if among them).
                assert next(iter(entry)) == token and len(entry) in (3, 4)
                top = [v.logprob for v in list(entry.values())[1:]]
                assert top == sorted(top, reverse=True)
                assert [v.rank for v in list(entry.values())[1:]][-1] == 3


def test_prompt_logprobs_keep_their_bits_in_batches_chunks_and_preemption(llama_dir):
    prompts = random_prompts(6, seed=22, lo=20, hi=40)
    sp = [SamplingParams(max_tokens=6, prompt_logprobs=k % 3, temperature=0.7 * (k % 2),
                         seed=k, logprobs=0) for k in range(6)]

    def run(llm, order):
        outs = llm.generate([prompts[k] for k in order], [sp[k] for k in order],
                            use_tqdm=False)
        return {k: (o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs)
                for k, o in zip(order, outs, strict=True)}

    big = LLM(str(llama_dir), device="cpu", max_model_len=64)
    ref = {k: run(big, [k])[k] for k in range(6)}
    assert run(big, list(range(6))[::-1]) == ref
    chunked = LLM(str(llama_dir), device="cpu", max_model_len=64, max_num_batched_tokens=7)
    assert run(chunked, list(range(6))) == ref
    tight = LLM(str(llama_dir), device="cpu", max_model_len=64, num_kv_blocks=12,
                block_size=8)
    assert run(tight, list(range(6))) == ref
    assert tight.engine.scheduler.num_preemptions > 0


def test_prompt_logprobs_off_and_bad_values(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", max_model_len=64)
    assert llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=1),
                        use_tqdm=False)[0].prompt_logprobs is None
    one = llm.generate([[3]], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0"):
        SamplingParams(temperature=0.0, prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs=129 asks for more top tokens"):
        llm.generate([[3, 4]], SamplingParams(temperature=0.0, prompt_logprobs=129), use_tqdm=False)


def test_the_lm_head_in_blocks_gives_the_same_scores(llama_dir, monkeypatch):
    from detlora.engine import llm_engine

    prompts = random_prompts(3, seed=23, lo=10, hi=30)
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    llm = LLM(str(llama_dir), device="cpu", max_model_len=64)
    whole = [o.prompt_logprobs for o in llm.generate(prompts, sp, use_tqdm=False)]
    monkeypatch.setattr(llm_engine, "PROMPT_BLOCK", 3)
    assert [o.prompt_logprobs for o in llm.generate(prompts, sp, use_tqdm=False)] == whole


def test_prompt_logprobs_are_the_decode_steps_bits(llama_dir, llama_adapters):
    """Scoring a prompt gives, for each token, what a decode step gave when it generated that
    token: the same value, top tokens and ranks (prefill == decode), with an adapter too, and
    with the prompt's prefill cut into chunks of 5 tokens."""
    prompts = random_prompts(3, seed=24, lo=4, hi=20)
    llm = LLM(str(llama_dir), device="cpu", max_model_len=64, enable_lora=True, max_loras=1,
              max_lora_rank=8, max_num_batched_tokens=5)
    lora = LoRARequest("a", 1, str(llama_adapters[0]))
    for adapter in (None, lora):
        made = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=7, logprobs=3,
                                                    ignore_eos=True), adapter, use_tqdm=False)
        whole = [p + o.outputs[0].token_ids for p, o in zip(prompts, made, strict=True)]
        scored = llm.generate(whole, SamplingParams(temperature=0.0, max_tokens=1,
                                                    prompt_logprobs=3), adapter, use_tqdm=False)
        for p, m, s in zip(prompts, made, scored, strict=True):
            decoded = m.outputs[0].logprobs
            again = s.prompt_logprobs[len(p):]
            assert again == decoded  # token ids, logprobs, ranks and order of every entry
            ids = m.outputs[0].token_ids
            assert torch.equal(
                torch.tensor([d[t].logprob for d, t in zip(again, ids, strict=True)]),
                torch.tensor([d[t].logprob for d, t in zip(decoded, ids, strict=True)]))


def test_a_cached_prefix_is_scored_not_skipped(llama_dir):
    """With the prefix cache on, a prompt whose pages are cached still gets every prompt
    logprob, with the bits of an engine that never cached it."""
    prompt = random_prompts(1, seed=25, lo=40, hi=41)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    fresh = LLM(str(llama_dir), device="cpu", max_model_len=64, block_size=8,
                enable_prefix_caching=False).generate([prompt], sp, use_tqdm=False)[0]
    llm = LLM(str(llama_dir), device="cpu", max_model_len=64, block_size=8,
              enable_prefix_caching=True)
    warm = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1),
                        use_tqdm=False)[0]
    assert warm.prompt_logprobs is None
    again = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert len(again.prompt_logprobs) == len(prompt) and again.prompt_logprobs[0] is None
    assert again.prompt_logprobs == fresh.prompt_logprobs
    # A later request without prompt logprobs still finds the pages cached.
    later = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1),
                         use_tqdm=False)[0]
    assert later.num_cached_tokens > 0


def test_one_top_token_is_the_sorted_order_first(llama_dir):
    """prompt_logprobs=1 takes the best token by argmax (no sort of the row): the same entry
    and ranks as the sorted order's first, ties to the lower token id included."""
    sampler = LLM(str(llama_dir), device="cpu", max_model_len=64).engine.sampler
    gen = torch.Generator().manual_seed(26)
    logits = torch.randn(6, 200, generator=gen)
    logits[1, [7, 150]] = 9.0  # a tie for the best: id 7 first
    logits[2, [3, 4, 5]] = -50.0
    logits[3] = 0.5  # every token ties
    targets = [5, 150, 4, 9, 0, 199]
    one = sampler.prompt_logprobs(logits, targets, [1] * 6)
    two = sampler.prompt_logprobs(logits, targets, [2] * 6)
    for (e1, r1), (e2, r2) in zip(one, two, strict=True):
        assert list(e1.items()) == list(e2.items())[: len(e1)] and r1 == r2[: len(e1)]
    assert list(one[1][0]) == [150, 7] and list(one[3][0]) == [9, 0]
