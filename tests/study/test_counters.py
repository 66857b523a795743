"""Every counter of the study counts a planted difference, and only that one: a fake engine
answers every prompt the same way except where a test plants a change."""

from __future__ import annotations

import math

import pytest
from tests.helpers.fake_engine import Call, FakeLLM, default_answer

from detlora import SamplingParams
from detlora.decisions import DecisionRead, parse_questions
from detlora.study import cross_batch, decisions, performance, repeat
from detlora.study.tasks import ARITHMETIC, CODE, Task

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12], [13, 14], [15, 16, 17], [18], [19, 20]]
LORAS = [None] * len(PROMPTS)
PARAMS = SamplingParams(max_tokens=4, logprobs=0, temperature=0.0)


def _changed_token(call: Call):
    tokens, lps, text = default_answer(call.prompt)
    return [*tokens[:2], tokens[2] + 1, tokens[3]], lps, text


def test_repeat_counts_a_changed_token_an_answer_and_a_flip():
    tasks = [Task(ARITHMETIC, "q", answer="7")] * 4 + [Task(CODE, "f", tests=("assert 1",))] * 4

    def plant(call: Call):
        tokens, lps, _ = default_answer(call.prompt)
        if call.call == 2 and call.index == 1:  # repetition 2, prompt 1: another token
            return _changed_token(call)[0], lps, "Final answer: 7"
        if call.call == 1 and call.index == 0:  # repetition 1, prompt 0: another answer
            return [*tokens[:3], 99], lps, "Final answer: 8"
        if call.call == 2 and call.index == 2:  # logprobs only
            return tokens, [-0.25] * 4, "Final answer: 7"
        if call.index < 4:
            return tokens, lps, "Final answer: 7"
        return None

    llm = FakeLLM(plant)
    runs = repeat.repeat_runs(llm, PROMPTS, LORAS, PARAMS, 3)
    assert llm.resets == 3 and llm.batches == [8, 8, 8]  # a fixed batch, a cold cache
    outcomes = repeat.grade_runs(tasks, runs, workers=2)
    rows = repeat.repeat_rows("m", "fast", "atomic", tasks, runs, outcomes)
    arith, code = rows
    assert arith["task"] == ARITHMETIC and arith["comparisons"] == 8
    assert arith["changed"] == 2  # prompt 0 in repetition 1, prompt 1 in repetition 2
    assert arith["bits_changed"] == 3  # and prompt 2's logprobs
    assert arith["answers_changed"] == 1 and arith["correctness_flips"] == 1
    assert arith["correct_first"] == 4
    assert code["comparisons"] == 8 and code["changed"] == 0 and code["answers_changed"] == 0
    assert repeat.changed_prompts(runs) == [0, 1]
    # Nothing planted: nothing counted.
    runs = repeat.repeat_runs(FakeLLM(), PROMPTS, LORAS, PARAMS, 3)
    rows = repeat.repeat_rows("m", "fast", "atomic", tasks, runs,
                              repeat.grade_runs(tasks, runs, workers=2))
    assert all(r["changed"] == r["bits_changed"] == r["answers_changed"] == 0 for r in rows)


def test_cross_batch_counts_what_changes_with_the_batch_and_the_order():
    # Prompt 3 changes inside calls of 8; prompt 5 changes when it is first in its call.
    def plant(call: Call):
        if call.prompt == tuple(PROMPTS[3]) and call.batch == 8:
            return _changed_token(call)
        if call.prompt == tuple(PROMPTS[5]) and call.index == 0 and call.batch > 1:
            return _changed_token(call)
        return None

    llm = FakeLLM(plant)
    _, rows = cross_batch.main_engine_checks(llm, "m", "run_to_run", PROMPTS, LORAS, PARAMS,
                                                 (4, 8, 16))
    assert llm.batches[:8] == [1] * 8
    by = {r["check"]: r for r in rows}
    assert set(by) == {"batch_4", "batch_8", "batch_8_repeat", "reverse_order"}
    assert by["batch_4"]["changed"] == 0  # prompt 5 is second in the call [4, 5, 6, 7]
    assert by["batch_8"]["changed"] == 1
    assert by["batch_8_repeat"]["changed"] == 0
    assert by["reverse_order"]["changed"] == 1  # prompt 3 in the call of 8, not prompt 5
    assert all(r["comparisons"] == 8 for r in rows)
    for r in rows:
        assert set(r) >= {"model", "level", "check", "comparisons", "changed"}


def test_decisions_count_changed_probabilities_drift_and_flips():
    # Comment 2 drifts a little in run 1; comment 5 crosses 0.5 in run 2.
    def plant(call: Call):
        tokens, _, text = default_answer(call.prompt)
        x = 0.3 if call.index % 2 else -0.3
        if call.call == 1 and call.index == 2:
            x += 1e-3
        if call.call == 2 and call.index == 5:
            x = -x
        return tokens, [x] * 4, text

    question = parse_questions(decisions.QUESTIONS)[0]
    reads = [DecisionRead(question, p, (7, 8)) for p in PROMPTS]
    llm = FakeLLM(plant)
    runs = [decisions.read_probabilities(llm, reads, LORAS) for _ in range(3)]
    assert llm.batches == [8, 8, 8]
    assert runs[0][1] == pytest.approx(1 / (1 + math.exp(-0.6)))
    truth = [bool(k % 2) for k in range(8)]
    row = decisions.decision_row("m", "fast", "atomic", "repeat", runs[0], runs[1:], truth)
    assert row["comparisons"] == 16 and row["changed"] == 2 and row["flips"] == 1
    assert row["affected_comments"] == 1 and row["accuracy"] == 1.0
    drift = abs(runs[2][5] - runs[0][5])
    assert row["max_abs_drift"] == drift and len(row["drift_values"]) == 2
    assert row["mean_abs_drift"] == pytest.approx((drift + abs(runs[1][2] - runs[0][2])) / 16)
    # In calls of 4 the same comments give the same probabilities.
    llm = FakeLLM(lambda c: (default_answer(c.prompt)[0], [0.1] * 4, ""))
    batched = decisions.read_probabilities(llm, reads, LORAS, batch=4)
    assert llm.batches == [4, 4] and len(set(batched)) == 1


def test_performance_ratios_are_against_atomic_of_the_same_batch():
    rows = [{"model": "m", "level": lv, "reduction": red, "batch": b, "tpot_ms": t,
             "output_tok_per_s": 1.0, "e2e_s": e}
            for lv, red, b, t, e in (("fast", "atomic", 1, 2.0, 1.0),
                                     ("run_to_run", "ordered", 1, 2.2, 1.05),
                                     ("fast", "atomic", 16, 4.0, 2.0),
                                     ("run_to_run", "ordered", 16, 4.0, 2.02),
                                     ("run_to_run", "ordered", 64, 4.0, 2.0))]
    performance.add_ratios(rows)
    assert rows[1]["e2e_vs_atomic"] == pytest.approx(1.05)
    assert rows[1]["tpot_vs_atomic"] == pytest.approx(1.1)
    assert rows[3]["e2e_vs_atomic"] == pytest.approx(1.01)
    assert "e2e_vs_atomic" not in rows[4]  # no atomic row at batch 64


def test_performance_measure_times_the_batch():
    llm = FakeLLM()
    row = performance.measure(llm, "m", "fast", "atomic", PROMPTS[:2], [None, None], 5, 4, 2)
    assert llm.batches == [5] * 5  # warm-up, then one token and all tokens per trial
    assert row["batch"] == 5 and row["tpot_ms"] is not None and row["output_tok_per_s"] > 0
