"""Section 2, repeated generation: the same prompts R times in one engine at a fixed batch.

Repetitions 1..R-1 are compared with repetition 0, prompt by prompt (the paper's section
6.3): ``changed`` counts generations whose token ids differ, ``bits_changed`` those whose
token ids or chosen-token logprobs differ, ``answers_changed`` those whose extracted answer
differs (a number, or pass/fail of the code's tests) and ``correctness_flips`` those whose
correctness differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from detlora import LoRARequest, SamplingParams
from detlora.study.generation import Engine, Generation, bits_changed, generate, tokens_changed
from detlora.study.grading import Outcome, grade
from detlora.study.tasks import Task


def repeat_runs(llm: Engine, prompts: Sequence[Sequence[int]],
                loras: Sequence[LoRARequest | None], params: SamplingParams,
                repetitions: int) -> list[list[Generation]]:
    """[repetition][prompt]: every repetition one call with all prompts, prefix cache cold."""
    runs = []
    for _ in range(repetitions):
        llm.reset_prefix_cache()
        runs.append(generate(llm, prompts, loras, params))
    return runs


def grade_runs(tasks: Sequence[Task], runs: Sequence[Sequence[Generation]], *,
               workers: int = 4, cache: dict | None = None) -> list[list[Outcome]]:
    """[repetition][prompt] outcomes; identical texts of a task are graded once (``cache``
    may be shared between calls), code checks run ``workers`` at a time."""
    cache = {} if cache is None else cache
    todo = {(i, g.text) for run in runs for i, g in enumerate(run)} - cache.keys()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for key, outcome in zip(todo, pool.map(lambda k: grade(tasks[k[0]], k[1]), todo),
                                strict=True):
            cache[key] = outcome
    return [[cache[(i, g.text)] for i, g in enumerate(run)] for run in runs]


def repeat_rows(model: str, level: str, reduction: str, tasks: Sequence[Task],
                runs: Sequence[Sequence[Generation]],
                outcomes: Sequence[Sequence[Outcome]]) -> list[dict]:
    """One row per task kind present, in order of first appearance."""
    rows = []
    for kind in dict.fromkeys(t.kind for t in tasks):
        idx = [i for i, t in enumerate(tasks) if t.kind == kind]
        first, first_out = runs[0], outcomes[0]
        row = {"model": model, "level": level, "reduction": reduction, "task": kind,
               "comparisons": 0, "changed": 0, "answers_changed": 0, "bits_changed": 0,
               "correctness_flips": 0, "correct_first": sum(
                   bool(first_out[i].correct) for i in idx)}
        for run, out in zip(runs[1:], outcomes[1:], strict=True):
            for i in idx:
                row["comparisons"] += 1
                row["changed"] += tokens_changed(first[i], run[i])
                row["bits_changed"] += bits_changed(first[i], run[i])
                row["answers_changed"] += out[i].answer != first_out[i].answer
                row["correctness_flips"] += out[i].correct != first_out[i].correct
        rows.append(row)
    return rows


def changed_prompts(runs: Sequence[Sequence[Generation]]) -> list[int]:
    """Prompts whose token ids changed in some repetition, by first repetition that did."""
    seen: dict[int, None] = {}
    for run in runs[1:]:
        for i, g in enumerate(run):
            if tokens_changed(runs[0][i], g):
                seen.setdefault(i, None)
    return list(seen)
