"""``detlora serve`` end to end: a real uvicorn server on a free loopback port with the tiny chat
model, driven by the official ``openai`` client and by httpx. Every output is compared, bit for
bit, with the same request run offline (``LLM``) in this process: equal fingerprints, equal
bits."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import openai
import pytest
from tests.helpers.server import running_server, server_log
from tests.helpers.tiny_chat_model import build_tiny_chat_model

from detlora.config import SamplingParams
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

# One worker runs them all, on one server (pyproject's addopts: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("openai_server")
KEY = "test-key-123"
MAX_BYTES = 20_000


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    model, adapters = build_tiny_chat_model(root)
    lora_root = root / "lora_root"
    lora_root.mkdir()
    os.symlink(adapters[1], lora_root / "b")  # inside the root, pointing out of it
    (lora_root / "inside").symlink_to(adapters[1], target_is_directory=True)
    import shutil

    shutil.copytree(adapters[1], lora_root / "real_b")
    big = lora_root / "overflow"  # finite numbers whose LoRA update overflows: inf logits
    shutil.copytree(adapters[1], big)
    cfg = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": 1e38}))
    return model, adapters, lora_root


@pytest.fixture(scope="module")
def server(assets):
    model, adapters, lora_root = assets
    args = ["--lora-modules", f"tox={adapters[0]}", "--enable-lora-loading", "--lora-root",
            str(lora_root), "--max-num-seqs", "8", "--max-queued-requests", "56",
            "--max-model-len", "256", "--max-request-bytes", str(MAX_BYTES),
            "--graceful-timeout", "5"]
    with running_server(model, args, api_key=KEY) as (url, proc):
        yield url, proc
        # Graceful shutdown: a stream in flight when SIGTERM arrives still ends whole.
        import signal
        import threading

        lines: list[str] = []

        def stream() -> None:
            body = {"prompt": "yes no", "max_tokens": 24, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                lines.extend(r.iter_lines())

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 30
        while _metric(url, "detlora:num_requests_running") == 0 and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        t.join(timeout=60)
        proc.wait(timeout=60)
        assert "data: [DONE]" in lines
        last = json.loads([x for x in lines if x.startswith("data: {")][-1][6:])
        assert last["choices"][0]["finish_reason"] == "length"
    assert proc.returncode == 0, server_log(model, url)[-2000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(assets):
    return LLM(assets[0], device="cpu", enable_lora=True, max_model_len=256)


def _lp(value) -> float:
    """An offline logprobs entry's value (a float, or a vLLM-style object with .logprob)."""
    return value if isinstance(value, float) else value.logprob


def _tox(assets) -> LoRARequest:
    return LoRARequest("tox", 1, str(assets[1][0]))


def _post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server[0] + path, json=body, headers=headers, timeout=120, **kw)


def test_models_list_base_and_adapters(client, assets):
    models = {m.id: m for m in client.models.list().data}
    base = str(assets[0])
    assert set(models) == {base, "tox"}
    assert models["tox"].model_extra["parent"] == base


def test_completion_bits_match_offline(client, offline, assets):
    sp = SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=2, n=2)
    ref = offline.generate("yes no maybe", sp, use_tqdm=False)[0]
    out = client.completions.create(
        model=str(assets[0]), prompt="yes no maybe", max_tokens=8, temperature=0.8, seed=3,
        logprobs=2, n=2, extra_body={"return_token_ids": True,
                                     "return_tokens_as_token_ids": True})
    assert out.system_fingerprint == ref.fingerprint
    for choice, want in zip(out.choices, ref.outputs, strict=True):
        assert choice.model_extra["token_ids"] == want.token_ids
        assert choice.text == want.text and choice.finish_reason == want.finish_reason
        assert choice.logprobs.token_logprobs == [_lp(d[t]) for d, t in zip(
            want.logprobs, want.token_ids, strict=True)]
        assert choice.logprobs.tokens == [f"token_id:{t}" for t in want.token_ids]
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)


