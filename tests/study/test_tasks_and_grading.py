"""The study's tasks: seeded, with answers that check; grading finds answers in replies."""

from __future__ import annotations

import json
import re

import pytest

from detlora.study.grading import extract_code, extract_number, grade
from detlora.study.tasks import (
    ARITHMETIC,
    CODE,
    TEXT,
    Task,
    arithmetic_tasks,
    code_tasks,
    load_prompts_file,
    study_tasks,
)

# A correct implementation of each generated function, by name (k read from the prompt).
SOLUTIONS = {
    "scale_and_shift": "def scale_and_shift(x):\n    return x * {k} + 1",
    "count_multiples": "def count_multiples(xs):\n    return sum(1 for x in xs if x % {k} == 0)",
    "sum_above": "def sum_above(xs):\n    return sum(x for x in xs if x > {k})",
    "repeat_word": "def repeat_word(w):\n    return ' '.join([w] * {k})",
    "last_digits": "def last_digits(n):\n    return n % (10 ** {k})",
    "clip": "def clip(x):\n    return max(-{k}, min({k}, x))",
}


def test_tasks_are_seeded_and_interleaved():
    assert study_tasks(8, seed=3) == study_tasks(8, seed=3)
    assert study_tasks(8, seed=3) != study_tasks(8, seed=4)
    kinds = [t.kind for t in study_tasks(5)]
    assert kinds == [ARITHMETIC, CODE, ARITHMETIC, CODE, ARITHMETIC]


def test_arithmetic_answers_follow_the_problem():
    for t in arithmetic_tasks(8, seed=1):
        nums = [int(x) for x in re.findall(r"\d+", t.prompt.split("\n\n", 1)[1])]
        assert t.answer is not None and int(t.answer) >= 0
        if "shares the rest" in t.prompt:
            total, lost, kids = nums
            assert int(t.answer) == (total - lost) // kids
        if "reads" in t.prompt:
            pages, days, done = nums
            assert int(t.answer) == pages * days + done


def test_correct_code_passes_and_wrong_code_fails():
    tasks = code_tasks(6, seed=2)
    assert {t.tests[0].split("(")[0].removeprefix("assert ") for t in tasks} == set(SOLUTIONS)
    for t in tasks:
        name = t.tests[0].split("(")[0].removeprefix("assert ")
        k = int(re.search(r"(-?\d+)", t.prompt.split("that", 1)[1]).group(1).lstrip("-"))
        good = f"Here you go:\n```python\n{SOLUTIONS[name].format(k=k)}\n```\n"
        assert grade(t, good).correct, (t.prompt, good)
        assert grade(t, good).answer == "pass"
        wrong = f"```python\ndef {name}(*a):\n    return None\n```"
        assert grade(t, wrong).correct is False and grade(t, wrong).answer == "fail"


def test_extract_number_and_code():
    assert extract_number("so 3 + 4 = 7.\nFinal answer: 1,200") == "1200"
    assert extract_number("Final answer: 7 apples, not 8") == "7"
    assert extract_number("they have 3 then 12") == "12"
    assert extract_number("final answer = 2.50") == "2.5"
    assert extract_number("no digits") is None
    assert extract_code("text\n```python\nx = 1\n```\nmore") == "x = 1\n"
    assert extract_code("```py\nx = 2") == "x = 2"
    assert extract_code("x = 3") == "x = 3"


def test_grade_arithmetic_and_text():
    t = Task(ARITHMETIC, "q", answer="7")
    assert grade(t, "Final answer: 7") == grade(t, "...7")
    assert grade(t, "Final answer: 7").correct and not grade(t, "Final answer: 8").correct
    assert grade(t, "none").answer is None and grade(t, "none").correct is False
    assert grade(Task(TEXT, "q"), "anything").correct is None


def test_prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "free text"}),
        "",
        json.dumps({"prompt": "2+2?", "answer": 4}),
        json.dumps({"prompt": "write f", "tests": ["assert f() == 1"]}),
    ]))
    tasks = load_prompts_file(path)
    assert [t.kind for t in tasks] == [TEXT, ARITHMETIC, CODE]
    assert tasks[1].answer == "4" and tasks[2].tests == ("assert f() == 1",)
    with pytest.raises(FileNotFoundError):
        load_prompts_file(tmp_path / "missing.jsonl")
    for bad, match in ((["{"], ":1: not valid JSON"), (['{"text": "x"}'], ':1: each line'),
                       (['{"prompt": "x", "answer": 1, "tests": ["a"]}'], "not both"),
                       (['{"prompt": "x", "answer": true}'], "must be a number"),
                       (['{"prompt": "x", "tests": "assert 1"}'], "list of strings"),
                       ([""], "holds no prompts")):
        path.write_text("\n".join(bad))
        with pytest.raises(ValueError, match=match):
            load_prompts_file(path)
