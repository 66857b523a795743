"""Qwen2, Mistral and Phi-3 (with LongRoPE) through the engine on the CPU, each with sliding
windows shorter than its prompts (Mistral and Phi-3: every layer; Qwen2: the layers from
max_window_layers on, the first full): greedy tokens equal transformers' ``generate``
(+ PEFT) with base and adapter requests in one batch, and every request's tokens and logprobs
are the same bits alone, in a batch, reversed, with chunked prefill across the window's edge,
preemption and the prefix cache (hit and miss). A window that holds the whole context is
dropped: full attention, the same tokens as transformers'."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.engine_outputs import random_prompts, same_outputs
from tests.helpers.tiny_hf import (
    ALL_TARGETS,
    BASES,
    FUSED_TARGETS,
    longrope_parameters,
    make_adapter,
    make_base_checkpoint,
)

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

ORIGINAL = 32  # Phi-3's original_max_position_embeddings here: prompts on both sides of it
# Windows shorter than most prompts, as each family's config.json spells them.
WINDOWS = {"qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
           "mistral": dict(sliding_window=8), "phi3": dict(sliding_window=12)}
GROUP_WINDOWS = {"qwen2": [None, 8], "mistral": [8], "phi3": [12]}  # KV groups' windows
# (token budget, pages) that preempt: windowed layers give back the pages behind their
# windows, so the all-windowed families need more sequences admitted at once.
TIGHT = {"qwen2": (8, 14), "mistral": (12, 13), "phi3": (12, 13)}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """arch -> (checkpoint, adapter), built on first use."""
    made: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in made:
            root = tmp_path_factory.mktemp(arch)
            extra = dict(WINDOWS[arch])
            if arch == "phi3":  # LongRoPE with max_position_embeddings 128 = 4 x original
                extra |= dict(rope_parameters=longrope_parameters(16, ORIGINAL),
                              original_max_position_embeddings=ORIGINAL)
            base = make_base_checkpoint(root / "base", arch, **extra)
            targets = FUSED_TARGETS if arch == "phi3" else ALL_TARGETS
            made[arch] = base, make_adapter(base, root / "adapter", targets=targets, seed=3)
        return made[arch]

    return get


def make_llm(base, **kw) -> LLM:
    args = dict(enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu",
                enable_prefix_caching=False)
    return LLM(str(base), **{**args, **kw})


def hf_greedy(base, adapter, prompts, n):
    """transformers' generate (Phi-3's recomputes its cache when it grows past the original
    context): the tokens and the raw logprob of each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager")
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    out = []
    for p in prompts:
        x = torch.tensor([p])
        with torch.no_grad():
            r = model.eval().generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                      do_sample=False, eos_token_id=None, pad_token_id=0,
                                      output_logits=True, return_dict_in_generate=True)
        toks = r.sequences[0, len(p):].tolist()
        lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(r.logits, toks,
                                                                             strict=True)]
        out.append((toks, lps))
    return out


@pytest.mark.parametrize("arch", BASES)
def test_greedy_equals_transformers_generate(families, arch):
    base, adapter = families(arch)
    # Phi-3: 20 + 16 and 31 + 16 cross the original context while generating, 33 and 45
    # start past it.
    lengths = [20, 45, 31, 33] if arch == "phi3" else [9, 17, 4, 23]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in lengths]
    lora = LoRARequest("a", 1, str(adapter))
    mixed = [lora, None, lora, None]
    n = 16
    llm = make_llm(base)
    assert [g.window for g in llm.engine.model.kv_groups] == GROUP_WINDOWS[arch]
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, sp, mixed, use_tqdm=False)
    for which in (None, adapter):
        rows = [k for k, m in enumerate(mixed) if (m is None) == (which is None)]
        want = hf_greedy(base, which, [prompts[k] for k in rows], n)
        for k, (toks, lps) in zip(rows, want, strict=True):
            c = outs[k].outputs[0]
            assert c.token_ids == toks, (arch, lengths[k], which)
            got = [next(iter(d.values())).logprob for d in c.logprobs]
            assert max(abs(a - b) for a, b in zip(got, lps, strict=True)) < 1e-4
    if arch == "phi3":
        assert llm.engine.scheduler.num_offset_recomputes == 2  # the two that grew past 32
        # Both had the adapter: sent back to the queue, they were counted as waiting again.
        assert llm.engine.scheduler._waiting_loras == {}


