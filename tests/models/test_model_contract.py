"""The model side of the engine contract: KV caches passed per call or bound once, fp32
logits, hidden_states/compute_logits, ModelSpec fields, and the HF-free checkpoint writers
that tests/gpu falls back on."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_hf import (
    HFReference,
    PagedKV,
    make_checkpoint,
    rel_err,
    write_random_adapter,
    write_random_checkpoint,
)

from detlora.lora import LoRAConfig, LoRARequest
from detlora.lora.manager import LoRAManager
from detlora.models.kv_cache import KVCache
from detlora.models.loader import load_model
from detlora.models.spec import ModelSpec


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("contract") / "qwen3", "qwen3")


def test_engine_allocated_kv_caches(qwen3):
    """forward(batch, kv_caches) with per-layer (k, v) pairs the engine allocated equals the
    model-allocated cache, bit for bit."""
    model = load_model(qwen3)
    spec = model.spec
    caches = [(torch.zeros(8, 4, spec.num_kv_heads, spec.head_dim),
               torch.zeros(8, 4, spec.num_kv_heads, spec.head_dim))
              for _ in range(spec.num_layers)]
    ids = list(range(3, 14))
    with torch.no_grad():
        a = model(PagedKV(8, 4).step({0: ids}), caches)
        assert caches[1][0].abs().sum() > 0  # the pages were written
        kv = model.allocate_kv_cache(8, 4)
        b = model(PagedKV(8, 4).step({0: ids}))
        c = model(PagedKV(8, 4).step({0: ids}), kv)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert len(kv) == spec.num_layers and kv.num_blocks == 8 and kv.block_size == 4


def test_logits_are_fp32_and_split_in_two_steps(qwen3):
    model = load_model(qwen3, dtype=torch.bfloat16)
    model.allocate_kv_cache(8, 4)
    batch = PagedKV(8, 4).step({0: list(range(9))}, logits="last")
    with torch.no_grad():
        logits = model(batch)
        model.allocate_kv_cache(8, 4)
        h = model.hidden_states(batch)
        again = model.compute_logits(h[batch.logits_indices])
        model.allocate_kv_cache(8, 4)
        head = model(batch, upcast=False)  # what the engine's sampler reads
    assert logits.dtype == torch.float32 and logits.shape == (1, model.spec.vocab_size)
    assert h.dtype == torch.bfloat16
    assert torch.equal(logits, again)
    assert head.dtype == torch.bfloat16 and torch.equal(head.float(), logits)
    assert torch.equal(model.compute_logits(h[batch.logits_indices], upcast=False), head)


def test_lora_config_reserves_slots(qwen3):
    cfg = LoRAConfig(max_loras=2, max_lora_rank=4)
    assert load_model(qwen3, lora_config=cfg).lora_config == cfg
    assert load_model(qwen3).lora_config is None
    assert load_model(qwen3).lora_config is None
    with pytest.raises(ValueError, match="max_lora_rank must be a positive int"):
        LoRAConfig(2, 0)


def test_kv_cache_checks(qwen3):
    model = load_model(qwen3)
    with pytest.raises(ValueError, match="no KV cache bound"):
        model(PagedKV(8, 4).step({0: [1, 2]}))
    with pytest.raises(ValueError, match="KV cache has 1 layers, the model 2"):
        model.bind_kv_cache([(torch.zeros(8, 4, 2, 32), torch.zeros(8, 4, 2, 32))])
    with pytest.raises(ValueError, match=r"k_cache must have shape \[num_blocks, block_size, 2, "
                                         r"32\]"):
        model.bind_kv_cache([(torch.zeros(8, 4, 2, 16), torch.zeros(8, 4, 2, 16))] * 2)
    with pytest.raises(ValueError, match="must be positive"):
        KVCache.allocate(model.spec, 0, 4, dtype=torch.float32, device="cpu")


def test_spec_fields(qwen3):
    spec = ModelSpec.from_dir(qwen3)
    assert spec.qk_norm and spec.head_dim == 32 and spec.q_size == 128 and spec.kv_size == 64
    assert spec.torch_dtype is spec.dtype is torch.float32
    assert spec.kv_cache_bytes_per_token(torch.bfloat16) == 2 * 2 * 64 * 2
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
           "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
           "max_position_embeddings": 8, "bos_token_id": 1, "eos_token_id": [2, 5],
           "torch_dtype": "bfloat16"}
    llama = ModelSpec.from_config(cfg)
    assert not llama.qk_norm and llama.num_kv_heads == 2 and llama.head_dim == 4
    assert (llama.bos_token_id, llama.eos_token_id, llama.dtype) == (1, (2, 5), torch.bfloat16)
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        ModelSpec.from_config(cfg | {"eos_token_id": "</s>"})


def test_spec_dtype_as_transformers_reads_either_spelling():
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
           "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
           "max_position_embeddings": 8}

    def dtype(**fields):
        return ModelSpec.from_config(cfg | fields).dtype

    assert dtype() is torch.float32  # none named
    assert dtype(torch_dtype="bfloat16") is torch.bfloat16  # transformers 4.x
    assert dtype(dtype="float16") is torch.float16  # 5.x
    assert dtype(dtype="float16", torch_dtype="bfloat16") is torch.float16
    assert dtype(dtype=None, torch_dtype="bfloat16") is torch.bfloat16
    for fields in ({"dtype": "int8"}, {"torch_dtype": "int8"}, {"dtype": "float16",
                                                                "torch_dtype": "int8"}):
        with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
            dtype(**fields)
    # What the checks here let through and transformers' own validation refuses.
    with pytest.raises(ValueError, match=r"^config\.json: transformers cannot read it \(.*"
                                         r"use_cache"):
        dtype(use_cache="no")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_hf_free_writers_load_in_transformers(tmp_path, arch):
    """tests/gpu's fallback checkpoints are real HF/PEFT checkpoints: HF + PEFT load them and
    agree with detlora."""
    base = write_random_checkpoint(tmp_path / "base", arch, tie=arch == "llama",
                                   rope_scaling=arch == "llama")
    adapter = write_random_adapter(base, tmp_path / "ad", r=4, alpha=8, use_rslora=True,
                                   targets=["q_proj", "down_proj"])
    ref = HFReference(base)
    model = load_model(base, lora_config=LoRAConfig(1, 4))
    model.allocate_kv_cache(8, 4)
    slot = LoRAManager(model).add(LoRARequest("ad", 1, adapter))
    ids = list(range(20, 35))
    with torch.no_grad():
        assert rel_err(model(PagedKV(8, 4).step({0: ids})), ref.logits(ids)) < 1e-4
        got = model(PagedKV(8, 4).step({0: ids}, {0: slot}, 1))
    assert rel_err(got, ref.logits(ids, adapter)) < 1e-4
    assert rel_err(ref.logits(ids), ref.logits(ids, adapter)) > 1e-2
