"""A generation's task outcome: the answer it gives and whether it is correct.

Arithmetic: the number after the last ``Final answer:`` (else the last number in the text),
compared as a number. Code: the first fenced code block (else the whole text), run with the
task's tests in the sandbox; the answer is ``pass`` or ``fail``. Text tasks have no answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from detlora.study.sandbox import run_python_checks
from detlora.study.tasks import ARITHMETIC, CODE, Task

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_FINAL = re.compile(r"final answer\s*[:=]?\s*\$?\s*(" + _NUMBER + ")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class Outcome:
    answer: str | None  # the extracted answer (None: none found, or a text task)
    correct: bool | None  # None for text tasks


def extract_number(text: str) -> str | None:
    """The final numeric answer of a solution, normalised ("1,200.0" -> "1200")."""
    found = _FINAL.findall(text) or _ANY_NUMBER.findall(text)
    if not found:
        return None
    raw = found[-1].replace(",", "")
    try:
        value = Fraction(raw)
    except (ValueError, ZeroDivisionError):
        return None
    return str(value.numerator) if value.denominator == 1 else str(float(value))


def extract_code(text: str) -> str:
    """The first fenced code block of a reply, else the reply itself."""
    m = _FENCE.search(text)
    return m.group(1) if m else text


def grade(task: Task, text: str, *, timeout_s: float = 10.0) -> Outcome:
    if task.kind == ARITHMETIC:
        got = extract_number(text)
        want = extract_number(task.answer or "")
        return Outcome(got, got is not None and got == want)
    if task.kind == CODE:
        result = run_python_checks(extract_code(text), task.tests, timeout_s=timeout_s)
        return Outcome("pass" if result.passed else "fail", result.passed)
    return Outcome(None, None)
