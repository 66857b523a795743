"""Qwen2 (q/k/v biases; sliding windows on layers 1-2, layer 0 full), Mistral (head_dim 80,
apart from hidden / heads; a window on every layer) and Phi-3 (head_dim 96 as in
Phi-3-mini; fused qkv_proj / gate_up_proj, an adapter on the fused modules, LongRoPE with
prompts on both sides of the original context, a window on every layer) on CUDA in bf16,
windows shorter than most prompts: every level generates; at batch_invariant each
request's token ids and logprobs are the same bits alone and in batches of 4 and 16, reversed,
eager or with CUDA graphs (run ahead), chunked with preemption, and from the prefix cache;
the base model's logprobs are transformers' (fp32) within bf16's error.

Checkpoints are written by transformers at widths real models have (hidden 576, MLP 1536),
adapters (rank 16, every projection) directly. Bits are compared with ==.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_hf import (
    ALL_TARGETS,
    BASES,
    FUSED_TARGETS,
    longrope_parameters,
    make_base_checkpoint,
    write_random_adapter,
)

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

pytestmark = pytest.mark.gpu

VOCAB, ORIGINAL = 2000, 64
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=3,
             num_attention_heads=9, num_key_value_heads=3, vocab_size=VOCAB,
             max_position_embeddings=512, initializer_range=0.05)
EXTRA = {"qwen2": dict(use_sliding_window=True, sliding_window=48, max_window_layers=1),
         "mistral": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=80,
                         sliding_window=40),
         "phi3": dict(num_attention_heads=6, num_key_value_heads=2, sliding_window=56,
                      rope_parameters=longrope_parameters(96, ORIGINAL),
                      original_max_position_embeddings=ORIGINAL)}
GROUP_WINDOWS = {"qwen2": [None, 48], "mistral": [40], "phi3": [56]}  # the KV groups' windows


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    made: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in made:
            root = tmp_path_factory.mktemp(f"bases-{arch}")
            base = make_base_checkpoint(root / "base", arch, **{**SHAPE, **EXTRA[arch]})
            targets = FUSED_TARGETS if arch == "phi3" else ALL_TARGETS
            loras = [LoRARequest(f"a{k}", k + 1, str(write_random_adapter(
                base, root / f"a{k}", r=16, alpha=32, targets=targets, seed=10 + k)))
                for k in range(2)]
            g = torch.Generator().manual_seed(3)
            # Phi-3: some start past the original context, some grow past it.
            lengths = torch.randint(5, 120, (16,), generator=g).tolist()
            prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]
            made[arch] = base, loras, prompts
        return made[arch]

    return get


def _params(n: int, max_tokens: int = 24) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
            if k % 2 == 0 else
            SamplingParams(max_tokens=max_tokens, logprobs=0, ignore_eos=True, temperature=0.8,
                           top_p=0.95, seed=k) for k in range(n)]


def _llm(base, **kw) -> LLM:
    args = dict(enable_lora=True, max_loras=2, max_lora_rank=16, device="cuda",
                dtype="bfloat16", max_num_seqs=32, num_kv_blocks=512,
                enable_prefix_caching=False)
    return LLM(str(base), **{**args, **kw})


def _diff(a, b) -> list[int]:
    return [k for k, (x, y) in enumerate(zip(a, b, strict=True))
            if x.outputs[0].token_ids != y.outputs[0].token_ids
            or x.outputs[0].logprobs != y.outputs[0].logprobs]


def _batched(llm, prompts, params, loras, size):
    out = []
    for lo in range(0, len(prompts), size):
        out += llm.generate(prompts[lo:lo + size], params[lo:lo + size], loras[lo:lo + size],
                            use_tqdm=False)
    return out


@pytest.mark.parametrize("arch", BASES)
def test_batch_invariant_in_every_condition(assets, arch):
    base, loras, prompts = assets(arch)
    n = len(prompts)
    params, mixed = _params(n), [loras[k % 2] if k % 3 else None for k in range(n)]
    llm = _llm(base, determinism="batch_invariant")
    assert llm.engine.runner.uses_cuda_graphs, llm.engine.runner.graph_error
    assert [g.window for g in llm.engine.model.kv_groups] == GROUP_WINDOWS[arch]
    ref = _batched(llm, prompts, params, mixed, 1)
    for size in (4, 16):
        assert _diff(_batched(llm, prompts, params, mixed, size), ref) == [], size
    assert llm.engine.num_steps_ahead > 0
    order = list(range(n))[::-1]
    rev = llm.generate([prompts[k] for k in order], [params[k] for k in order],
                       [mixed[k] for k in order], use_tqdm=False)
    assert _diff(rev, [ref[k] for k in order]) == []
    if arch == "phi3":
        assert llm.engine.scheduler.num_offset_recomputes > 0
    del llm
    eager = _llm(base, determinism="batch_invariant", enforce_eager=True)
    assert _diff(eager.generate(prompts, params, mixed, use_tqdm=False), ref) == []
    del eager
    small = _llm(base, determinism="batch_invariant", num_kv_blocks=24, block_size=16,
                 max_num_batched_tokens=64)
    assert _diff(small.generate(prompts, params, mixed, use_tqdm=False), ref) == []
    assert small.engine.scheduler.num_preemptions > 0
    del small
    cached = _llm(base, determinism="batch_invariant", enable_prefix_caching=True)
    first = cached.generate(prompts, params, mixed, use_tqdm=False)
    again = cached.generate(prompts, params, mixed, use_tqdm=False)
    assert _diff(first, ref) == [] and _diff(again, ref) == []
    assert sum(o.num_cached_tokens for o in again) > 0


@pytest.mark.parametrize("arch", BASES)
@pytest.mark.parametrize("level", ["fast", "run_to_run"])
def test_other_levels_generate(assets, arch, level):
    base, loras, prompts = assets(arch)
    mixed = [loras[k % 2] if k % 3 else None for k in range(len(prompts))]
    llm = _llm(base, determinism=level)
    outs = llm.generate(prompts, _params(len(prompts)), mixed, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert len({o.fingerprint for o in outs}) == 3
    if level == "run_to_run":
        again = llm.generate(prompts, _params(len(prompts)), mixed, use_tqdm=False)
        assert _diff(outs, again) == []


@pytest.mark.parametrize("arch", BASES)
def test_base_logprobs_are_transformers_within_bf16(assets, arch):
    """Greedy base requests: the engine's logprob of each chosen token against transformers
    in fp32 on the same tokens (Phi-3: sequences that stay on one side of the original
    context, where one forward over the whole sequence is what generate computes)."""
    from transformers import AutoModelForCausalLM

    base, _, prompts = assets(arch)
    picked = [p for p in prompts if len(p) + 24 <= ORIGINAL or len(p) > ORIGINAL][:6]
    sp = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0, ignore_eos=True)
    outs = _llm(base, determinism="batch_invariant").generate(picked, sp, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    worst = 0.0
    for p, o in zip(picked, outs, strict=True):
        toks = o.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([p + toks])).logits[0].float()
        lps = torch.log_softmax(logits, -1)[len(p) - 1: -1].gather(1, torch.tensor(toks)[:, None])
        got = torch.tensor([next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
        worst = max(worst, float((lps[:, 0] - got).abs().max()))
    assert worst < 0.25, worst  # a dropped bias or wrong rotary is off by far more
