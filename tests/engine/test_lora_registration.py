"""Adapters registered by path on the engine, served by id, removed; their traffic counters."""

from __future__ import annotations

import pytest
from tests.helpers.engine_outputs import random_prompts, same_outputs

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

SP = SamplingParams(max_tokens=4, logprobs=0, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8, device="cpu",
               max_model_len=64)


def test_register_then_serve(llm, llama_adapters, tmp_path):
    reqs = [LoRARequest(f"reg{k}", 40 + k, str(p)) for k, p in enumerate(llama_adapters)]
    before = llm.engine.lora_stats.disk_loads
    for r in reqs:
        llm.register_lora(r)
    assert {40, 41} <= llm.list_loras()
    assert llm.engine.lora_stats.disk_loads == before  # registering reads nothing
    assert [r for r in llm.engine.registered_loras() if r.id >= 40] == reqs
    prompt = random_prompts(1, seed=3)[0]
    out = llm.generate(prompt, SP, reqs[0], use_tqdm=False)[0]
    stats = llm.engine.lora_stats
    assert stats.disk_loads == before + 1 and stats.slot_misses >= 1
    again = llm.generate(prompt, SP, reqs[0], use_tqdm=False)[0]
    assert same_outputs(out, again)
    assert llm.engine.lora_stats.slot_hits >= 1
    with pytest.raises(ValueError, match="one id must name one adapter"):
        llm.generate(prompt, SP, LoRARequest("reg0", 40, str(tmp_path)), use_tqdm=False)
    assert llm.remove_lora(40) and 40 not in llm.list_loras() and not llm.remove_lora(40)
    # The id is free again: it may name the other adapter now.
    llm.register_lora(LoRARequest("reg0b", 40, str(llama_adapters[1])))
    moved = llm.generate(prompt, SP, LoRARequest("reg0b", 40, str(llama_adapters[1])),
                         use_tqdm=False)[0]
    other = llm.generate(prompt, SP, reqs[1], use_tqdm=False)[0]
    assert same_outputs(moved, other)


def test_remove_refused_while_in_use(llm, llama_adapters):
    r = LoRARequest("busy", 50, str(llama_adapters[0]))
    llm.register_lora(r)
    llm.engine.add_request(random_prompts(1, seed=4)[0], SP, lora=r)
    with pytest.raises(ValueError, match="in use by unfinished requests"):
        llm.remove_lora(50)
    llm.engine.abort_all()
    assert llm.remove_lora(50)


def test_register_errors(llm, llama_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        llm.register_lora(LoRARequest("gone", 60, str(tmp_path / "gone")))
    plain = LLM(str(llama_dir), device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match="enable_lora=False"):
        plain.register_lora(LoRARequest("x", 1, str(tmp_path)))
    assert plain.list_loras() == set() and plain.engine.lora_stats is None
