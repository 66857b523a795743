"""Qwen2, Mistral and Phi-3 with a tokenizer and its chat template, from ``detlora generate``,
``LLM.chat`` and ``detlora serve``, with an adapter (Phi-3's on the fused modules): the same
bits everywhere."""

from __future__ import annotations

import json

import httpx
import pytest
from tests.helpers.server import running_server
from tests.helpers.tiny_chat_model import build_tokenizer
from tests.helpers.tiny_hf import (
    ALL_TARGETS,
    BASES,
    FUSED_TARGETS,
    longrope_parameters,
    make_adapter,
    make_base_checkpoint,
)

from detlora.config import SamplingParams
from detlora.entrypoints.cli import main
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

MESSAGES = [{"role": "user", "content": "Is this comment toxic? the customer is angry ."}]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """arch -> (model directory with tokenizer, adapter directory), built on first use."""
    made: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in made:
            root = tmp_path_factory.mktemp(arch)
            vocab = build_tokenizer(root / "model")
            extra = {}
            if arch == "phi3":
                extra = dict(rope_parameters=longrope_parameters(16, 32),
                             original_max_position_embeddings=32)
            base = make_base_checkpoint(root / "model", arch, vocab_size=vocab, **extra)
            targets = FUSED_TARGETS if arch == "phi3" else ALL_TARGETS
            made[arch] = base, make_adapter(base, root / "adapter", targets=targets, seed=4)
        return made[arch]

    return get


@pytest.mark.parametrize("arch", BASES)
def test_generate_command_and_chat_template(assets, arch, tmp_path, capsys):
    model, adapter = assets(arch)
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": "the state of the world is", "lora": "a"}, {"prompt": "yes no maybe"}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["generate", "--model", str(model), "--lora", f"a={adapter}", "--prompts",
                 str(prompts), "--max-tokens", "6", "--max-lora-rank", "8", "--device", "cpu",
                 "--json"]) == 0
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    llm = LLM(str(model), device="cpu", enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("a", 1, str(adapter))
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    outs = llm.generate([r["prompt"] for r in rows], sp, [lora, None], use_tqdm=False)
    for g, o in zip(got, outs, strict=True):
        assert g["token_ids"] == o.outputs[0].token_ids and g["fingerprint"] == o.fingerprint
    # The tokenizer's chat template frames the messages.
    chat = llm.chat(MESSAGES, sp, lora, use_tqdm=False)[0]
    ids = llm.get_tokenizer().apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                  tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in 5.x
    assert chat.prompt_token_ids == list(ids)
    assert chat.outputs[0].token_ids == llm.generate(
        {"prompt_token_ids": list(ids)}, sp, lora, use_tqdm=False)[0].outputs[0].token_ids


def test_serve_phi3_with_a_fused_adapter(assets):
    model, adapter = assets("phi3")
    args = ["--lora-modules", f"fused={adapter}", "--max-lora-rank", "8",
            "--max-model-len", "128"]
    offline = LLM(str(model), device="cpu", enable_lora=True, max_lora_rank=8,
                  max_model_len=128)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    ref = offline.chat(MESSAGES, sp, LoRARequest("fused", 1, str(adapter)),
                       use_tqdm=False)[0]
    assert len(ref.prompt_token_ids) <= 32 < len(ref.prompt_token_ids) + 40  # grows past
    with running_server(model, args) as (url, _):
        body = {"model": "fused", "messages": MESSAGES, "max_tokens": 40, "temperature": 0,
                "ignore_eos": True, "logprobs": True}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
    assert choice["message"]["content"] == ref.outputs[0].text
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == [
        next(iter(d.values())).logprob for d in ref.outputs[0].logprobs]
