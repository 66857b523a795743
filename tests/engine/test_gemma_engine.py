"""Gemma 4 and Gemma 3 through the engine at batch_invariant, bit for bit: a request alone is
the reference; in a batch of base and adapter requests, in reversed order, with chunked
prefill cutting across the sliding window's edge, after preemption, with prefix-cache hits
(whose window groups get only the window's pages) and with steps launched ahead, it gives the
same token ids and logprobs. Also: the window groups' pages all come back and stay within
their bound, and adapters that would change what a KV-shared layer reads are refused.
"""

from __future__ import annotations

import pytest
from tests.helpers.engine_outputs import same_outputs
from tests.helpers.tiny_gemma import (
    PLE_TARGETS,
    TEXT_TARGETS,
    make_gemma3,
    make_gemma4,
    make_gemma_adapter,
)

from detlora.config import SamplingParams
from detlora.engine.sched.grouped_block_manager import GroupedBlockManager
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

N = 4


def _prompts(seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = [3, 12, 26, 17][:N]  # around and past the window of 8
    return [torch.randint(3, 110, (n,), generator=g).tolist() for n in lens]


def make_llm(path, **kw) -> LLM:
    args = dict(device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8,
                enable_prefix_caching=False)
    return LLM(str(path), **{**args, **kw})


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4_engine")
    base = make_gemma4(root / "base")
    ad = make_gemma_adapter(base, root / "ad", targets=TEXT_TARGETS + PLE_TARGETS)
    lora = LoRARequest("a", 1, str(ad))
    prompts = _prompts(seed=5)
    mixed = [lora if k % 2 else None for k in range(N)]
    params = [SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
              if k % 2 == 0 else
              SamplingParams(max_tokens=6, logprobs=0, ignore_eos=True, temperature=0.9,
                             top_p=0.95, seed=70 + k) for k in range(N)]
    llm = make_llm(base)
    alone = [llm.generate(prompts[k], params[k], mixed[k], use_tqdm=False)[0]
             for k in range(N)]
    return base, ad, llm, prompts, params, mixed, alone


def assert_same(outs, ref):
    bad = [k for k, (a, b) in enumerate(zip(outs, ref, strict=True)) if not same_outputs(a, b)]
    assert not bad, f"outputs {bad} differ from the reference"


def _pools_full(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert isinstance(bm, GroupedBlockManager)
    assert [p.num_free for p in bm.pools] == [p.num_blocks for p in bm.pools]


def test_outputs_are_real_and_batches_repeat_them(case):
    _, _, llm, prompts, params, mixed, alone = case
    assert all(len(o.outputs[0].token_ids) == 6 for o in alone)
    base = llm.generate(prompts[1], params[1], None, use_tqdm=False)[0]
    assert base.outputs[0].logprobs != alone[1].outputs[0].logprobs  # the adapter matters
    assert_same(llm.generate(prompts, params, mixed, use_tqdm=False), alone)
    order = list(reversed(range(N)))
    outs = llm.generate([prompts[k] for k in order], [params[k] for k in order],
                        [mixed[k] for k in order], use_tqdm=False)
    assert_same(outs, [alone[k] for k in order])
    _pools_full(llm)


def test_chunks_across_the_window_edge_and_steps_launched_ahead(case):
    base, _, _, prompts, params, mixed, alone = case
    chunked = make_llm(base, max_num_batched_tokens=5, block_size=4)
    chunked.engine.run_ahead = True  # the CPU steps one at a time unless told
    assert_same(chunked.generate(prompts, params, mixed, use_tqdm=False), alone)
    assert chunked.engine.num_steps_ahead > 0
    _pools_full(chunked)


def test_preemption_and_window_bound(case):
    base, _, _, prompts, params, mixed, alone = case
    small = make_llm(base, num_kv_blocks=10, block_size=4, max_num_batched_tokens=16,
                     max_num_seqs=4)
    bm = small.engine.block_manager
    # The window group's pool: every running sequence's window plus a step's new tokens.
    assert bm.windows == (None, 8) and bm.pools[1].num_blocks == 4 * (2 + 2) + 4
    outs = small.generate(prompts, params, mixed, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert_same(outs, alone)
    _pools_full(small)


def test_prefix_cache_hits_give_the_same_bits(case):
    base, _, _, prompts, params, mixed, alone = case
    cached = make_llm(base, enable_prefix_caching=True, block_size=4)
    first = cached.generate(prompts, params, mixed, use_tqdm=False)
    again = cached.generate(prompts, params, mixed, use_tqdm=False)
    assert_same(first, alone)
    assert_same(again, alone)
    hits = [o.num_cached_tokens for o in again]
    assert hits == [(len(p) - 1) // 4 * 4 for p in prompts]  # every full page but the last
    # A second turn: the first turn's prompt and output, then more; hits the first's pages.
    turn = [p + list(o.outputs[0].token_ids) + [7, 8, 9] for p, o in zip(prompts, alone,
                                                                        strict=True)]
    fresh = make_llm(base)
    want = [fresh.generate(t, params[k], mixed[k], use_tqdm=False)[0]
            for k, t in enumerate(turn)]
    got = cached.generate(turn, params, mixed, use_tqdm=False)
    assert_same(got, want)
    assert all(o.num_cached_tokens > 0 for o in got[2:])
    _pools_full(cached)


def test_gemma3_batch_chunks_and_preemption(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3_engine")
    base = make_gemma3(root / "base")
    ad = make_gemma_adapter(base, root / "ad", targets=TEXT_TARGETS)
    lora = LoRARequest("a", 1, str(ad))
    prompts = _prompts(seed=9)[:4]
    mixed = [lora if k % 2 else None for k in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
    llm = make_llm(base)
    alone = [llm.generate(p, sp, m, use_tqdm=False)[0] for p, m in zip(prompts, mixed,
                                                                       strict=True)]
    assert_same(llm.generate(prompts, sp, mixed, use_tqdm=False), alone)
    tight = make_llm(base, num_kv_blocks=9, block_size=4, max_num_batched_tokens=5)
    assert_same(tight.generate(prompts, sp, mixed, use_tqdm=False), alone)
    assert tight.engine.scheduler.num_preemptions > 0
    _pools_full(tight)


def test_adapter_with_kv_deltas_on_a_shared_layer_is_refused(case, tmp_path):
    from safetensors.torch import load_file, save_file

    _, ad, llm, prompts, params, _, _ = case
    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_file(str(ad / "adapter_model.safetensors"))
    for ab, shape in (("A", (8, 96)), ("B", (32, 8))):  # layer 4 reads layer 3's K/V
        tensors[f"base_model.model.model.layers.4.self_attn.k_proj.lora_{ab}.weight"] = \
            tensors[f"base_model.model.model.layers.3.self_attn.k_proj.lora_{ab}.weight"].clone()
        assert tuple(tensors[f"base_model.model.model.layers.4.self_attn.k_proj.lora_{ab}"
                             ".weight"].shape) == shape
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    (bad / "adapter_config.json").write_text((ad / "adapter_config.json").read_text())
    out = llm.generate(prompts[0], params[0], LoRARequest("bad", 9, str(bad)),
                       use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error"
    assert "layers.4.self_attn.k_proj" in out.outputs[0].error
    assert "layer 4 is a KV-shared layer: it reads the keys and values of layer 3" in \
        out.outputs[0].error


def test_introspection_reads_every_groups_kv(case):
    """``read_kv`` takes every KV group's slots and pads the layers' two head sizes; the
    engine continued from its own K/V (``continue_from_kv``) gives its own tokens."""
    import torch

    from detlora.engine.introspect import continue_from_kv, observe, read_kv

    base, ad, _, prompts, _, _, _ = case
    llm = make_llm(base, block_size=4)
    engine, lora = llm.engine, LoRARequest("a", 1, str(ad))
    ks, vs = [], []

    def on_step(step, logits):
        k, v = read_kv(engine, step.slot_mapping, step.group_slot_mapping)
        ks.append(k)
        vs.append(v)

    greedy = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    prompt = prompts[2]  # 26 tokens: past the window of 8
    with observe(engine, on_step=on_step):
        tokens = llm.generate(prompt, greedy, lora, use_tqdm=False)[0].outputs[0].token_ids
    k, v = torch.cat(ks, dim=1), torch.cat(vs, dim=1)
    assert tuple(k.shape) == (6, len(prompt) + 6, 2, 32)  # sliding layers padded 16 -> 32
    assert torch.equal(k[0, :, :, 16:], torch.zeros_like(k[0, :, :, 16:]))
    assert torch.equal(k[4], k[3]) and torch.equal(v[5], v[2])  # KV-shared layers' sources
    cut = len(prompt) + 3
    got = continue_from_kv(engine, prompt + tokens[:4], k[:, :cut], v[:, :cut], lora=lora,
                           max_tokens=3)
    assert [t.token_id for t in got] == tokens[4:]
    again = llm.generate(prompt, greedy, lora, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == tokens
