"""Gemma 4 from ``detlora generate`` and ``detlora serve`` with an adapter (on the text tower
and the per-layer-embedding linears), a tokenizer and its chat template: the same bits as
``LLM`` offline, with a conversation longer than the sliding window."""

from __future__ import annotations

import json

import httpx
from tests.helpers.server import running_server
from tests.helpers.tiny_chat_model import build_tokenizer
from tests.helpers.tiny_gemma import PLE_TARGETS, TEXT_TARGETS, make_gemma4, make_gemma_adapter

from detlora.config import SamplingParams
from detlora.entrypoints.cli import main
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

MESSAGES = [{"role": "user", "content": "Is this comment toxic? the customer is angry ."}]


def test_generate_and_serve_gemma4_with_an_adapter(tmp_path, capsys):
    vocab = build_tokenizer(tmp_path / "model")
    model = make_gemma4(tmp_path / "model", vocab_size=vocab,
                        vocab_size_per_layer_input=vocab)
    adapter = make_gemma_adapter(model, tmp_path / "adapter", targets=TEXT_TARGETS + PLE_TARGETS)
    offline = LLM(str(model), device="cpu", enable_lora=True, max_lora_rank=8,
                  max_model_len=128)
    lora = LoRARequest("g", 1, str(adapter))
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0)
    ref = offline.chat(MESSAGES, sp, lora, use_tqdm=False)[0]
    assert len(ref.prompt_token_ids) > 8  # past the window
    assert main(["generate", "--model", str(model), "--lora", f"g={adapter}", "--prompt",
                 "the state of the world is", "--prompt-lora", "g", "--max-tokens", "6",
                 "--max-lora-rank", "8", "--device", "cpu", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.splitlines()[-1])
    want = offline.generate("the state of the world is",
                            SamplingParams(temperature=0.0, max_tokens=6, logprobs=0), lora,
                            use_tqdm=False)[0]
    assert got["token_ids"] == want.outputs[0].token_ids
    args = ["--lora-modules", f"g={adapter}", "--max-lora-rank", "8", "--max-model-len", "128"]
    with running_server(model, args) as (url, _):
        body = {"model": "g", "messages": MESSAGES, "max_tokens": 20, "temperature": 0,
                "ignore_eos": True, "logprobs": True}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
    assert choice["message"]["content"] == ref.outputs[0].text
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == [
        next(iter(d.values())).logprob for d in ref.outputs[0].logprobs]
