"""The trace finds a divergence and follows it into the layers: a test plants one by changing
one layer's LoRA A between two runs (on the CPU nothing diverges by itself)."""

from __future__ import annotations

import torch

from detlora import LLM, LoRARequest, SamplingParams
from detlora.study import trace
from detlora.study.tasks import ARITHMETIC, Task

PROMPTS = [[5, 9, 17, 33, 2, 8, 40, 41, 3, 77, 12, 19], [60, 61, 2, 9, 9, 14, 100, 3],
           [7, 7, 7, 20, 21, 22, 23, 90]]


def _llm(llama_dir, level: str, reduction: str) -> LLM:
    return LLM(str(llama_dir), enable_lora=True, max_loras=1, max_lora_rank=8,
               determinism=level, lora_reduction=reduction, enable_prefix_caching=False,
               max_num_seqs=4, enforce_eager=True)


def test_a_planted_difference_is_found_traced_and_replayed(llama_dir, llama_adapters):
    lora = LoRARequest("a", 1, str(llama_adapters[0]))
    loras = [lora] * len(PROMPTS)
    llm = _llm(llama_dir, "fast", "atomic")
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    target = llm.engine.model.layers[0].mlp.gate_up_proj.lora
    saved: dict[str, torch.Tensor] = {}

    def before_run(run: int) -> None:
        if "a" in saved:
            target.lora_a.copy_(saved.pop("a"))
        if run == 2:  # the third repetition: layer 0's gate|up shrink changes
            saved["a"] = target.lora_a.clone()  # the adapter is loaded by now
            target.lora_a.mul_(1.5)

    # Without a plant, nothing diverges on the CPU.
    found, runs = trace.find_divergence(llm, PROMPTS, loras, params, repetitions=2)
    assert found is None and runs == 2
    div, runs = trace.find_divergence(llm, PROMPTS, loras, params, repetitions=4,
                                      before_run=before_run)
    before_run(0)  # restore
    assert div is not None, "a 1.5x LoRA A in layer 0 should change some token"
    assert div.pair == (0, 2) and runs == 3
    j = div.token_index
    assert div.run_a.token_ids[:j] == div.run_b.token_ids[:j]
    assert div.run_a.token_ids[j] != div.run_b.token_ids[j]

    d = trace.describe_divergence(div, 2, lambda ids: " ".join(map(str, ids)))
    first = d["first_shrink_difference"]
    assert first["step"] == 0 and first["layer_name"] == "model.layers.0.mlp.gate_up_proj"
    assert first["value_a"] != first["value_b"]
    layer0, layer1 = d["layers"]
    # Layer 0's K/V come from the embeddings only: equal until the tokens differ.
    assert layer0["k_differing"] == layer0["v_differing"] == 0 and layer0["shrink_differing"]
    assert layer1["k_differing"] and layer1["v_differing"] and layer1["k_max_abs"] > 0
    assert d["position"] == len(PROMPTS[div.prompt_index]) + j
    assert d["kv_positions_compared"] == d["position"]
    la, lb = d["logits_run_a"], d["logits_run_b"]
    assert la["chosen"] == d["token_a"]["id"] and lb["chosen"] == d["token_b"]["id"]
    assert la["margin"] >= 0 >= lb["margin"]

    det = _llm(llama_dir, "run_to_run", "unsplit")
    task = Task(ARITHMETIC, "q", answer="7")
    c = trace.controlled_experiment(det, div, PROMPTS[div.prompt_index], lora, 16, (),
                                    lambda ids: " ".join(map(str, ids)), task)
    a, b = c["from_cache_a"], c["from_cache_b"]
    assert a["repeatable"] and b["repeatable"] and c["trials"] == 2
    if j > 0:  # the last shared token was a decode step in run A too: the same bits here
        assert a["token"]["id"] == d["token_a"]["id"]
    assert (a["logit_a"], a["logit_b"]) != (b["logit_a"], b["logit_b"])
    assert c["token_changed_by_cache"] == (a["token"]["id"] != b["token"]["id"])
    assert "answer" in a and "correct" in a


def test_traced_batch_records_each_sequence_once_per_step(llama_dir, llama_adapters):
    lora = LoRARequest("a", 1, str(llama_adapters[0]))
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=1, max_lora_rank=8,
              determinism="batch_invariant", enable_prefix_caching=False, max_num_seqs=4,
              max_num_batched_tokens=16)  # prefills in chunks beside the decodes
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
    runs = trace.traced_batch(llm, PROMPTS, [lora] * 3, params)
    for p, run in zip(PROMPTS, runs, strict=True):
        assert len(run.token_ids) == 5 and len(run.top) == 5
        n = len(p) + 4
        k, v = run.kv_until(n)
        assert k.shape == v.shape == (2, n, 2, 16)
        assert [next(iter(z)) for z in run.top] == run.token_ids
        assert all(h.shape[1] == len(pos) for hs, pos in zip(run.shrinks, run.step_positions,
                                                             strict=True) for h in hs.values())
        # The same prompt alone: the same tokens, shrink rows and K/V (batch_invariant).
        alone = trace.traced_batch(llm, [p], [lora], params)[0]
        assert alone.token_ids == run.token_ids
        assert torch.equal(alone.kv_until(n)[0], k) and torch.equal(alone.kv_until(n)[1], v)