def test_streamed_completion_with_adapter_and_token_prompt(client, offline, assets):
    prompt = offline.tokenizer.encode("the state of the world")
    sp = SamplingParams(max_tokens=10, temperature=0.7, seed=11, ignore_eos=True)
    ref = offline.generate([prompt], sp, lora_request=_tox(assets), use_tqdm=False)[0]
    stream = client.completions.create(
        model="tox", prompt=prompt, max_tokens=10, temperature=0.7, seed=11, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True})
    text, ids, usage, fingerprints = "", [], None, set()
    for chunk in stream:
        fingerprints.add(chunk.system_fingerprint)
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            ids += c.model_extra["token_ids"]
    assert ids == ref.outputs[0].token_ids and text == ref.outputs[0].text
    assert fingerprints == {ref.fingerprint} and ref.fingerprint != offline.generate(
        [prompt], sp, use_tqdm=False)[0].fingerprint
    assert usage.completion_tokens == 10 and usage.prompt_tokens == len(prompt)


def test_streamed_prompts_times_n_with_stop(client, offline, assets):
    """Two prompts x n=2, streamed: choice i * n + j is completion j of prompt i; a stop
    string ends text and stream as offline."""
    words = [t for t in range(len(offline.tokenizer.hf))
             if offline.tokenizer.decode([t]).strip().isalpha()]
    prompts = ["yes no", "A B C"]
    base = SamplingParams(max_tokens=12, temperature=0.9, seed=21, n=2, ignore_eos=True,
                          allowed_token_ids=words)
    free = offline.generate(prompts, base, use_tqdm=False)
    text = free[1].outputs[1].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    import dataclasses

    sp = dataclasses.replace(base, stop=[stop])
    ref = offline.generate(prompts, sp, use_tqdm=False)
    stream = client.completions.create(
        model=str(assets[0]), prompt=prompts, max_tokens=12, temperature=0.9, seed=21, n=2,
        stop=[stop], stream=True,
        extra_body={"ignore_eos": True, "allowed_token_ids": words})
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    for i, r in enumerate(ref):
        for j, want in enumerate(r.outputs):
            assert texts[2 * i + j] == want.text and reasons[2 * i + j] == want.finish_reason
    assert ref[1].outputs[1].finish_reason == "stop"


