"""Decision questions: ``noul`` (yes or no), ``choice`` (one of named options) and ``score``
(one of ordered levels), parsed from their wire form into one shape.

Every question is answered by one label token: ``yes``/``no`` for noul, ``A``, ``B``, ... for
the options of a choice, ``1``, ``2``, ... for the levels of a score. Accepted forms (TypeSafe's
System One and the Decisions shape):

* noul: ``criteria`` a string (the statement), or {"yes": text, "no": text} describing each
  side, with the question in ``instructions``;
* choice: ``criteria`` {option name: description} or a list of option names (2 to 26);
* score: ``criteria`` a list of level descriptions (2 to 10, lowest first).

The question text is the question's ``instructions``, else a noul's string criteria, else its
id. Anything else is a ValueError naming the question and the problem.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from typing import Any

QUESTION_TYPES = ("noul", "choice", "score")
MAX_CHOICES = 26
MAX_LEVELS = 10


@dataclass(frozen=True)
class Question:
    id: str
    type: str  # noul | choice | score
    text: str  # what is asked
    options: tuple[str, ...]  # noul: ("yes", "no"); choice: option names; score: "1".."N"
    descriptions: tuple[str | None, ...]  # one per option (None: none given)
    labels: tuple[str, ...]  # the single-token answer of each option


def _text(value: Any, where: str) -> str:
    """A prompt fragment: a string as it is, any other JSON value compact."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError):
        raise ValueError(f"{where} must be JSON (a string, object or array)") from None


def parse_question(qid: str, spec: Any) -> Question:
    if not isinstance(qid, str) or not qid:
        raise ValueError("question ids must be non-empty strings")
    where = f"question {qid!r}"
    if not isinstance(spec, dict):
        raise ValueError(f"{where} must be an object with a 'type'")
    kind = spec.get("type")
    if kind not in QUESTION_TYPES:
        raise ValueError(f"{where}: type must be one of {', '.join(QUESTION_TYPES)}, "
                         f"got {kind!r}")
    criteria = spec.get("criteria")
    instructions = spec.get("instructions")
    text = _text(instructions, f"{where} instructions") if instructions is not None else None
    if kind == "noul":
        descriptions: tuple[str | None, ...] = (None, None)
        if isinstance(criteria, str):
            text = text or criteria
        elif isinstance(criteria, dict):
            unknown = sorted(set(criteria) - {"yes", "no"})
            if unknown:
                raise ValueError(f"{where}: noul criteria take 'yes' and 'no', got {unknown}")
            descriptions = tuple(None if criteria.get(k) is None
                                 else _text(criteria[k], f"{where} criteria")
                                 for k in ("yes", "no"))
        elif criteria is not None:
            raise ValueError(f"{where}: noul criteria must be a string or {{'yes', 'no'}}")
        return Question(qid, kind, text or qid, ("yes", "no"), descriptions, ("yes", "no"))
    if kind == "choice":
        if isinstance(criteria, dict):
            names = [str(k) for k in criteria]
            descriptions = tuple(None if v is None else _text(v, f"{where} criteria")
                                 for v in criteria.values())
        elif isinstance(criteria, list) and all(isinstance(x, str) for x in criteria):
            names, descriptions = list(criteria), (None,) * len(criteria)
        else:
            raise ValueError(f"{where}: choice criteria must be {{option: description}} or a "
                             "list of option names")
        if not 2 <= len(names) <= MAX_CHOICES or len(set(names)) != len(names) \
                or not all(names):
            raise ValueError(f"{where}: a choice needs 2 to {MAX_CHOICES} distinct, non-empty "
                             f"options, got {len(names)}")
        labels = tuple(string.ascii_uppercase[: len(names)])
        return Question(qid, kind, text or qid, tuple(names), descriptions, labels)
    if not isinstance(criteria, list) or not 2 <= len(criteria) <= MAX_LEVELS:
        raise ValueError(f"{where}: score criteria must be a list of 2 to {MAX_LEVELS} level "
                         "descriptions, lowest first")
    levels = tuple(str(i + 1) for i in range(len(criteria)))
    descriptions = tuple(_text(c, f"{where} criteria") for c in criteria)
    return Question(qid, kind, text or qid, levels, descriptions, levels)


def parse_questions(questions: Any, max_questions: int | None = None) -> list[Question]:
    if not isinstance(questions, dict) or not questions:
        raise ValueError("questions must be a non-empty object of {id: question}")
    if max_questions is not None and len(questions) > max_questions:
        raise ValueError(f"at most {max_questions} questions per request, got {len(questions)}")
    return [parse_question(qid, spec) for qid, spec in questions.items()]


__all__ = ["MAX_CHOICES", "MAX_LEVELS", "QUESTION_TYPES", "Question", "parse_question",
           "parse_questions"]
