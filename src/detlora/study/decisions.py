"""Section 4, structured decisions: a noul (yes/no) question per comment, its probability read
R times at a fixed batch and across batch sizes (the paper's section 6.4 and Table 2).

Each comment is read as ``LLM.decide`` reads it (``detlora.decisions``: the comment as the
state, "Is this comment toxic?" as a noul question, the first reply token's raw logprobs at
the labels, renormalised); the study adds the comments to the engine together, so that they
share a batch. ``changed`` counts comparisons whose probability differs at all, ``flips`` those
whose decision (P(yes) >= 0.5) differs; drifts are absolute probability differences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from detlora import LoRARequest, SamplingParams
from detlora.decisions import DecisionRead, answer, parse_questions, plan_reads
from detlora.engine.tokenizer import Tokenizer
from detlora.study.comments import QUESTION, Comment

QUESTIONS = {"toxic": {"type": "noul", "criteria": QUESTION}}


def decision_reads(tokenizer: Tokenizer, comments: Sequence[Comment]) -> list[DecisionRead]:
    """The read of the question about each comment (its prompt and label tokens)."""
    questions = parse_questions(QUESTIONS)
    return [plan_reads(tokenizer, c.text, questions)[0] for c in comments]


def read_probabilities(llm: Any, reads: Sequence[DecisionRead],
                       loras: Sequence[LoRARequest | None], batch: int | None = None
                       ) -> list[float]:
    """P(yes) per read, ``batch`` reads at a time in the engine (None: all at once)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0.0)
    size = batch or len(reads)
    out: list[float] = []
    for lo in range(0, len(reads), size):
        part = list(zip(reads[lo: lo + size], loras[lo: lo + size], strict=True))
        seqs = [engine.add_request(r.prompt_token_ids, params, lora=lr,
                                   label_token_ids=r.label_token_ids) for r, lr in part]
        done: dict[str, Any] = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
        for (r, _), seq in zip(part, seqs, strict=True):
            out.append(answer(r, done[seq.request_id].label_logprobs)["noul"])
    return out


def decision_row(model: str, level: str, reduction: str, check: str,
                 reference: Sequence[float], others: Sequence[Sequence[float]],
                 truth: Sequence[bool]) -> dict:
    """Every run in ``others`` compared with ``reference``, comment by comment."""
    diffs = [abs(p - q) for run in others for p, q in zip(reference, run, strict=True)]
    flips = sum((p >= 0.5) != (q >= 0.5) for run in others
                for p, q in zip(reference, run, strict=True))
    affected = {i for run in others for i, (p, q) in enumerate(zip(reference, run, strict=True))
                if (p >= 0.5) != (q >= 0.5)}
    correct = sum((p >= 0.5) == t for p, t in zip(reference, truth, strict=True))
    return {"model": model, "level": level, "reduction": reduction, "check": check,
            "comparisons": len(diffs), "changed": sum(d != 0 for d in diffs),
            "mean_abs_drift": sum(diffs) / len(diffs) if diffs else 0.0,
            "max_abs_drift": max(diffs, default=0.0), "flips": flips,
            "affected_comments": len(affected),
            "accuracy": correct / len(truth) if truth else None,
            "drift_values": [d for d in diffs if d != 0]}
