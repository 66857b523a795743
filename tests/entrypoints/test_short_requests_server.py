"""Short requests under concurrent load, through two front-end processes over one engine
(``--api-server-count 2``): every decision and one-token completion is the bits the same
request gets alone, offline (``LLM.decide`` / ``LLM.generate``), whichever front end took it
and whatever shared its steps."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from tests.helpers.server import running_server
from tests.helpers.tiny_chat_model import build_tiny_chat_model

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.entrypoints.openai.server_config import ServerConfig
from detlora.lora.request import LoRARequest

pytestmark = pytest.mark.xdist_group("short_requests_server")
QUESTIONS = {"toxic": {"type": "noul", "criteria": "Is this comment toxic?"},
             "mood": {"type": "choice", "criteria": ["calm", "angry"]}}
WORDS = ("yes", "no", "the", "state", "of", "world", "is", "calm", "and", "customer", "angry")


def _texts(n: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(4 + k % 5)) for k in range(n)]


async def _post_all(url: str, items: list[tuple[str, dict]], connections: int) -> list[dict]:
    limits = httpx.Limits(max_connections=connections)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:
        async def one(path: str, body: dict) -> dict:
            r = await client.post(url + path, json=body)
            assert r.status_code == 200, r.text
            return r.json()

        return await asyncio.gather(*(one(p, b) for p, b in items))


def _front_ends(pid: int) -> int:
    """Processes started from ``pid`` that run a front end."""
    n = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            stat = (cmdline.parent / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and \
                    b"openai.front_end_proc" in cmdline.read_bytes():
                n += 1
        except (OSError, ValueError, IndexError):
            continue
    return n


def test_short_requests_through_two_front_ends_are_the_bits_of_each_alone(tmp_path):
    model, adapters = build_tiny_chat_model(tmp_path / "m")
    lora = LoRARequest("tox", 1, str(adapters[0]))
    states, prompts = _texts(12, 1), _texts(12, 2)
    items = [("/v1/decisions", {"model": "tox", "state": s, "questions": QUESTIONS,
                                "instructions": "Judge."}) for s in states]
    items += [("/v1/completions", {"model": "tox", "prompt": p, "max_tokens": 1,
                                   "temperature": 0.0, "logprobs": 0,
                                   "return_token_ids": True}) for p in prompts]
    items = items[::2] + items[1::2]  # decisions and completions interleaved
    args = ["--lora-modules", f"tox={adapters[0]}", "--api-server-count", "2",
            "--max-num-seqs", "16", "--max-model-len", "256"]
    with running_server(model, args) as (url, proc):
        got = asyncio.run(_post_all(url, items, connections=16))
        assert _front_ends(proc.pid) == 1  # the second front end, beside the first
    offline = LLM(str(model), device="cpu", enable_lora=True, max_model_len=256)
    decisions = offline.decide(states, QUESTIONS, instructions="Judge.", lora_request=lora)
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    outs = offline.generate(prompts, sp, lora_request=lora, use_tqdm=False)
    by_state = dict(zip(states, decisions, strict=True))
    by_prompt = dict(zip(prompts, outs, strict=True))
    for k, ((path, body), answer) in enumerate(zip(items, got, strict=True)):
        if path == "/v1/decisions":
            ref = by_state[body["state"]]
            assert answer["answers"] == ref.answers
            if k < 6:  # and alone, one call each
                assert ref.answers == offline.decide(body["state"], QUESTIONS,
                                                     instructions="Judge.",
                                                     lora_request=lora).answers
            assert answer["system_fingerprint"] == ref.fingerprint
        else:
            ref = by_prompt[body["prompt"]].outputs[0]
            choice = answer["choices"][0]
            assert choice["token_ids"] == ref.token_ids
            assert choice["logprobs"]["token_logprobs"] == [
                ref.logprobs[0][ref.token_ids[0]].logprob]


def test_runtime_adapter_loading_needs_one_front_end():
    with pytest.raises(ValueError, match="needs one front end"):
        ServerConfig(model="m", served_model_name="m", api_server_count=2,
                     enable_lora_loading=True, lora_root="/tmp")
    with pytest.raises(ValueError, match="api_server_count"):
        ServerConfig(model="m", served_model_name="m", api_server_count=0)
