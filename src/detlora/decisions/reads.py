"""One read per question: the chat prompt that asks it, and its answer from the label logprobs.

The prompt is a chat: the shared instructions as the system message (when given), then one
user message that starts with the state and ends with the question and its labelled options.
Every question of a request therefore begins with the same tokens, and with prefix caching
the state's KV pages are computed once and shared. The answer is the first reply token: the
raw log-softmax of that position's logits at each label token (the engine reads it, batch-
invariant), renormalised over the labels (softmax of those logprobs, in float64).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from detlora.decisions.questions import Question, _text
from detlora.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class DecisionRead:
    question: Question
    prompt_token_ids: list[int]
    label_token_ids: tuple[int, ...]  # one per option, in option order


def label_token_id(tokenizer: Tokenizer, label: str) -> int:
    """The one token that answers ``label``; ValueError when the tokenizer splits it."""
    ids = tokenizer.hf(label, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"the decision label {label!r} is not a single token for this "
                         f"model's tokenizer ({len(ids)} tokens): it cannot be read in one "
                         "position")
    return int(ids[0])


def question_block(q: Question) -> str:
    lines = [f"Question: {q.text}"]
    if q.type == "noul":
        for label, desc in zip(q.labels, q.descriptions, strict=True):
            if desc is not None:
                lines.append(f"{label}: {desc}")
        lines.append("Answer with yes or no.")
    elif q.type == "choice":
        lines.append("Options:")
        for label, name, desc in zip(q.labels, q.options, q.descriptions, strict=True):
            lines.append(f"{label}: {name}" + (f" - {desc}" if desc is not None else ""))
        lines.append("Answer with the letter of one option.")
    else:
        lines.append("Levels:")
        for label, desc in zip(q.labels, q.descriptions, strict=True):
            lines.append(f"{label}: {desc}")
        lines.append("Answer with the number of one level.")
    return "\n".join(lines)


def decision_messages(state: Any, question: Question,
                      instructions: Any = None) -> list[dict[str, str]]:
    if state is None or isinstance(state, (bool, int, float)):
        raise ValueError("state must be a string, an object or an array")
    messages = []
    if instructions is not None:
        messages.append({"role": "system", "content": _text(instructions, "instructions")})
    body = f"State:\n{_text(state, 'state')}\n\n{question_block(question)}"
    messages.append({"role": "user", "content": body})
    return messages


def plan_reads(tokenizer: Tokenizer | None, state: Any, questions: Sequence[Question],
               instructions: Any = None) -> list[DecisionRead]:
    """The read of every question (ValueError for a label that is not one token)."""
    if tokenizer is None:
        raise ValueError("decisions need the model's tokenizer and its chat template")
    reads = []
    for q in questions:
        labels = tuple(label_token_id(tokenizer, label) for label in q.labels)
        if len(set(labels)) != len(labels):
            raise ValueError(f"question {q.id!r}: two labels are the same token")
        ids = tokenizer.encode_chat(decision_messages(state, q, instructions))
        reads.append(DecisionRead(q, ids, labels))
    return reads


def softmax(logprobs: Sequence[float]) -> list[float]:
    """exp(x - max) / sum, in float64 (a fixed order: the same inputs, the same bits)."""
    top = max(logprobs)
    if math.isinf(top) and top < 0:
        raise ValueError("every label has probability 0 at the first reply position")
    exps = [math.exp(x - top) for x in logprobs]
    total = math.fsum(exps)
    return [e / total for e in exps]


def answer(read: DecisionRead, label_logprobs: Mapping[int, float]) -> dict[str, Any]:
    """The wire answer of one question from its label logprobs."""
    q = read.question
    probs = softmax([label_logprobs[t] for t in read.label_token_ids])
    if q.type == "noul":
        return {"type": "noul", "noul": probs[0]}
    best = max(range(len(probs)), key=lambda i: probs[i])  # ties: the first option
    if q.type == "choice":
        return {"type": "choice", "choice": q.options[best],
                "probabilities": dict(zip(q.options, probs, strict=True)),
                "confidence": probs[best]}
    return {"type": "score",
            "score": math.fsum((i + 1) * p for i, p in enumerate(probs)),
            "probabilities": dict(zip(q.options, probs, strict=True)),
            "legend": dict(zip(q.options, q.descriptions, strict=True)),
            "confidence": probs[best]}


__all__ = ["DecisionRead", "answer", "decision_messages", "label_token_id", "plan_reads",
           "question_block", "softmax"]