def test_chat_stream_and_logprobs_match_offline(client, offline, assets):
    messages = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "café?"}]
    sp = SamplingParams(max_tokens=6, temperature=0.9, seed=5, logprobs=3)
    ref = offline.chat(messages, sp, use_tqdm=False)[0].outputs[0]
    out = client.chat.completions.create(model=str(assets[0]), messages=messages,
                                         max_completion_tokens=6, temperature=0.9, seed=5,
                                         logprobs=True, top_logprobs=3)
    choice = out.choices[0]
    assert choice.message.content == ref.text and choice.message.role == "assistant"
    assert [c.logprob for c in choice.logprobs.content] == [
        _lp(d[t]) for d, t in zip(ref.logprobs, ref.token_ids, strict=True)]
    assert all(len(c.top_logprobs) == 3 for c in choice.logprobs.content)
    chunks = list(client.chat.completions.create(
        model=str(assets[0]), messages=messages, max_tokens=6, temperature=0.9, seed=5,
        stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_response_format_json_schema(client, assets):
    schema = {"type": "object", "properties": {"answer": {"type": "string",
                                                          "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=str(assets[0]), messages=[{"role": "user", "content": "Is this toxic?"}],
        max_tokens=20, temperature=1.0, seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert json.loads(out.choices[0].message.content)["answer"] in ("yes", "no")
    out = client.completions.create(model=str(assets[0]), prompt="A B", max_tokens=12, seed=1,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].text.startswith("{")  # an object (maybe cut by max_tokens)


QUESTIONS = {
    "toxic": {"type": "noul", "criteria": "Is this comment toxic?"},
    "mood": {"type": "choice", "criteria": {"calm": "no anger", "angry": "shouting"}},
    "urgency": {"type": "score", "criteria": ["can wait", "today", "now"]},
}


def test_decisions_match_llm_decide(server, offline, assets):
    state = {"comment": "the customer is angry", "lang": "en"}
    body = {"model": "tox", "state": state, "instructions": "Judge the state.",
            "questions": QUESTIONS}
    r = _post(server, "/v1/decisions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    ref = offline.decide(state, QUESTIONS, instructions="Judge the state.",
                         lora_request=_tox(assets))
    assert data["answers"] == ref.answers and data["system_fingerprint"] == ref.fingerprint
    assert data["object"] == "decision" and set(data["answers"]) == set(QUESTIONS)
    assert sum(data["answers"]["mood"]["probabilities"].values()) == pytest.approx(1.0)
    assert data["answers"]["urgency"]["legend"] == {"1": "can wait", "2": "today", "3": "now"}
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # shared state pages
    again = _post(server, "/v1/decisions", body).json()
    assert again["answers"] == data["answers"]
    so = {"model": "tox", "state": state, "questions": {
        k: {**q, "instructions": "Judge the state."} for k, q in QUESTIONS.items()}}
    r = _post(server, "/v1/systemone", so)
    assert r.status_code == 200 and set(r.json()["answers"]) == set(QUESTIONS)
    bad = {"state": "x", "questions": {"q": {"type": "score",
                                             "criteria": [str(i) for i in range(10)]}}}
    r = _post(server, "/v1/decisions", bad)
    assert r.status_code == 400 and "not a single token" in r.json()["error"]["message"]


def test_errors_are_openai_shaped(server, assets):
    url = server[0]
    assert httpx.get(url + "/health").status_code == 200  # open without a key
    for key in (None, "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.get(url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(url + "/v1/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = _post(server, "/v1/completions", {"model": "nope", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = _post(server, "/v1/completions", {"prompt": "a" * (MAX_BYTES + 10)})
    assert r.status_code == 413

    def chunks():
        for _ in range(30):
            yield b" " * 1000
    r = httpx.post(url + "/v1/completions", content=chunks(),
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413
    r = _post(server, "/v1/completions", {"prompt": "a", "max_tokens": 10_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = _post(server, "/v1/completions", {"prompt": [1, 2, 10**6]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    for route, body in (("/v1/completions", {"prompt": "a\ud800b"}),  # a lone surrogate
                        ("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "a\ud800"}]})):
        r = httpx.post(url + route, content=json.dumps(body),
                       headers={"Authorization": f"Bearer {KEY}"})  # JSON's \ud800 escape
        assert r.status_code == 400 and "not valid text" in r.json()["error"]["message"], route
    r = _post(server, "/v1/completions", {"prompt": ["a"] * 5, "n": 16, "max_tokens": 1})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_overloaded"
    assert "Traceback" not in server_log(assets[0], url)


def test_runtime_adapters_stay_inside_the_root(server, assets):
    _, adapters, lora_root = assets
    for path in ("../adapter_a", str(adapters[0]), "b", "/etc"):
        r = _post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path})
        assert r.status_code == 400, path
        message = r.json()["error"]["message"]
        assert str(lora_root) not in message and str(adapters[1]) not in message
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "b2", "lora_path": "real_b"})
    assert r.status_code == 200, r.text
    r = _post(server, "/v1/completions", {"model": "b2", "prompt": "yes", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["system_fingerprint"]
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "b2"}).status_code == 200
    # A row with non-finite logits fails its own request only, without a trace or a path.
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": "overflow"})
    assert r.status_code == 200, r.text
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        bad = pool.submit(_post, server, "/v1/completions",
                          {"model": "big", "prompt": "yes", "max_tokens": 4})
        good = pool.submit(_post, server, "/v1/completions",
                           {"prompt": "yes", "max_tokens": 4, "ignore_eos": True})
        bad, good = bad.result(), good.result()
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "row_failed"
    assert str(lora_root) not in bad.text
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 4
    # A decision read through it fails the same way: the engine's failure, not a bad request.
    r = _post(server, "/v1/decisions", {"model": "big", "state": "yes", "questions": {
        "q": {"type": "noul", "criteria": "Is it yes?"}}})
    assert r.status_code == 500 and r.json()["error"]["code"] == "row_failed", r.text


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _freed_within(url: str, seconds: float) -> bool:
    """Whether nothing runs and every KV page is free again within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _metric(url, "detlora:num_requests_running") == 0 and \
                _metric(url, "detlora:kv_cache_usage_perc") == 0.0:
            return True
        time.sleep(0.1)
    return False


def test_disconnect_mid_stream_frees_pages(server):
    """A client that goes away mid-answer (streamed, or waiting for a whole one) has its
    request dropped and its pages freed at once: well before its 240 tokens could finish."""
    url = server[0]
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "the state of the world", "max_tokens": 240, "ignore_eos": True,
            "stream": True}
    assert _freed_within(url, 30)
    aborted = _metric(url, "detlora:num_aborted_requests")
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body,
                                                 headers=headers) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(x.startswith("data: {") for x in got)
        assert _metric(url, "detlora:num_requests_running") == 1
    assert _freed_within(url, 5)
    assert _metric(url, "detlora:num_aborted_requests") == aborted + 1
    # Gone after 0.1 s: 240 tokens took 0.75-0.86 s on this project's CPU (a 1 s timeout let
    # an unloaded CI machine finish them first).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=0.1,
                   headers=headers)
    assert _freed_within(url, 5)
    assert _metric(url, "detlora:num_aborted_requests") == aborted + 2
    assert _metric(url, "detlora:time_to_first_token_seconds_count") > 0
    assert _metric(url, "detlora:generation_tokens_total") > 0
    # Every token came out of an engine step, timed in the engine process.
    steps = _metric(url, "detlora:engine_step_seconds_count")
    assert steps > 0 and _metric(url, "detlora:engine_step_seconds_sum") > 0
    # Each step message after the first says how long its predecessor's hand-over took, and
    # the front end times each one from receipt to its event loop.
    assert 0 < _metric(url, "detlora:engine_output_send_seconds_count") < steps + 8
    assert _metric(url, "detlora:frontend_step_delay_seconds_count") >= steps
    assert _metric(url, "detlora:frontend_step_delay_seconds_sum") > 0
    # Each request's admission (front end to engine) is part of its time to first token.
    admitted = _metric(url, "detlora:request_admission_seconds_count")
    assert admitted == _metric(url, "detlora:time_to_first_token_seconds_count") > 0
    assert _metric(url, "detlora:request_admission_seconds_sum") <= _metric(
        url, "detlora:time_to_first_token_seconds_sum")
    # Time with nothing to run counts as the engine's idle time, the wait going on included.
    idle = _metric(url, "detlora:engine_idle_seconds_total")
    time.sleep(0.3)
    assert _metric(url, "detlora:engine_idle_seconds_total") >= idle + 0.3
    # While it steps it is not idle: both together, read within a span, fit in it.
    t0 = time.monotonic()
    idle = _metric(url, "detlora:engine_idle_seconds_total")
    steps = _metric(url, "detlora:engine_step_seconds_sum")
    r = httpx.post(url + "/v1/completions", headers=headers, timeout=60,
                   json={**body, "stream": False, "max_tokens": 40})
    assert r.status_code == 200
    busy = _metric(url, "detlora:engine_step_seconds_sum") - steps
    idle = _metric(url, "detlora:engine_idle_seconds_total") - idle
    assert busy > 0 and idle > 0 and busy + idle < time.monotonic() - t0 + 0.01
    idle = _metric(url, "detlora:engine_idle_seconds_total")
    time.sleep(0.3)
    assert idle + 0.3 <= _metric(url, "detlora:engine_idle_seconds_total") < idle + 5
    text = httpx.get(url + "/metrics").text
    assert 'detlora:http_requests_total{route="/v1/completions",status="200"}' in text
    # Adapter traffic: --lora-modules read the tox adapter into the host cache at start.
    assert _metric(url, 'detlora:lora_events{counter="disk_loads"}') >= 1


def test_load_outputs_equal_offline_alone(server, offline, assets):
    """Concurrent streaming clients with mixed adapters, seeds, n and decisions: nothing fails
    or is lost, every output equals the same request run alone offline, and the KV cache is
    back to free afterwards."""
    import asyncio
    import random

    from benchmarks.harness.serving_load import LoadRequest, run_load

    rng = random.Random(0)
    base = str(assets[0])
    shared = [rng.randrange(7, 300) for _ in range(20)]  # a prefix several prompts share
    requests, plans = [], []
    for k in range(24):
        prompt = (shared if k % 3 == 0 else []) + [rng.randrange(7, 300)
                                                    for _ in range(rng.randrange(3, 20))]
        model = "tox" if k % 2 else base
        sp = SamplingParams(max_tokens=rng.randrange(4, 9), n=1 + (k % 4 == 1),
                            temperature=0.0 if k % 5 == 0 else 0.8, seed=100 + k,
                            logprobs=0, ignore_eos=True)
        body = {"model": model, "prompt": prompt, "max_tokens": sp.max_tokens, "n": sp.n,
                "temperature": sp.temperature, "seed": sp.seed, "ignore_eos": True}
        requests.append(LoadRequest("completion", body))
        plans.append((prompt, sp, _tox(assets) if model == "tox" else None))
    states = ["the customer is angry", {"comment": "café"}, "A B C", "yes no"]
    for k in range(8):
        body = {"model": "tox" if k % 2 else base, "state": states[k % 4],
                "questions": {"toxic": QUESTIONS["toxic"], "urgency": QUESTIONS["urgency"]}}
        requests.append(LoadRequest("decision", body))
    results = asyncio.run(run_load(server[0], requests, concurrency=16, api_key=KEY,
                                   deadline_s=300))
    failed = [(r.index, r.error) for r in results if not r.ok]
    assert failed == []
    for res, (prompt, sp, lora) in zip(results, plans, strict=False):
        ref = offline.generate([prompt], sp, lora_request=lora, use_tqdm=False)[0]
        assert res.fingerprint == ref.fingerprint
        for i, want in enumerate(ref.outputs):
            assert res.choices[i]["token_ids"] == want.token_ids
            assert res.choices[i]["logprobs"] == [_lp(d[t]) for d, t in zip(
                want.logprobs, want.token_ids, strict=True)]
    for res, req in zip(results[len(plans):], requests[len(plans):], strict=True):
        body = req.body
        lora = _tox(assets) if body["model"] == "tox" else None
        ref = offline.decide(body["state"], body["questions"], lora_request=lora)
        assert res.answers == ref.answers and res.fingerprint == ref.fingerprint
    deadline = time.monotonic() + 10
    while _metric(server[0], "detlora:kv_cache_usage_perc") != 0.0 and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(server[0], "detlora:kv_cache_usage_perc") == 0.0
    assert _metric(server[0], "detlora:num_requests_running") == 0


def _engine_pid(server_pid: int) -> int:
    """The server's engine process (its one child, Linux /proc)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_a_dead_engine_fails_streams_and_health(assets):
    """Killing the engine process mid-stream ends the stream with an error event, /health says
    503 and new requests get 503: the front end notices the closed pipe at once."""
    import signal

    with running_server(assets[0], ["--graceful-timeout", "2"]) as (url, proc):
        body = {"prompt": "yes no", "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(x for x in lines if x.startswith("data: {"))
            os.kill(_engine_pid(proc.pid), signal.SIGKILL)
            rest = list(lines)
        errors = [json.loads(x[6:]) for x in rest if x.startswith("data: {") and "error" in x]
        assert errors and errors[-1]["error"]["type"] == "server_error", rest[-3:]
        assert rest[-1] == "data: [DONE]" or rest[-2] == "data: [DONE]"
        assert httpx.get(url + "/health").status_code == 503
        r = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=10)
        assert r.status_code == 503, r.text
