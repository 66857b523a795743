"""Gemma 4 and Gemma 3 on the CPU model path against transformers 5.24 (+PEFT), fp32: logits
of a prefill, of a mixed base/adapter batch and of decode and chunked steps that cross the
sliding window's edge over grouped KV pages (pages behind a window poisoned), and greedy
generation through ``LLM`` token for token against HF's ``generate``.

The tiny checkpoints (tests/helpers/tiny_gemma.py) have a window of 8 keys, shorter than the
prompts; Gemma 4's have KV-shared layers, per-layer embeddings, a soft-cap, head sizes 16 and
32 and random layer scalars; the multimodal one feeds placeholder ids, embedded as pad.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_gemma import (
    PLE_TARGETS,
    TEXT_TARGETS,
    GroupedPagedKV,
    make_gemma3,
    make_gemma4,
    make_gemma_adapter,
)
from tests.helpers.tiny_hf import HFReference, rel_err, split_rows

from detlora.layers.lora_slots import LoRAConfig
from detlora.lora.manager import LoRAManager
from detlora.lora.request import LoRARequest
from detlora.models.loader import load_model

TOL = 1e-4  # fp32, relative to the largest reference logit
CASES = ("gemma4", "gemma4-multimodal", "gemma3")


@pytest.fixture(scope="module", params=CASES)
def setup(request, tmp_path_factory):
    """A checkpoint, an adapter on every target (Gemma 4: the PLE linears too) and one on
    q/v (the multimodal Gemma 4: PEFT's default targets, ``.*language_model\\..*\\.(q_proj|
    v_proj)``), and the HF reference."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3":
        base = make_gemma3(root / "base")
        every = TEXT_TARGETS
    else:
        multimodal = request.param.endswith("multimodal")
        base = make_gemma4(root / "base", multimodal=multimodal)
        every = TEXT_TARGETS + PLE_TARGETS
        if multimodal:  # PEFT refuses the towers' clippable linears: the text tower's only
            every = rf".*language_model\..*({'|'.join(every)})"
    ad1 = make_gemma_adapter(base, root / "ad1", targets=every, seed=1)
    qv = None if request.param == "gemma4-multimodal" else ["q_proj", "v_proj"]
    ad2 = make_gemma_adapter(base, root / "ad2", targets=qv, r=4, alpha=8, seed=2)
    return request.param, base, ad1, ad2, HFReference(base)


def _prompts(lengths, seed, placeholders=False):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(3, 110, (n,), generator=g).tolist() for n in lengths]
    if placeholders:  # image, video and audio placeholders, embedded as the pad token
        out[0][1:4] = [120, 121, 122]
    return out


def test_prefill_matches_hf(setup):
    name, base, _, _, ref = setup
    model = load_model(base)
    (ids,) = _prompts([21], seed=3, placeholders="multimodal" in name)
    with torch.no_grad():
        got = model(GroupedPagedKV(model, 16, 4).step({0: ids}))
    want = ref.logits(ids)
    assert rel_err(got, want) < TOL
    if name.startswith("gemma4"):  # the soft-cap holds every logit inside (-10, 10)
        assert float(got.abs().max()) < 10.0


def test_mixed_adapter_batch(setup):
    _, base, ad1, ad2, ref = setup
    model = load_model(base, lora_config=LoRAConfig(max_loras=3, max_lora_rank=8))
    manager = LoRAManager(model)
    r1, r2 = LoRARequest("one", 1, str(ad1)), LoRARequest("two", 2, str(ad2))
    lengths, adapters = [5, 13, 3, 17], [r1, r2, None, r1]
    prompts = _prompts(lengths, seed=4)
    slots = manager.activate(adapters)
    kv = GroupedPagedKV(model, 32, 4, seed=5)
    with torch.no_grad():
        got = split_rows(model(kv.step(dict(enumerate(prompts)), dict(enumerate(slots)),
                                       manager.max_loras)), lengths)
    paths = {None: None, 1: ad1, 2: ad2}
    for ids, req, logits in zip(prompts, adapters, got, strict=True):
        want = ref.logits(ids, paths[req.lora_int_id if req else None])
        assert rel_err(logits, want) < TOL
        if req is not None:  # the adapter matters far beyond the tolerance
            assert rel_err(ref.logits(ids), want) > 100 * TOL


@pytest.mark.parametrize("chunk", [1, 3], ids=["decode", "chunked"])
def test_steps_across_the_window_edge(setup, chunk):
    """Prefill 6 tokens, then steps of ``chunk`` tokens to 18 (the window is 8): each
    step's last row equals HF on the whole sequence, pages behind the window released.
    (The multimodal tower is the text model's code: its prefill and batch are checked.)"""
    name, base, ad1, _, ref = setup
    if name == "gemma4-multimodal" or (name == "gemma3" and chunk == 1):
        pytest.skip("the same path as the cases run")
    model = load_model(base, lora_config=LoRAConfig(max_loras=2, max_lora_rank=8))
    manager = LoRAManager(model)
    adapters = [LoRARequest("one", 1, str(ad1)), None]
    slots = dict(enumerate(manager.activate(adapters)))
    full = _prompts([18, 18], seed=6)
    kv = GroupedPagedKV(model, 40, 4, seed=7)
    pos = {0: 6, 1: 6}
    batch = kv.step({s: full[s][:6] for s in pos}, slots, 2, logits="last")
    while True:
        with torch.no_grad():
            got = model(batch)
        for row, s in enumerate(pos):
            want = ref.logits(full[s][:pos[s]], ad1 if adapters[s] else None)[-1]
            assert rel_err(got[row], want) < TOL, (s, pos[s])
        if pos[0] + chunk > 18:
            break
        batch = kv.step({s: full[s][p:p + chunk] for s, p in pos.items()}, slots, 2, "last")
        pos = {s: p + chunk for s, p in pos.items()}


def test_greedy_generation_is_hf_token_for_token(setup):
    """``LLM.generate`` greedy equals HF's ``generate`` (its own sliding-window cache), with
    and without an adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from detlora.config import SamplingParams
    from detlora.entrypoints.llm import LLM

    name, base, ad1, _, _ = setup
    if name == "gemma4-multimodal":
        pytest.skip("the text tower's logits are checked above; generate needs the tower "
                    "model class")
    llm = LLM(str(base), device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8)
    prompts = _prompts([11, 6], seed=8)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    for adapter in (None,) if name == "gemma3" else (ad1,):
        model = hf if adapter is None else PeftModel.from_pretrained(hf, str(adapter)).eval()
        req = None if adapter is None else LoRARequest("one", 1, str(adapter))
        outs = llm.generate(prompts, sp, req, use_tqdm=False)
        for ids, out in zip(prompts, outs, strict=True):
            with torch.no_grad():
                gen = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                     min_new_tokens=12)
            assert out.outputs[0].token_ids == gen[0, len(ids):].tolist(), (adapter, ids)
