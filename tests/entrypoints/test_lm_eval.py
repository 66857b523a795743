"""Evaluations that repeat: ``echo`` with prompt logprobs on ``/v1/completions`` bit for bit as
the offline engine scores prompts, and lm-evaluation-harness (``local-completions`` for
loglikelihood, loglikelihood_rolling and generate_until, ``local-chat-completions`` for
generate_until) against one ``detlora serve`` of the tiny chat model, with an adapter as the
model: its ``--log_samples`` files byte for byte equal at ``num_concurrent`` 1 and 8, and its
loglikelihoods the offline engine's."""

from __future__ import annotations

import json

import httpx
import pytest
from tests.helpers.server import running_server
from tests.helpers.tiny_chat_model import build_tiny_chat_model

from benchmarks.harness.lm_eval_runs import (
    GEN_TASK,
    MC_TASK,
    ROLLING_TASK,
    run_lm_eval,
    write_tasks,
)
from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

pytestmark = pytest.mark.xdist_group("lm_eval_server")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    model, adapters = build_tiny_chat_model(root)
    return root, model, adapters


@pytest.fixture(scope="module")
def server(assets):
    _, model, adapters = assets
    args = ["--lora-modules", f"tox={adapters[0]}", "--max-model-len", "256",
            "--max-num-seqs", "8"]
    with running_server(model, args) as (url, _):
        yield url


@pytest.fixture(scope="module")
def offline(assets):
    return LLM(str(assets[1]), device="cpu", enable_lora=True, max_model_len=256)


def _tox(assets) -> LoRARequest:
    return LoRARequest("tox", 1, str(assets[2][0]))


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def test_echo_with_logprobs_is_the_offline_prompt_scoring(server, offline, assets):
    """lm-eval's loglikelihood request (token-id prompts, echo, logprobs=1, max_tokens=1), two
    prompts in one request: the prompt text, null for the first token, each prompt token's
    logprob and top alternatives as the offline engine's prompt_logprobs, then the generated
    token as offline generation gives it; text offsets count the token texts."""
    tok = offline.tokenizer
    prompts = [tok.encode("Question: Is this comment toxic?\nAnswer: yes"),
               tok.encode("the state of the world is calm")]
    body = {"model": "tox", "prompt": prompts, "temperature": 0, "max_tokens": 1,
            "logprobs": 2, "seed": 1234, "echo": True}
    got = _post(server, body)
    assert got.status_code == 200, got.text
    choices = got.json()["choices"]
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2, prompt_logprobs=2)
    refs = offline.generate(prompts, sp, _tox(assets), use_tqdm=False)
    for ids, choice, ref in zip(prompts, choices, refs, strict=True):
        gen = ref.outputs[0]
        lp = choice["logprobs"]
        assert choice["text"] == tok.hf.decode(ids) + gen.text
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        entries = [*ref.prompt_logprobs, *gen.logprobs]
        tokens = [*ids, *gen.token_ids]
        assert len(lp["token_logprobs"]) == len(tokens)
        want = [None] + [d[t].logprob for d, t in zip(entries[1:], tokens[1:], strict=True)]
        assert lp["token_logprobs"] == want  # floats from JSON: equal bits
        for top, d in zip(lp["top_logprobs"][1:], entries[1:], strict=True):
            # The 2 best (the scored token first in an entry, then the top ones); keyed by
            # text, so two tokens of one text (partial UTF-8 bytes) keep the later.
            items = [(t, v.logprob) for t, v in d.items()]
            best = items[1:] if len(items) > 2 else sorted(items, key=lambda x: -x[1])
            assert top == {tok.hf.decode([t]): v for t, v in best}
        text = [tok.hf.decode([t]) for t in tokens]
        assert lp["tokens"] == text
        assert lp["text_offset"] == [sum(len(x) for x in text[:i]) for i in range(len(text))]


