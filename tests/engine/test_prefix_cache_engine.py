"""Prefix caching through the engine (CPU path): a prompt whose prefix K/V come from the cache
gives the bits of the same prompt computed from scratch, alone, at batch_invariant."""

import pytest
import torch
from tests.helpers.engine_outputs import VOCAB, same_outputs

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

N = 8
SYSTEM = 40  # shared prompt tokens: two full pages of 16, and 8 more


def make_llm(model_dir, **kw) -> LLM:
    args = dict(enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu")
    return LLM(str(model_dir), **{**args, **kw})


@pytest.fixture(scope="module")
def case(llama_dir, llama_adapters):
    g = torch.Generator().manual_seed(11)
    system = torch.randint(2, VOCAB, (SYSTEM,), generator=g).tolist()
    prompts = [system + torch.randint(2, VOCAB, (3 + 2 * k,), generator=g).tolist()
               for k in range(N)]
    loras = [LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(llama_adapters)]
    mixed = [[None, loras[0], loras[1]][k % 3] for k in range(N)]
    params = [SamplingParams(temperature=0.0,
                             max_tokens=10, logprobs=1, ignore_eos=True) if k % 2 else
              SamplingParams(max_tokens=10, logprobs=0, ignore_eos=True, temperature=0.9,
                             top_p=0.9, seed=5 + k)
              for k in range(N)]
    plain = make_llm(llama_dir, enable_prefix_caching=False)
    alone = [plain.generate(prompts[k], params[k], mixed[k], use_tqdm=False)[0]
             for k in range(N)]
    assert all(o.num_cached_tokens == 0 for o in alone)
    return prompts, params, mixed, alone, plain


def assert_same(outs, ref):
    bad = [k for k, (a, b) in enumerate(zip(outs, ref, strict=True)) if not same_outputs(a, b)]
    assert not bad, f"outputs {bad} differ from the uncached ones computed alone"


def test_cached_prefixes_give_the_uncached_bits(case, llama_dir):
    prompts, params, mixed, alone, _ = case
    llm = make_llm(llama_dir)  # batch_invariant: caching is on by default
    warm = llm.generate(prompts[:3], params[:3], mixed[:3], use_tqdm=False)
    assert [o.num_cached_tokens for o in warm] == [0, 0, 0]
    assert_same(warm, alone[:3])
    outs = llm.generate(prompts, params, mixed, use_tqdm=False)
    assert_same(outs, alone)
    # The first three find their whole prompts but the last token's page; the rest find the
    # two full pages of the shared prompt, cached under their own adapter.
    pages = [(len(p) - 1) // 16 * 16 for p in prompts]
    assert [o.num_cached_tokens for o in outs] == pages[:3] + [32] * (N - 3)
    again = llm.generate(prompts[::-1], params[::-1], mixed[::-1], use_tqdm=False)[::-1]
    assert_same(again, alone)
    assert [o.num_cached_tokens for o in again] == pages
    # One fingerprint: at batch_invariant the cache does not decide the bits.
    assert {o.fingerprint for o in outs} == {o.fingerprint for o in alone}


def test_an_adapter_never_reads_another_adapters_pages(case, llama_dir, llama_adapters):
    prompts, params, _mixed, _alone, plain = case
    llm = make_llm(llama_dir)
    base = llm.generate(prompts[0], params[0], None, use_tqdm=False)[0]
    other = LoRARequest("a0", 1, str(llama_adapters[0]))
    out = llm.generate(prompts[0], params[0], other, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    ref = plain.generate(prompts[0], params[0], other, use_tqdm=False)[0]
    assert same_outputs(out, ref) and not same_outputs(out, base)


def test_preemption_and_chunks_with_the_cache(case, llama_dir):
    prompts, params, mixed, alone, _ = case
    small = make_llm(llama_dir, num_kv_blocks=12, block_size=8, max_num_batched_tokens=24)
    outs = small.generate(prompts, params, mixed, use_tqdm=False)
    assert_same(outs, alone)
    bm = small.engine.block_manager
    assert small.engine.scheduler.num_preemptions > 0 and bm.num_hit_tokens > 0


def test_n_completions_and_prompt_logprobs_with_the_cache(case, llama_dir):
    prompts, _, mixed, _, plain = case
    params = SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=3, prompt_logprobs=2,
                            logprobs=0)
    ref = plain.generate(prompts[4], params, mixed[4], use_tqdm=False)[0]
    llm = make_llm(llama_dir)
    llm.generate(prompts[4], SamplingParams(temperature=0.0,
                                            max_tokens=2), mixed[4], use_tqdm=False)
    out = llm.generate(prompts[4], params, mixed[4], use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # prompt logprobs score every position: no cache
    assert out.prompt_logprobs == ref.prompt_logprobs
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    assert [c.logprobs for c in out.outputs] == [c.logprobs for c in ref.outputs]
    # Without prompt logprobs the n completions share the cached prompt.
    plain_n = SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=3, logprobs=0)
    ref = plain.generate(prompts[4], plain_n, mixed[4], use_tqdm=False)[0]
    out = llm.generate(prompts[4], plain_n, mixed[4], use_tqdm=False)[0]
    assert out.num_cached_tokens == (len(prompts[4]) - 1) // 16 * 16
    assert [c.logprobs for c in out.outputs] == [c.logprobs for c in ref.outputs]


def test_pages_being_computed_are_shared_on_a_cold_cache(case, llama_dir):
    """Nothing cached yet: n completions of one prompt, and requests sharing a system prompt
    that arrive together, compute the shared pages once (the others wait a step for them) and
    keep the bits of the uncached runs."""
    prompts, _, mixed, _, plain = case
    n_params = SamplingParams(max_tokens=6, n=4, temperature=1.0, seed=3, logprobs=0)
    ref = plain.generate(prompts[4], n_params, mixed[4], use_tqdm=False)[0]
    llm = make_llm(llama_dir)
    out = llm.generate(prompts[4], n_params, mixed[4], use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    assert [c.logprobs for c in out.outputs] == [c.logprobs for c in ref.outputs]
    bm = llm.engine.block_manager
    assert bm.num_hit_tokens == 3 * ((len(prompts[4]) - 1) // 16 * 16)  # completions 1-3
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=1, ignore_eos=True)
    burst = [prompts[k] for k in (0, 3, 6)]  # one adapter (None), one system prompt
    refs = [plain.generate(p, params, None, use_tqdm=False)[0] for p in burst]
    fresh = make_llm(llama_dir)
    outs = fresh.generate(burst, params, None, use_tqdm=False)
    assert_same(outs, refs)
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32]
    assert fresh.engine.block_manager._computing == {}


def test_reset_prefix_cache(case, llama_dir):
    prompts, params, mixed, alone, _ = case
    llm = make_llm(llama_dir)
    llm.generate(prompts[1], params[1], mixed[1], use_tqdm=False)
    assert llm.reset_prefix_cache() is True
    out = llm.generate(prompts[1], params[1], mixed[1], use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and same_outputs(out, alone[1])


def test_below_batch_invariant_the_cache_is_off_unless_asked(case, llama_dir):
    prompts, params, mixed, _, _ = case
    off = make_llm(llama_dir, determinism="run_to_run")
    on = make_llm(llama_dir, determinism="run_to_run", enable_prefix_caching=True)
    for llm in (off, on):
        llm.generate(prompts[0], params[0], mixed[0], use_tqdm=False)
    a = off.generate(prompts[0], params[0], mixed[0], use_tqdm=False)[0]
    b = on.generate(prompts[0], params[0], mixed[0], use_tqdm=False)[0]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 32
    # There the cache decides bits, so it is part of the fingerprint.
    assert a.fingerprint != b.fingerprint


def test_qwen3_cached_prefixes_give_the_uncached_bits(qwen3_dir, qwen3_adapter):
    """Qwen3's q/k norms sit between the projection and the cache: the same promise."""
    g = torch.Generator().manual_seed(12)
    system = torch.randint(2, VOCAB, (SYSTEM,), generator=g).tolist()
    prompts = [system + torch.randint(2, VOCAB, (4 + k,), generator=g).tolist()
               for k in range(4)]
    lora = LoRARequest("q", 1, str(qwen3_adapter))
    loras = [lora, None, lora, None]
    sp = SamplingParams(max_tokens=8, logprobs=0, ignore_eos=True, temperature=0.8, seed=4)
    kw = dict(enable_lora=True, max_loras=1, max_lora_rank=8, device="cpu")
    plain = LLM(str(qwen3_dir), enable_prefix_caching=False, **kw)
    alone = [plain.generate(p, sp, lr, use_tqdm=False)[0] for p, lr in zip(prompts, loras,
                                                                              strict=True)]
    cached = LLM(str(qwen3_dir), **kw)
    cached.generate(prompts[:2], sp, loras[:2], use_tqdm=False)
    outs = cached.generate(prompts, sp, loras, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs[2:]] == [32, 32]
    assert_same(outs, alone)
