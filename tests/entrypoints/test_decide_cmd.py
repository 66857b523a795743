"""``detlora decide``: questions over a JSON-lines file of states, answers as JSON lines, each
the answer ``LLM.decide`` gives the state alone; a bad line is an error naming it."""

import json

import pytest
from tests.helpers.tiny_chat_model import build_tiny_chat_model

from detlora.entrypoints.cli import main
from detlora.entrypoints.llm import LLM
from detlora.lora.request import LoRARequest

QUESTIONS = {"toxic": {"type": "noul", "criteria": "Is this comment toxic?"},
             "mood": {"type": "choice", "criteria": ["calm", "angry"]}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("decide_cmd"))


def test_decide_answers_every_line_as_llm_decide_does(model, tmp_path, capsys):
    model_dir, adapters = model
    rows = [{"id": 1, "state": "the customer is angry", "label": 1},
            {"id": 2, "state": {"comment": "calm"}, "lora": "a"},
            {"id": 3, "state": ["an", "array", "state"]}]
    states = tmp_path / "states.jsonl"
    states.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n"
                      + json.dumps(rows[2]) + "\n")
    (tmp_path / "q.json").write_text(json.dumps(QUESTIONS))
    out = tmp_path / "answers.jsonl"
    argv = ["decide", "--model", str(model_dir), "--device", "cpu", "--states", str(states),
            "--questions", str(tmp_path / "q.json"), "--instructions", "Judge.",
            "--lora", f"a={adapters[0]}", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["id"] for g in got] == [1, 2, 3] and got[0]["label"] == 1
    llm = LLM(str(model_dir), device="cpu", enable_lora=True)
    lora = LoRARequest("a", 1, str(adapters[0]))
    for row, g in zip(rows, got, strict=True):
        alone = llm.decide([row["state"]], QUESTIONS, instructions="Judge.",
                           lora_request=lora if row.get("lora") else None)[0]
        assert g["answers"] == json.loads(json.dumps(alone.answers))  # the same floats
        assert g["fingerprint"] == alone.fingerprint
        assert g["prompt_tokens"] == alone.prompt_tokens
    assert got[1]["lora"] == "a" and "lora" not in got[0]
    assert "3 states answered" in capsys.readouterr().err


def test_questions_inline_or_in_a_file(tmp_path):
    from detlora.entrypoints.decide_file import read_questions

    (tmp_path / "q.json").write_text(json.dumps(QUESTIONS))
    assert read_questions(str(tmp_path / "q.json")) == read_questions(json.dumps(QUESTIONS)) \
        == QUESTIONS


@pytest.mark.parametrize("lines,message", [
    (['{"state": "ok"}', "{not json"], r"states.jsonl:2: not valid JSON"),
    (['{"state": "ok"}', '{"text": "x"}'], r'states.jsonl:2: each line must be an object '
                                           r'with a "state"'),
    (['{"state": 3}'], r'states.jsonl:1: "state" must be a string, an object or an array'),
    (['{"state": "x", "lora": "zz"}'], r"states.jsonl:1: adapter 'zz' was not given"),
    (['{"state": "x", "answers": 1}'], r"states.jsonl:1: fields \['answers'\]"),
    ([""], r"holds no states"),
])
def test_bad_lines_are_named_before_the_model_loads(model, tmp_path, capsys, lines, message):
    states = tmp_path / "states.jsonl"
    states.write_text("\n".join(lines) + "\n")
    argv = ["decide", "--model", str(tmp_path / "no-model"), "--states", str(states),
            "--questions", json.dumps(QUESTIONS)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert __import__("re").search(message, err), err


def test_bad_questions_are_named(tmp_path, capsys):
    states = tmp_path / "s.jsonl"
    states.write_text('{"state": "x"}\n')
    for questions, message in (('{"q": {"type": "maybe"}}', "type must be one of"),
                               ("{nope", "--questions is not valid JSON"),
                               (str(tmp_path / "missing.json"), "neither a JSON object nor")):
        argv = ["decide", "--model", str(tmp_path), "--states", str(states),
                "--questions", questions]
        assert main(argv) == 2
        assert message in capsys.readouterr().err
