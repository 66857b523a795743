"""Greedy outputs equal Hugging Face generate (+ PEFT) on tiny fp32 checkpoints."""

import warnings

import pytest
import torch
from tests.helpers.engine_outputs import random_prompts

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

MAX_TOKENS = 12


def hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=0, eos_token_id=None,
                             output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item()
                for s, t in zip(out.scores, tokens, strict=True)]
    return tokens, logprobs


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_matches_hf_and_peft(kind, request):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(f"{kind}_dir")
    adapter = (request.getfixturevalue("llama_adapters")[0] if kind == "llama"
               else request.getfixturevalue("qwen3_adapter"))
    prompts = random_prompts(4, seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    llm = LLM(str(model_dir), enable_lora=True, max_loras=1, max_lora_rank=8, device="cpu")
    lora = LoRARequest("a", 1, str(adapter))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    ours = llm.generate(prompts, sp, use_tqdm=False)
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(model_dir)), str(adapter)).eval()
    ours_lora = llm.generate(prompts, sp, lora, use_tqdm=False)
    for hf_model, outs in ((base, ours), (peft_model, ours_lora)):
        for p, out in zip(prompts, outs, strict=True):
            tokens, logprobs = hf_greedy(hf_model, p)
            assert out.outputs[0].token_ids == tokens
            mine = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]
            torch.testing.assert_close(torch.tensor(mine), torch.tensor(logprobs),
                                       rtol=0, atol=1e-4)
    # The adapter matters on this model, so the PEFT comparison is not the base one again.
    assert [o.outputs[0].token_ids for o in ours] != [o.outputs[0].token_ids for o in ours_lora]
