"""``LLM(audit_log=...)`` and ``detlora verify`` offline: a log of generations, chats and
decisions replays identical in any batch size; a log of another level or device cannot be
compared and says which field; a hash-only log is checked against the inputs a user keeps;
``--sample``, ``--since`` and ``--until`` pick requests."""

from __future__ import annotations

import json
import shutil

import pytest
from tests.helpers.tiny_chat_model import build_tiny_chat_model

from detlora.audit.format import parse_time
from detlora.audit.reader import read_log
from detlora.audit.verify import VerifyOptions, verify
from detlora.config import SamplingParams
from detlora.entrypoints.cli import main
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

QUESTIONS = {"toxic": {"type": "noul", "criteria": "Is this comment toxic?"},
             "mood": {"type": "choice", "criteria": ["calm", "angry"]}}
FAST = VerifyOptions(engine={"device": "cpu"}, progress=False)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """A batch_invariant log (generate with n, logprobs, prompt logprobs and an adapter; chat;
    decide) and a hash-only one, each from its own LLM."""
    root = tmp_path_factory.mktemp("audit_offline")
    model, adapters = build_tiny_chat_model(root)
    tox = LoRARequest("tox", 1, str(adapters[0]))
    full, hashed = root / "full", root / "hashed"
    with LLM(model, device="cpu", enable_lora=True, max_model_len=128, audit_log=full) as llm:
        llm.generate(["yes no maybe", [5, 6, 7, 8]],
                     [SamplingParams(max_tokens=5, temperature=0.8, seed=3, n=2, logprobs=2,
                                     prompt_logprobs=1),
                      SamplingParams(max_tokens=4, temperature=0.0, stop=["no"])],
                     [tox, None], use_tqdm=False)
        llm.generate([9, 10, 11], SamplingParams(max_tokens=3, temperature=1.0), tox,
                     use_tqdm=False)  # no seed: the engine's, recorded
        llm.chat([{"role": "user", "content": "is it calm?"}],
                 SamplingParams(max_tokens=4, temperature=0.0, logprobs=0), use_tqdm=False)
        llm.decide("the customer is angry", QUESTIONS, lora_request=tox)
    with LLM(model, device="cpu", max_model_len=128, audit_log=hashed,
             audit_log_hash_only=True) as llm:
        llm.generate(["yes no", [7, 8, 9]], SamplingParams(max_tokens=4, temperature=0.5,
                                                           seed=11), use_tqdm=False)
    return model, full, hashed


def _copy(src, dst):
    shutil.copytree(src, dst)
    (f,) = sorted(dst.glob("audit-*.jsonl"))
    return f


def test_the_log_holds_every_answer_as_the_engine_ran_it(logs):
    _, full, _ = logs
    log = read_log([full])
    routes = [e.record["route"] for e in log.entries]
    assert routes == ["generate", "generate", "generate", "chat", "decide"]
    first = log.entries[0].record
    assert first["adapter"]["name"] == "tox" and len(first["adapter"]["sha256"]) == 64
    seeds = [o["seed"] for o in first["outputs"]]
    assert seeds[0] == 3 and seeds[1] != 3  # choice 1: a seed derived from 3
    assert first["request"]["sampling_params"]["n"] == 2
    assert len(first["outputs"][0]["logprobs"]) == first["outputs"][0]["num_tokens"]
    unseeded = log.entries[2].record
    assert unseeded["request"]["sampling_params"]["seed"] is None
    assert isinstance(unseeded["outputs"][0]["seed"], int)  # the one the engine used
    decision = log.entries[4].record
    assert [q["id"] for q in decision["request"]["questions"]] == ["toxic", "mood"]
    assert all(len(o["probabilities"]) == 2 for o in decision["outputs"])
    engine = log.entries[0].engine
    assert engine["fingerprint_fields"]["level"] == "batch_invariant"
    assert engine["engine_args"]["max_model_len"] == 128


