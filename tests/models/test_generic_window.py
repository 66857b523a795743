"""A sliding window is a per-layer parameter any model can set: a Llama-architecture spec with
``LayerAttention(window=8)`` on every layer computes what HF's Mistral computes with
``sliding_window=8`` (same weight names), and through the engine (every layer in one window
group: ``GroupedBlockManager`` with group 0 windowed) its requests keep their bits alone, in
a batch, chunked and after preemption. This is what Mistral and Qwen2 configs need to map
their windows onto (tests/models/test_gemma_*.py cover Gemma)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.helpers.engine_outputs import same_outputs
from tests.helpers.tiny_gemma import GroupedPagedKV
from tests.helpers.tiny_hf import HFReference, rel_err

from detlora.models.layer_spec import LayerAttention, RopeSpec
from detlora.models.spec import ModelSpec

WINDOW = 8


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=128, hidden_size=96, intermediate_size=160,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=24, sliding_window=WINDOW, max_position_embeddings=256,
                        initializer_range=0.1, rope_theta=1e4, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("mistral")
    MistralForCausalLM(cfg).eval().save_pretrained(str(path))
    return path


@pytest.fixture
def windowed(monkeypatch, mistral_dir):
    """ModelSpec.from_dir reads the checkpoint as a Llama with a window on every layer."""
    import json

    raw = json.loads((mistral_dir / "config.json").read_text())
    cfg = {k: v for k, v in raw.items() if k not in ("sliding_window", "model_type")}
    cfg["architectures"] = ["LlamaForCausalLM"]
    spec = ModelSpec.from_config(cfg)
    rope = RopeSpec(spec.rope_theta, spec.rope_scaling)
    spec = dataclasses.replace(spec, layer_attention=tuple(
        LayerAttention(spec.head_dim, spec.num_kv_heads, rope, window=WINDOW)
        for _ in range(spec.num_layers)))
    monkeypatch.setattr(ModelSpec, "from_dir", classmethod(lambda cls, path: spec))
    return spec


def test_logits_match_hf_mistral(windowed, mistral_dir):
    from detlora.models.loader import load_model

    model = load_model(mistral_dir)
    assert [g.window for g in model.kv_groups] == [WINDOW]
    ids = torch.randint(3, 120, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        got = model(GroupedPagedKV(model, 16, 4).step({0: ids}))
    assert rel_err(got, HFReference(mistral_dir).logits(ids)) < 1e-4


def test_engine_bits_with_a_windowed_group_zero(windowed, mistral_dir):
    from detlora.config import SamplingParams
    from detlora.engine.sched.grouped_block_manager import GroupedBlockManager
    from detlora.entrypoints.llm import LLM

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 120, (n,), generator=g).tolist() for n in (5, 13, 27, 19)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
    llm = LLM(str(mistral_dir), device="cpu", block_size=4)
    assert isinstance(llm.engine.block_manager, GroupedBlockManager)
    alone = [llm.generate(p, sp, use_tqdm=False)[0] for p in prompts]
    # In one batch, in chunks of 6 tokens, in a 9-page pool: four sequences of up to 33
    # tokens take turns (pages behind the window go back as the windows move).
    other = LLM(str(mistral_dir), device="cpu", block_size=4, max_num_batched_tokens=6,
                num_kv_blocks=9)
    outs = other.generate(prompts, sp, use_tqdm=False)
    assert all(same_outputs(a, b) for a, b in zip(outs, alone, strict=True))
    pool = other.engine.block_manager.pools[0]
    assert pool.num_free == pool.num_blocks  # every page came back
