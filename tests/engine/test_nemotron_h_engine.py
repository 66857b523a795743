"""Nemotron-H through the engine on the CPU: greedy outputs equal transformers' generate (+
PEFT) token for token, base and adapter requests in one batch; and at batch_invariant every
request's tokens and logprobs are the same bits alone, in a batch, in another order, with its
prompt in one step or cut at the token budget or on the chunk grid, after preemption and
recompute, and when its prompt holds tokens another run decoded (decode == prefill)."""

from __future__ import annotations

import logging

import pytest
import torch
from tests.helpers.engine_outputs import same_outputs
from tests.helpers.tiny_nemotron_h import (
    hf_greedy,
    hf_model,
    make_nemotron_adapter,
    make_nemotron_h,
)

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

MAX_TOKENS = 12
# Lengths around the chunk size (8): inside one chunk, on its end, across several.
PROMPTS = [[(7 * i + 3 * j) % 120 + 2 for j in range(n)] for i, n in enumerate([11, 19, 5, 8,
                                                                                 17, 9])]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("nemotron_engine")
    base = make_nemotron_h(root / "base", seed=4)
    adapter = make_nemotron_adapter(base, root / "lora", seed=5)
    lora = LoRARequest("a", 1, str(adapter))
    mixed = [lora if k % 2 else None for k in range(len(PROMPTS))]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    llm = _llm(base)
    alone = [llm.generate(p, sp, m, use_tqdm=False)[0] for p, m in zip(PROMPTS, mixed,
                                                                        strict=True)]
    return base, adapter, mixed, sp, llm, alone


def _llm(base, **kw) -> LLM:
    args = dict(device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8)
    return LLM(str(base), **{**args, **kw})


def _assert_same(outs, ref):
    bad = [k for k, (a, b) in enumerate(zip(outs, ref, strict=True)) if not same_outputs(a, b)]
    assert not bad, f"outputs {bad} differ from the reference"


def test_greedy_matches_transformers_and_peft_in_one_batch(case):
    base, adapter, mixed, sp, llm, alone = case
    batch = llm.generate(PROMPTS, sp, mixed, use_tqdm=False)
    models = {None: hf_model(base), "a": hf_model(base, adapter=adapter)}
    for prompt, lora, out in zip(PROMPTS, mixed, batch, strict=True):
        tokens, logprobs = hf_greedy(models[lora and lora.name], prompt, MAX_TOKENS)
        assert out.outputs[0].token_ids == tokens
        mine = [out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(tokens)]
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(logprobs), rtol=0,
                                   atol=1e-4)
    # The adapter changes the outputs: the PEFT comparison is not the base one again.
    base_only = llm.generate(PROMPTS[1], sp, use_tqdm=False)[0]
    assert base_only.outputs[0].token_ids != alone[1].outputs[0].token_ids


def test_batch_order_and_repeat_keep_the_bits(case):
    _, _, mixed, sp, llm, alone = case
    _assert_same(llm.generate(PROMPTS, sp, mixed, use_tqdm=False), alone)
    order = [4, 1, 5, 0, 3, 2]
    outs = llm.generate([PROMPTS[k] for k in order], sp, [mixed[k] for k in order],
                        use_tqdm=False)
    _assert_same(outs, [alone[k] for k in order])


@pytest.mark.parametrize("kw", [
    dict(max_num_batched_tokens=5),  # prompts cut at the token budget, off the chunk grid
    dict(max_num_batched_tokens=8),  # ... at a multiple of the chunk size
    dict(enable_chunked_prefill=False, max_num_batched_tokens=256),
    dict(num_kv_blocks=14, block_size=4, max_num_batched_tokens=7),  # preemption, recompute
], ids=["budget", "grid", "whole", "preempt"])
def test_chunking_and_preemption_keep_the_bits(case, kw):
    base, _, mixed, sp, _, alone = case
    llm = _llm(base, **kw)
    _assert_same(llm.generate(PROMPTS, sp, mixed, use_tqdm=False), alone)
    blocks = llm.engine.block_manager
    if "num_kv_blocks" in kw:
        assert llm.engine.scheduler.num_preemptions > 0
    assert blocks.num_free == blocks.num_blocks  # pages and state slots all came back
    assert len(blocks._free_states) == blocks.num_state_slots