@pytest.mark.parametrize("arch", BASES)
def test_bits_do_not_depend_on_the_batch(families, arch):
    """batch_invariant: each request alone is the reference; in a batch (run ahead or not),
    reversed, chunked (8- or 12-token steps, across the windows' edges) on a KV cache that
    preempts, and with the prefix cache (run twice: the second run reads cached pages), its
    token ids and logprobs are the same bits."""
    base, adapter = families(arch)
    n = 6
    prompts = random_prompts(n, seed=11, lo=3, hi=40)
    if arch == "phi3":  # lengths on both sides of the original context
        prompts[0], prompts[1] = prompts[0][:20] * 2, (prompts[1] * 9)[:28]
    lora = LoRARequest("a", 1, str(adapter))
    mixed = [lora if k % 2 else None for k in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True)
              if k % 3 else
              SamplingParams(temperature=0.9, top_p=0.95, seed=5 + k, max_tokens=10,
                             logprobs=0, ignore_eos=True) for k in range(n)]
    llm = make_llm(base)
    alone = [llm.generate(p, s, m, use_tqdm=False)[0]
             for p, s, m in zip(prompts, params, mixed, strict=True)]

    def check(outs, ref):
        bad = [k for k, (a, b) in enumerate(zip(outs, ref, strict=True))
               if not same_outputs(a, b)]
        assert not bad, f"{arch}: outputs {bad} differ"

    check(llm.generate(prompts, params, mixed, use_tqdm=False), alone)
    llm.engine.run_ahead = True  # the GPU's default: steps launched before the last is read
    check(llm.generate(prompts, params, mixed, use_tqdm=False), alone)
    assert llm.engine.num_steps_ahead > 0
    llm.engine.run_ahead = False
    rev = list(reversed(range(n)))
    check(llm.generate([prompts[k] for k in rev], [params[k] for k in rev],
                       [mixed[k] for k in rev], use_tqdm=False), [alone[k] for k in rev])
    budget, pages = TIGHT[arch]
    tight = make_llm(base, max_num_batched_tokens=budget, num_kv_blocks=pages, block_size=4)
    check(tight.generate(prompts, params, mixed, use_tqdm=False), alone)
    assert tight.engine.scheduler.num_preemptions > 0
    cached = make_llm(base, enable_prefix_caching=True, block_size=4)
    check(cached.generate(prompts, params, mixed, use_tqdm=False), alone)
    again = cached.generate(prompts, params, mixed, use_tqdm=False)
    check(again, alone)
    assert sum(o.num_cached_tokens for o in again) > 0
    if arch == "phi3":
        assert tight.engine.scheduler.num_offset_recomputes > 0
        # Pages rotated with the short factors are never served to a sequence that reads
        # the long ones: a long prompt sharing a short one's first 24 tokens takes none.
        short = list(range(40, 64))
        long = short + list(range(70, 86))
        sp = SamplingParams(temperature=0.0, max_tokens=2, logprobs=0, ignore_eos=True)
        cached.generate(short, sp, use_tqdm=False)
        assert cached.generate(short, sp, use_tqdm=False)[0].num_cached_tokens == 20
        out = cached.generate(long, sp, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        check([out], llm.generate(long, sp, use_tqdm=False))


def test_window_holding_the_context_is_full_attention(tmp_path):
    """sliding_window 48 at max_model_len 48: every window holds the whole sequence, so the
    layers run full attention on one plain KV group, with transformers' tokens; at the
    default 128 the window is applied."""
    from detlora.engine.sched.block_manager import BlockManager
    from detlora.engine.sched.grouped_block_manager import GroupedBlockManager

    base = make_base_checkpoint(tmp_path / "m", "mistral", sliding_window=48)
    assert isinstance(LLM(str(base), device="cpu").engine.block_manager, GroupedBlockManager)
    llm = LLM(str(base), device="cpu", max_model_len=48)
    assert [g.window for g in llm.engine.model.kv_groups] == [None]
    assert type(llm.engine.block_manager) is BlockManager
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (30, 12)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=17,
                                                ignore_eos=True), use_tqdm=False)
    # transformers applies the 48-key window: over 47 tokens it is every key.
    want = hf_greedy(base, None, prompts, 17)
    assert [o.outputs[0].token_ids for o in outs] == [toks for toks, _ in want]
