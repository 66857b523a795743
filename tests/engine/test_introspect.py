"""The engine's read-only views: shrink outputs and steps observed, K/V read back, and greedy
decoding continued from a given KV cache (the study's controlled experiment)."""

from __future__ import annotations

import pytest
import torch

from detlora import LLM, LoRARequest, SamplingParams
from detlora.engine.introspect import continue_from_kv, observe, read_kv

PROMPT = [5, 9, 17, 33, 2, 8, 40, 41, 3, 77, 12]
FOUR_GREEDY = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
EIGHT_GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)


def _llm(llama_dir, **kw) -> LLM:
    return LLM(str(llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8,
               determinism="batch_invariant", enable_prefix_caching=False, max_num_seqs=4,
               block_size=4, **kw)


def test_observe_reports_every_lora_layer_per_step_and_the_kv_written(llama_dir, llama_adapters):
    llm = _llm(llama_dir)
    lora = LoRARequest("a", 1, str(llama_adapters[0]))
    shrinks: list[tuple[int, str, torch.Tensor]] = []
    steps: list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    engine = llm.engine

    def on_step(step, logits):
        k, v = read_kv(engine, step.slot_mapping)
        steps.append((list(step.positions), k, v, logits))

    with observe(engine, on_shrink=lambda name, h: shrinks.append((engine.num_steps, name, h)),
                 on_step=on_step):
        out = llm.generate([PROMPT], FOUR_GREEDY, lora,
                           use_tqdm=False)[0]
    # 2 layers x (qkv, o, gate_up, down) per step; 4 steps (a prefill and 3 decodes).
    names = [n for s, n, _ in shrinks if s == engine.num_steps]
    assert names == [f"model.layers.{i}.{p}" for i in range(2) for p in
                     ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                      "mlp.down_proj")]
    assert len(shrinks) == 4 * 8 and len(steps) == 4
    first = [h for s, _, h in shrinks if s == shrinks[0][0]]
    assert first[0].shape == (3, len(PROMPT), 8) and first[0].dtype == torch.float32
    assert first[0].abs().sum() > 0  # the adapter's A is not zero
    assert steps[0][0] == list(range(len(PROMPT)))
    assert [s[0] for s in steps[1:]] == [[len(PROMPT)], [len(PROMPT) + 1], [len(PROMPT) + 2]]
    k, v = steps[0][1], steps[0][2]
    assert k.shape == (2, len(PROMPT), 2, 16) and k.abs().sum() > 0 and v.abs().sum() > 0
    # The logits of each step pick the token the engine returned (greedy).
    assert [int(torch.argmax(s[3][0].float())) for s in steps] == out.outputs[0].token_ids
    # Closing the context removes every hook.
    assert all("lora_observer" not in lin.__dict__ for lin, _ in engine.model.lora_linears())
    assert "execute" not in engine.runner.__dict__


def test_continue_from_its_own_kv_gives_the_engines_tokens(llama_dir, llama_adapters):
    llm = _llm(llama_dir)
    lora = LoRARequest("a", 1, str(llama_adapters[0]))
    engine = llm.engine
    ks, vs = [], []

    def on_step(step, logits):
        k, v = read_kv(engine, step.slot_mapping)
        ks.append(k)
        vs.append(v)

    with observe(engine, on_step=on_step):
        out = llm.generate([PROMPT], EIGHT_GREEDY, lora,
                           use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    k, v = torch.cat(ks, dim=1), torch.cat(vs, dim=1)  # positions 0 .. len(PROMPT) + 6
    cut = len(PROMPT) + 3  # continue after 4 generated tokens: 3 of them are in the cache
    ids = PROMPT + tokens[:4]
    got = continue_from_kv(engine, ids, k[:, :cut], v[:, :cut], lora=lora, max_tokens=4)
    assert [t.token_id for t in got] == tokens[4:]
    # Another cache changes what follows: the K/V of a different prompt.
    other = continue_from_kv(engine, ids, torch.flip(k[:, :cut], [1]),
                             torch.flip(v[:, :cut], [1]), lora=lora, max_tokens=4)
    assert [float(t.logits.max()) for t in other] != [float(t.logits.max()) for t in got]
    # The engine still serves requests afterwards, with the same bits.
    again = llm.generate([PROMPT], EIGHT_GREEDY, lora,
                         use_tqdm=False)[0]
    assert again.outputs[0].token_ids == tokens


def test_continue_from_kv_rejects_bad_shapes_and_a_busy_engine(llama_dir):
    llm = _llm(llama_dir)
    engine = llm.engine
    k = torch.zeros(2, 3, 2, 16)
    with pytest.raises(ValueError, match="shape"):
        continue_from_kv(engine, [1, 2, 3], k, k)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
    with pytest.raises(ValueError, match="idle"):
        continue_from_kv(engine, [1, 2, 3, 4], k, k)


def test_observing_shrinks_needs_lora_layers(llama_dir):
    llm = LLM(str(llama_dir), determinism="batch_invariant")
    with pytest.raises(ValueError, match="no LoRA layers"), observe(
            llm.engine, on_shrink=lambda name, h: None):
        pass
