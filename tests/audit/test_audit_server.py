"""``detlora serve --audit-log`` end to end: concurrent completions, chats, streams, seeded
samples, structured output, decisions and an aborted stream, the server stopped with SIGTERM,
then ``detlora verify`` finds every request identical; a token id, a logprob hash and the
adapter file tampered with are named request by request (exit 1). A server killed with
SIGKILL under load leaves a log that reads back with at most one torn line. 256 concurrent
streams drop no line and delay no step (the engine's step times with and without the log)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from tests.helpers.server import running_server
from tests.helpers.tiny_chat_model import build_tiny_chat_model

from detlora.audit.reader import read_log
from detlora.audit.verify import VerifyOptions, verify
from detlora.entrypoints.cli import main

pytestmark = pytest.mark.xdist_group("audit_server")
CPU = VerifyOptions(engine={"device": "cpu"}, progress=False)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit_serve")
    model, adapters = build_tiny_chat_model(root)
    return root, model, adapters


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _traffic(url: str, model: str) -> dict[str, str | None]:
    """Every kind of request at once; returns {what: response id} (None for the refused
    one, which must leave no line)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)

    def completion_n():
        return client.completions.create(model=model, prompt="yes no maybe", max_tokens=6,
                                         temperature=0.8, seed=3, logprobs=2, n=2).id

    def completion_ids():  # two prompts, no seed (the engine's), prompt logprobs, adapter
        return client.completions.create(model="tox", prompt=[[5, 6, 7], [8, 9]], max_tokens=4,
                                         temperature=0.7, extra_body={"prompt_logprobs": 1}).id

    def completion_stop():
        return client.completions.create(model=model, prompt="yes no yes", max_tokens=12,
                                         temperature=0.0, stop=["no"], logprobs=0).id

    def completion_stream():
        s = client.completions.create(model="tox", prompt="the state of", max_tokens=6,
                                      temperature=0.9, seed=5, logprobs=1, stream=True)
        return [c.id for c in s][-1]

    def completion_echo():  # every choice scores its prompt
        return client.completions.create(model=model, prompt="no yes", max_tokens=2, n=2,
                                         temperature=0.5, seed=4, logprobs=1, echo=True).id

    def chat_json():
        return client.chat.completions.create(
            model="tox", messages=[{"role": "user", "content": "json"}], max_tokens=8,
            response_format={"type": "json_object"}).id

    def chat_stream():
        s = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "is it calm?"}], max_tokens=5,
            stream=True, logprobs=True, top_logprobs=2, temperature=0.6, seed=9)
        return [c.id for c in s][-1]

    def chat_n():
        return client.chat.completions.create(
            model=model, messages=[{"role": "system", "content": "Judge."},
                                   {"role": "user", "content": "calm"}],
            max_tokens=4, n=2, temperature=1.0, seed=21).id

    def decision():
        r = httpx.post(url + "/v1/decisions", timeout=60, json={
            "model": "tox", "state": "the customer is angry", "instructions": "Judge.",
            "questions": {"toxic": {"type": "noul", "criteria": "Is this comment toxic?"},
                          "level": {"type": "score", "criteria": ["low", "mid", "high"]}}})
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def systemone():
        r = httpx.post(url + "/v1/systemone", timeout=60, json={
            "model": model, "state": {"comment": "calm"},
            "questions": {"c": {"type": "choice", "criteria": {"x": "X", "y": "Y"},
                                "instructions": "pick"}}})
        assert r.status_code == 200, r.text
        return "systemone"

    def aborted():  # a client that leaves mid-stream: its tokens so far are an answer too
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "model": model, "prompt": "yes", "max_tokens": 100, "ignore_eos": True,
                "temperature": 0.0, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    return json.loads(line[6:])["id"]
        return None

    def refused():
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": model, "prompt": [9999], "max_tokens": 2})
        assert r.status_code == 400
        return None

    jobs = {f.__name__: f for f in (completion_n, completion_ids, completion_stop,
                                    completion_stream, completion_echo, chat_json,
                                    chat_stream, chat_n, decision, systemone, aborted,
                                    refused)}
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(f) for name, f in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def served_log(assets):
    root, model, adapters = assets
    log = root / "log"
    args = ["--lora-modules", f"tox={adapters[0]}", "--max-model-len", "192",
            "--audit-log", str(log), "--graceful-timeout", "10"]
    with running_server(model, args) as (url, proc):
        ids = _traffic(url, str(model))
        deadline = time.monotonic() + 30
        while _metric(url, "detlora:num_requests_running") and time.monotonic() < deadline:
            time.sleep(0.05)  # the aborted stream's engine request is gone
        assert _metric(url, "detlora:audit_lines_dropped_total") == 0
        proc.send_signal(signal.SIGTERM)  # lines still queued are written before it exits
        assert proc.wait(timeout=60) == 0
    return log, ids


