"""The CPU model path against Hugging Face transformers (+PEFT): fp32 logits must agree for a
single prefill, a mixed-adapter batch over a paged cache, and decode/chunked steps that reuse
the cache."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_hf import (
    HFReference,
    PagedKV,
    make_adapter,
    make_checkpoint,
    rel_err,
    split_rows,
)

from detlora.layers.lora_slots import LoRAConfig
from detlora.lora.manager import LoRAManager
from detlora.lora.request import LoRARequest
from detlora.models.loader import load_model

TOL = 1e-4  # fp32, relative to the largest reference logit

CASES = {
    "llama-llama3rope-tied": dict(arch="llama", rope_scaling=True, tie=True),
    "llama-untied": dict(arch="llama"),
    "qwen3": dict(arch="qwen3"),
}


@pytest.fixture(scope="module", params=list(CASES))
def setup(request, tmp_path_factory):
    """A checkpoint, two adapters (r=8 all seven targets; rsLoRA r=4 on a subset) and the
    HF reference for it."""
    root = tmp_path_factory.mktemp(request.param)
    base = make_checkpoint(root / "base", **CASES[request.param])
    ad1 = make_adapter(base, root / "ad1", r=8, alpha=16, seed=1)
    ad2 = make_adapter(base, root / "ad2", r=4, alpha=8, use_rslora=True, seed=2,
                       targets=["q_proj", "v_proj", "o_proj", "down_proj", "up_proj"])
    return base, ad1, ad2, HFReference(base)


def _prompts(n_tokens, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, n_tokens, (n,), generator=g).tolist() for n in lengths]


def test_single_prompt_prefill(setup):
    base, _, _, ref = setup
    model = load_model(base)
    model.allocate_kv_cache(num_blocks=8, block_size=4)
    (ids,) = _prompts(model.spec.vocab_size, [13], seed=3)
    with torch.no_grad():
        got = model(PagedKV(8, 4).step({0: ids}))
    want = ref.logits(ids)
    assert got.shape == want.shape
    assert rel_err(got, want) < TOL


def test_mixed_adapter_batch(setup):
    base, ad1, ad2, ref = setup
    model = load_model(base, lora_config=LoRAConfig(max_loras=3, max_lora_rank=16))
    model.allocate_kv_cache(num_blocks=32, block_size=4)
    manager = LoRAManager(model)
    r1, r2 = LoRARequest("one", 1, str(ad1)), LoRARequest("two", 2, str(ad2))
    lengths = [5, 9, 3, 12]
    adapters = [r1, r2, None, r1]
    prompts = _prompts(model.spec.vocab_size, lengths, seed=4)
    slots = manager.activate(adapters)
    assert slots[2] == -1 and slots[0] == slots[3] != slots[1]
    kv = PagedKV(32, 4, seed=5)
    batch = kv.step(dict(enumerate(prompts)), dict(enumerate(slots)), manager.max_loras)
    with torch.no_grad():
        got = split_rows(model(batch), lengths)
    paths = {None: None, 1: ad1, 2: ad2}
    for ids, req, logits in zip(prompts, adapters, got, strict=True):
        want = ref.logits(ids, paths[req.lora_int_id if req else None])
        assert rel_err(logits, want) < TOL
        if req is not None:  # the adapter must matter far beyond the tolerance
            assert rel_err(ref.logits(ids), want) > 1000 * TOL


@pytest.mark.parametrize("chunk", [1, 4], ids=["decode", "chunked-prefill"])
def test_steps_reuse_kv_cache(setup, chunk):
    """Prefill, then steps of ``chunk`` new tokens per sequence reading the cached prefix;
    every step's last-row logits must match HF on the full sequence."""
    base, ad1, _, ref = setup
    model = load_model(base, lora_config=LoRAConfig(max_loras=2, max_lora_rank=8))
    model.allocate_kv_cache(num_blocks=40, block_size=4)
    manager = LoRAManager(model)
    adapters = [LoRARequest("one", 1, str(ad1)), None]
    slots = dict(enumerate(manager.activate(adapters)))
    full = _prompts(model.spec.vocab_size, [15, 19], seed=6)
    first = [6, 11]
    kv = PagedKV(40, 4, seed=7)
    pos = dict(enumerate(first))
    batch = kv.step({s: full[s][:n] for s, n in pos.items()}, slots, 2, logits="last")
    for _ in range(2):
        with torch.no_grad():
            got = model(batch)
        for row, s in enumerate(pos):
            path = ad1 if adapters[s] else None
            want = ref.logits(full[s][: pos[s]], path)[-1]
            assert rel_err(got[row], want) < TOL
        batch = kv.step({s: full[s][p:p + chunk] for s, p in pos.items()}, slots, 2, "last")
        pos = {s: p + chunk for s, p in pos.items()}


def test_no_lora_batch_equals_base(setup):
    """A model with LoRA slots and a batch without LoRA computes the base model bit for bit."""
    base, ad1, _, _ = setup
    plain = load_model(base)
    lora = load_model(base, lora_config=LoRAConfig(max_loras=1, max_lora_rank=8))
    LoRAManager(lora).add(LoRARequest("one", 1, str(ad1)))
    ids = _prompts(plain.spec.vocab_size, [7], seed=8)
    outs = []
    for model, slots in ((plain, None), (lora, None), (lora, {0: -1})):
        model.allocate_kv_cache(num_blocks=4, block_size=4)
        with torch.no_grad():
            outs.append(model(PagedKV(4, 4).step({0: ids[0]}, slots)))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], outs[2])