def test_decoded_tokens_prefilled_again_give_the_same_bits(case):
    """A long prompt decoded for 12 tokens, then prompt + its first k tokens prefilled:
    the later tokens and their logprobs, computed by decode steps in one run and by the
    prompt's prefill in the other, are the same bits (one chunk arithmetic)."""
    _, _, mixed, _, llm, alone = case
    for k in (1, 5, 8):  # ends inside a chunk, on its end, past it
        prompts = [p + a.outputs[0].token_ids[:k] for p, a in zip(PROMPTS, alone,
                                                                   strict=True)]
        rest = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - k, logprobs=1,
                              ignore_eos=True)
        outs = llm.generate(prompts, rest, mixed, use_tqdm=False)
        for out, ref in zip(outs, alone, strict=True):
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids[k:]
            assert out.outputs[0].logprobs == ref.outputs[0].logprobs[k:]


def test_prefix_caching_is_off_for_hybrids_and_says_why(case, caplog):
    base, _, mixed, sp, _, alone = case
    with caplog.at_level(logging.INFO, logger="detlora"):
        llm = _llm(base, enable_prefix_caching=True)
    assert not llm.engine.block_manager.enable_caching
    assert any("prefix caching is off" in r.getMessage() for r in caplog.records)
    twice = llm.generate(PROMPTS[:2] * 2, sp, mixed[:2] * 2, use_tqdm=False)
    _assert_same(twice, alone[:2] * 2)


def test_tensor_parallelism_is_refused(case):
    with pytest.raises(ValueError, match="tensor parallelism does not support hybrid"):
        _llm(case[0], tensor_parallel_size=2)


def test_state_room_names_the_most_sequences_that_fit():
    from detlora.engine.runner.kv_sizing import state_room

    class Model:
        def state_bytes_per_slot(self) -> int:
            return 80 * 2**20

    assert state_room(Model(), max_num_seqs=4, budget=2**30) == 400 * 2**20  # + padding slot
    with pytest.raises(ValueError, match="max_num_seqs=256 needs 20.08 GiB of Mamba-2 state"
                                         r".* to at most 11 "):
        state_room(Model(), max_num_seqs=256, budget=2**30)


def test_decode_graph_inputs_give_the_eager_bits(case):
    """What a decode graph replays (its static buffers staged for a step, padding rows on the
    spare state slot) computes, eagerly here, the logits and states of the eager step: a
    decode closing a chunk, one inside a chunk, and two padding rows."""
    from detlora.engine.runner.model_runner import ModelRunner
    from detlora.engine.runner.step_inputs import StepInputs
    from detlora.models.loader import load_model

    model = load_model(case[0])
    runner = ModelRunner(model, device=torch.device("cpu"), num_blocks=16, block_size=4,
                         max_num_seqs=6, max_model_len=64, num_adapters=None,
                         use_cuda_graphs=False)
    graphs, step_graphs = runner.build_graphs(6, 64)
    assert step_graphs is None  # hybrid prefills run eagerly
    tables = {0: [0, 1, 2, 3], 3: [4, 5, 6]}

    def step(chunks: dict[int, tuple[int, list[int]]]) -> StepInputs:
        ids, pos, slots, qsl, lens = [], [], [], [0], []
        for slot, (start, toks) in chunks.items():
            ids += toks
            pos += range(start, start + len(toks))
            slots += [tables[slot][p // 4] * 4 + p % 4 for p in range(start, start + len(toks))]
            qsl.append(qsl[-1] + len(toks))
            lens.append(start + len(toks))
        return StepInputs(ids, pos, slots, [-1] * len(ids), [tables[s] for s in chunks], lens,
                          qsl, [q - 1 for q in qsl[1:]], state_slots=list(chunks))

    with torch.no_grad():
        runner.model(runner.forward_batch(step({0: (0, PROMPTS[4][:15]),
                                                3: (0, PROMPTS[0][:10])})))
        decode = step({0: (15, [7]), 3: (10, [9])})  # position 15 closes the chunk 8..15
        saved = [t.clone() for t in (*runner.state_cache.ssm, *runner.state_cache.chunk,
                                     *runner.state_cache.conv)]
        eager = runner.model(runner.forward_batch(decode))
        after = [t[[0, 3]].clone() for t in (*runner.state_cache.ssm, *runner.state_cache.conv)]
        for t, s in zip((*runner.state_cache.ssm, *runner.state_cache.chunk,
                         *runner.state_cache.conv), saved, strict=True):
            t.copy_(s)
        graphs.stage(decode, 4)
        batch = graphs._batch(4)
        replayed = runner.model(batch)[:2]
    assert torch.equal(replayed, eager)
    again = [t[[0, 3]] for t in (*runner.state_cache.ssm, *runner.state_cache.conv)]
    assert all(torch.equal(x, y) for x, y in zip(again, after, strict=True))
    assert batch.mamba.state_slots.tolist() == [0, 3, 6, 6]  # padding: the spare slot
