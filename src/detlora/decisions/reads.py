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
import weakref
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
    return ReadPlanner.of(tokenizer, questions, instructions).plan([state])[0]


# Two contents that stand for a state while a question's chat template is split around it:
# one plain, one with the whitespace, markup and braces a template could treat specially.
_PROBES = ("\x00detlora state probe\x00", " \n\t{{ probe }} <b>&amp;</b> \u00e9\n ")
# Per tokenizer, its recent planners (by questions and instructions), oldest first.
_PLANNERS: weakref.WeakKeyDictionary[Tokenizer, dict[tuple, ReadPlanner]] = \
    weakref.WeakKeyDictionary()
_MAX_PLANNERS = 64


class ReadPlanner:
    """The reads of many states under one set of questions and instructions.

    Each question's prompt is a chat whose user message holds the state between fixed text,
    so its rendered text is ``prefix + state text + suffix`` for a template that writes a
    message's content as it is: the template is rendered once per question with a probe
    content in the state's place, kept when a second probe (whitespace at both ends, markup,
    braces) and the first real state render to exactly that, and otherwise every state is
    rendered (``verbatim`` False). Every caller (``LLM.decide``, ``/v1/decisions``) plans
    through here, so a state gets the same prompt alone, in bulk and through the server. The
    label ids are looked up once; all prompts are encoded in one tokenizer call.
    """

    def __init__(self, tokenizer: Tokenizer, questions: Sequence[Question],
                 instructions: Any = None) -> None:
        # Weak: the planners kept per tokenizer must not keep it alive.
        self._tokenizer = weakref.ref(tokenizer)
        self.questions = tuple(questions)
        self.instructions = instructions
        self.labels: list[tuple[int, ...]] = []
        for q in self.questions:
            labels = tuple(label_token_id(tokenizer, label) for label in q.labels)
            if len(set(labels)) != len(labels):
                raise ValueError(f"question {q.id!r}: two labels are the same token")
            self.labels.append(labels)
        self._split: list[tuple[str, str] | None] | None = None  # per question, once checked

    @classmethod
    def of(cls, tokenizer: Tokenizer | None, questions: Sequence[Question],
           instructions: Any = None) -> ReadPlanner:
        """A planner for these questions, kept for the next call with equal ones (a server
        answers the same questions about many states)."""
        if tokenizer is None:
            raise ValueError("decisions need the model's tokenizer and its chat template")
        text = None if instructions is None else _text(instructions, "instructions")
        key = (tuple(questions), text)
        kept = _PLANNERS.setdefault(tokenizer, {})
        planner = kept.get(key)
        if planner is None:
            planner = cls(tokenizer, questions, instructions)
            if len(kept) >= _MAX_PLANNERS:
                kept.pop(next(iter(kept)))
            kept[key] = planner
        return planner

    def _messages(self, q: Question, state_text: str) -> list[dict[str, str]]:
        messages = []
        if self.instructions is not None:
            messages.append({"role": "system",
                             "content": _text(self.instructions, "instructions")})
        body = f"State:\n{state_text}\n\n{question_block(q)}"
        messages.append({"role": "user", "content": body})
        return messages

    @property
    def tokenizer(self) -> Tokenizer:
        tokenizer = self._tokenizer()
        if tokenizer is None:
            raise RuntimeError("the tokenizer of this decision planner is gone")
        return tokenizer

    def _render(self, q: Question, state_text: str) -> str:
        return self.tokenizer.render_chat(self._messages(q, state_text))

    def _check_split(self, first_state: str) -> list[tuple[str, str] | None]:
        splits: list[tuple[str, str] | None] = []
        for q in self.questions:
            probe, other = _PROBES
            text = self._render(q, probe)
            split = None
            if text.count(probe) == 1:
                prefix, suffix = text.split(probe)
                if all(self._render(q, s) == prefix + s + suffix for s in (other, first_state)):
                    split = (prefix, suffix)
            splits.append(split)
        return splits

    def plan(self, states: Sequence[Any]) -> list[list[DecisionRead]]:
        """Every state's reads (one per question, in question order)."""
        texts: list[str] = []
        state_texts = []
        for i, state in enumerate(states):
            where = "state" if len(states) == 1 else f"states[{i}]"
            if state is None or isinstance(state, (bool, int, float)):
                raise ValueError(f"{where} must be a string, an object or an array")
            state_texts.append(_text(state, where))
        if not state_texts:
            return []
        if self._split is None:
            self._split = self._check_split(state_texts[0])
        for state_text in state_texts:
            for q, split in zip(self.questions, self._split, strict=True):
                texts.append(self._render(q, state_text) if split is None
                             else split[0] + state_text + split[1])
        ids = self.tokenizer.encode_many(texts, add_special_tokens=False,
                                         what="the rendered chat")
        n = len(self.questions)
        return [[DecisionRead(q, ids[k * n + j], self.labels[j])
                 for j, q in enumerate(self.questions)] for k in range(len(state_texts))]

    @property
    def verbatim(self) -> bool | None:
        """Whether every question's template was split around the state (None: no state
        planned yet)."""
        return None if self._split is None else all(s is not None for s in self._split)


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


__all__ = ["DecisionRead", "ReadPlanner", "answer", "decision_messages", "label_token_id",
           "plan_reads", "question_block", "softmax"]