def test_the_log_has_one_line_per_answer_and_is_private(served_log):
    log, ids = served_log
    assert oct(log.stat().st_mode & 0o777) == "0o700"
    read = read_log([log])
    assert not read.skipped
    assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in read.files)
    by_id = {e.record["id"]: e.record for e in read.entries}
    assert len(by_id) == 11  # the refused request left none
    assert {r["route"] for r in by_id.values()} == {"completions", "chat", "decisions",
                                                   "systemone"}
    assert all(ids[k] in by_id for k in ids if ids[k] not in (None, "systemone"))
    n = by_id[ids["completion_n"]]
    seeds = [o["seed"] for o in n["outputs"]]
    assert seeds[0] == 3 and len(seeds) == 2
    two = by_id[ids["completion_ids"]]
    assert [o["prompt"] for o in two["outputs"]] == [0, 1] and two["adapter"]["name"] == "tox"
    assert all(isinstance(o["seed"], int) for o in two["outputs"])
    assert by_id[ids["completion_stop"]]["outputs"][0]["finish_reason"] == "stop"
    echo = by_id[ids["completion_echo"]]
    assert [o["scores_prompt"] for o in echo["outputs"]] == [True, True]
    assert [o["scores_prompt"] for o in two["outputs"]] == [True, True]  # two prompts, n=1
    chat = by_id[ids["chat_json"]]
    assert chat["request"]["sampling_params"]["structured_outputs"] == {"json_object": True}
    assert chat["request"]["messages"] == [{"role": "user", "content": "json"}]
    decision = by_id[ids["decision"]]
    assert [o["question"] for o in decision["outputs"]] == ["toxic", "level"]
    cut = by_id[ids["aborted"]]["outputs"][0]
    assert cut["finish_reason"] == "abort" and 1 <= cut["num_tokens"] < 100


def test_verify_finds_every_request_identical(served_log, tmp_path):
    log, _ = served_log
    out = tmp_path / "report.json"
    assert main(["verify", str(log), "--device", "cpu", "--no-progress", "--json",
                 str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["summary"]["identical"] == 11, report
    assert report["summary"]["differing"] == report["summary"]["not_comparable"] == 0


def test_tampering_is_named_request_by_request(served_log, assets, tmp_path):
    log, ids = served_log
    _, _, adapters = assets
    copy = tmp_path / "log"
    shutil.copytree(log, copy)
    (f,) = copy.glob("audit-*.jsonl")
    lines = [json.loads(x) for x in f.read_text().splitlines()]
    by_id = {x.get("id"): x for x in lines}
    by_id[ids["completion_n"]]["outputs"][1]["token_ids"][2] += 1  # one token id
    by_id[ids["chat_stream"]]["outputs"][0]["logprobs_sha256"] = "0" * 64  # one hash
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    bad = tmp_path / "tox"  # the adapter file, one number changed
    shutil.copytree(adapters[0], bad)
    from safetensors.torch import load_file, save_file

    tensors = load_file(bad / "adapter_model.safetensors")
    name = sorted(tensors)[0]
    tensors[name][0, 0] += 0.5
    save_file(tensors, bad / "adapter_model.safetensors")

    report = verify([copy], VerifyOptions(engine={"device": "cpu"}, progress=False,
                                          lora_modules={"tox": str(bad)}))
    verdict = {o.id: (o.status, o.field) for o in report.outcomes if o.status != "identical"}
    tox = {e.record["id"] for e in read_log([log]).entries
           if (e.record.get("adapter") or {}).get("name") == "tox"}
    assert verdict == {ids["completion_n"]: ("differs", "tokens"),
                       ids["chat_stream"]: ("differs", "logprobs"),
                       **{t: ("not_comparable", "adapter") for t in tox}}, report.render()
    token = next(o for o in report.outcomes if o.id == ids["completion_n"])
    assert (token.choice, token.position) == (1, 2)
    assert token.logged["token_ids"][0] == token.replayed["token_ids"][0] + 1
    assert report.exit_status == 1
    assert "adapter content differs" in next(o.detail for o in report.outcomes if o.id in tox)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


async def _written(client: httpx.AsyncClient, url: str) -> float:
    text = (await client.get(url + "/metrics")).text
    return next(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                if x.startswith("detlora:audit_lines_written_total "))


def test_a_killed_server_leaves_at_most_one_torn_line(assets):
    root, model, _ = assets
    log = root / "killed"
    with running_server(model, ["--max-model-len", "64", "--audit-log", str(log)]) as (url, proc):
        async def load() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                async def one(k: int) -> None:
                    body = {"model": str(model), "prompt": [5 + k % 50, 6], "max_tokens": 6,
                            "ignore_eos": True, "temperature": 0.0, "stream": k % 2 == 0}
                    with contextlib.suppress(httpx.HTTPError):  # the server died under it
                        await client.post(url + "/v1/completions", json=body)
                tasks = [asyncio.create_task(one(k)) for k in range(160)]
                while await _written(client, url) < 12:
                    await asyncio.sleep(0.02)
                core = _children(proc.pid)
                proc.send_signal(signal.SIGKILL)  # mid-load: requests still in flight
                proc.wait(timeout=30)
                for pid in core:  # the engine process ends with its pipe; make sure
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                await asyncio.gather(*tasks)

        asyncio.run(load())
    read = read_log([log])
    assert len(read.skipped) <= 1 and all(s.reason == "torn" for s in read.skipped)
    assert 12 <= len(read.entries) < 160
    report = verify([log], VerifyOptions(engine={"device": "cpu"}, progress=False, sample=12))
    assert report.count("identical") == 12, report.render()