def test_echo_forms_and_the_prompt_logprobs_extra(server, offline, assets):
    tok = offline.tokenizer
    text = "yes no maybe A B"
    ids = tok.encode(text)
    ref = offline.generate([ids], SamplingParams(temperature=0.0, max_tokens=1,
                                                 prompt_logprobs=1), use_tqdm=False)[0]
    scored = [None] + [d[t].logprob for d, t in zip(ref.prompt_logprobs[1:], ids[1:],
                                                     strict=True)]
    # max_tokens 0 with echo: the prompt alone, no completion tokens.
    only = _post(server, {"prompt": text, "echo": True, "max_tokens": 0, "logprobs": 1}).json()
    choice = only["choices"][0]
    assert choice["text"] == text and choice["logprobs"]["token_logprobs"] == scored
    assert only["usage"]["completion_tokens"] == 0
    # Streamed: the prompt comes first, in the first event, with the same logprobs.
    with httpx.stream("POST", server + "/v1/completions", timeout=120,
                      json={"prompt": text, "echo": True, "max_tokens": 3, "logprobs": 1,
                            "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    whole = _post(server, {"prompt": text, "echo": True, "max_tokens": 3, "logprobs": 1,
                           "temperature": 0, "ignore_eos": True}).json()["choices"][0]
    assert events[0]["choices"][0]["text"].startswith(text)
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    assert [x for e in events for x in e["choices"][0]["logprobs"]["token_logprobs"]] == \
        whole["logprobs"]["token_logprobs"]
    assert whole["logprobs"]["token_logprobs"][: len(ids)] == scored
    # vLLM's prompt_logprobs extra: {token id: logprob} per prompt token, null first.
    extra = _post(server, {"prompt": [ids], "max_tokens": 1, "prompt_logprobs": 1,
                           "temperature": 0}).json()["choices"][0]["prompt_logprobs"]
    assert extra[0] is None
    assert [e[str(t)] for e, t in zip(extra[1:], ids[1:], strict=True)] == scored[1:]
    # n > 1 with echo: every choice shows its prompt with the same logprobs.
    many = _post(server, {"prompt": text, "echo": True, "max_tokens": 2, "logprobs": 1,
                          "n": 2, "seed": 5}).json()["choices"]
    assert [c["logprobs"]["token_logprobs"][: len(ids)] for c in many] == [scored, scored]
    assert all(c["text"].startswith(text) for c in many)


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": "yes", "max_tokens": 0}, "allowed only with echo"),
    ({"prompt": "yes", "prompt_logprobs": 1, "stream": True}, "not available with stream"),
    ({"prompt": "yes", "echo": True, "max_tokens": -1}, "max_tokens must be >= 0"),
    ({"prompt": "yes", "echo": True, "logprobs": 99}, "logprobs must be in"),
])
def test_bad_combinations_get_a_clear_400(server, body, message):
    got = _post(server, body)
    assert got.status_code == 400, got.text
    assert message in got.json()["error"]["message"]


def test_lm_eval_samples_repeat_at_any_concurrency(server, offline, assets, tmp_path):
    """The same lm-eval run at num_concurrent 1 and 8 writes the same per-sample files, byte
    for byte (their names carry the time), and its loglikelihoods are the offline engine's
    sums of prompt logprobs over each continuation."""
    _, model, _ = assets
    tasks = write_tasks(tmp_path / "tasks")
    runs = {}
    for n in (1, 8):
        runs[n] = run_lm_eval(tasks, [MC_TASK, ROLLING_TASK, GEN_TASK], tmp_path / f"c{n}",
                              model="tox", base_url=server, tokenizer=model, num_concurrent=n)
        runs[n, "chat"] = run_lm_eval(tasks, [GEN_TASK], tmp_path / f"chat{n}", model="tox",
                                      base_url=server, tokenizer=model, num_concurrent=n,
                                      chat=True)
    for task in (MC_TASK, ROLLING_TASK, GEN_TASK):
        assert runs[1][task].read_bytes() == runs[8][task].read_bytes(), task
    assert runs[1, "chat"][GEN_TASK].read_bytes() == runs[8, "chat"][GEN_TASK].read_bytes()
    samples = [json.loads(x) for x in runs[1][MC_TASK].read_text().splitlines()]
    assert len(samples) == 4 and all(len(s["resps"]) == 4 for s in samples)
    hf = offline.tokenizer.hf
    pairs, want_ctx = [], []
    for s in samples:
        for arg in s["arguments"].values():
            context, continuation = arg["arg_0"], arg["arg_1"]  # lm-eval's _encode_pair
            whole = hf(context + continuation, add_special_tokens=False)["input_ids"]
            pairs.append(whole)
            want_ctx.append(len(hf(context, add_special_tokens=False)["input_ids"]))
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1, prompt_logprobs=1)
    refs = offline.generate(pairs, sp, _tox(assets), use_tqdm=False)
    logged = [r[0] for s in samples for r in s["resps"]]
    for (loglik, greedy), ids, ctx, ref in zip(logged, pairs, want_ctx, refs, strict=True):
        entries = ref.prompt_logprobs[ctx:]
        assert loglik == str(sum(d[t].logprob for d, t in zip(entries, ids[ctx:],
                                                               strict=True)))
        assert greedy == str(all(d[t].logprob == max(v.logprob for v in d.values())
                                 for d, t in zip(entries, ids[ctx:], strict=True)))