def test_an_offline_log_replays_identical_in_any_batch_size(logs, tmp_path, capsys):
    _, full, _ = logs
    report = verify([full], VerifyOptions(engine={"device": "cpu"}, batch_size=1,
                                          progress=False))
    assert [o.status for o in report.outcomes] == ["identical"] * 5, report.render()
    assert report.exit_status == 0 and report.engine_requests == 7
    out = tmp_path / "report.json"
    assert main(["verify", str(full), "--device", "cpu", "--no-progress", "--json",
                 str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert (summary["identical"], summary["differing"], summary["not_comparable"]) == (5, 0, 0)
    assert "OK: every comparable request is identical" in capsys.readouterr().out


def test_a_log_of_another_device_cannot_be_compared(logs, tmp_path):
    _, full, _ = logs
    f = _copy(full, tmp_path / "gpu")
    lines = [json.loads(x) for x in f.read_text().splitlines()]
    for rec in lines:
        fields = rec["fingerprint"]["fields"] if rec["kind"] == "request" else \
            rec["fingerprint_fields"]
        fields["device"] = "capability=9.0, cuda=13.0, gpu=NVIDIA H200"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = verify([f.parent], FAST)
    assert {(o.status, o.field) for o in report.outcomes} == {("not_comparable", "device")}
    assert "NVIDIA H200" in report.outcomes[0].detail
    assert report.exit_status == 1  # nothing could be compared
    assert "FAILED: nothing could be compared" in report.render()


def test_a_run_to_run_log_says_it_replays_batch_for_batch_only(logs, tmp_path):
    model, _, _ = logs
    with LLM(model, device="cpu", max_model_len=128, determinism="run_to_run",
             audit_log=tmp_path) as llm:
        llm.generate("yes no", SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    built = []
    report = verify([tmp_path], FAST, llm_factory=lambda *a, **k: built.append(a))
    (o,) = report.outcomes
    assert (o.status, o.field) == ("not_comparable", "level")
    assert "batch for batch" in o.detail and not built  # no engine was built for nothing
    assert report.exit_status == 1


def test_a_hash_only_log_is_checked_against_the_users_inputs(logs, tmp_path):
    _, _, hashed = logs
    log = read_log([hashed])
    assert all("token_ids" not in p for e in log.entries
               for p in e.record["request"]["prompts"])
    assert all("token_ids" not in o and "token_ids_sha256" in o
               for e in log.entries for o in e.record["outputs"])
    assert "yes no" not in "".join(f.read_text() for f in hashed.iterdir())
    alone = verify([hashed], FAST)
    assert {o.field for o in alone.outcomes} == {"hash_only"} and alone.exit_status == 1
    ids = [e.record for e in log.entries]
    first_ids = _tokenize(logs[0], "yes no")  # what the user's own records would hold
    inputs = tmp_path / "inputs.jsonl"
    inputs.write_text(json.dumps({"id": ids[0]["id"], "prompts": [first_ids]}) + "\n"
                      + json.dumps({"id": ids[1]["id"], "prompts": [[7, 8, 9]]}) + "\n")
    report = verify([hashed], VerifyOptions(engine={"device": "cpu"}, inputs=str(inputs),
                                            progress=False))
    assert [o.status for o in report.outcomes] == ["identical"] * 2, report.render()
    inputs.write_text(json.dumps({"id": ids[1]["id"], "prompts": [[7, 8, 10]]}) + "\n")
    wrong = verify([hashed], VerifyOptions(engine={"device": "cpu"}, inputs=str(inputs),
                                           progress=False))
    assert [(o.status, o.field) for o in wrong.outcomes] == [
        ("not_comparable", "hash_only"), ("not_comparable", "prompt")]
    assert wrong.exit_status == 1


def _tokenize(model, text):
    from detlora.engine.tokenizer import Tokenizer

    return Tokenizer(str(model)).encode(text)


def test_sample_since_and_until_pick_requests(logs):
    _, full, _ = logs
    entries = read_log([full]).entries
    times = [e.record["time"] for e in entries]
    none = verify([full], VerifyOptions(until=parse_time(times[0]), progress=False))
    assert none.outcomes == [] and none.exit_status == 1
    late = verify([full], VerifyOptions(engine={"device": "cpu"}, since=parse_time(times[3]),
                                        sample=1, sample_seed=5, progress=False))
    (o,) = late.outcomes
    assert o.id in {entries[3].record["id"], entries[4].record["id"]}
    assert o.status == "identical"
