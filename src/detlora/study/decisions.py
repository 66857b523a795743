"""Section 4, structured decisions: a noul (yes/no) question per comment, its probability read
R times at a fixed batch and across batch sizes (the paper's section 6.4 and Table 2).

``read_probabilities`` is the one place that turns an engine into P(yes): the first reply
token's logprobs restricted to the two label tokens (``allowed_token_ids``), normalised over
them. ``changed`` counts comparisons whose probability differs at all, ``flips`` those whose
decision (P(yes) >= 0.5) differs; drifts are absolute probability differences.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from detlora import LoRARequest, SamplingParams
from detlora.study.generation import Engine

# Label pairs in order of preference: the first the tokenizer tells apart (neither unknown).
LABEL_PAIRS = (("Yes", "No"), ("yes", "no"), (" yes", " no"))


def label_token_ids(tokenizer: object,
                    pairs: Sequence[tuple[str, str]] = LABEL_PAIRS) -> tuple[tuple[str, str],
                                                                          tuple[int, int]]:
    """(labels, their first token ids as a reply starts with them): the first pair whose two
    tokens differ and are known words, else the first whose tokens differ."""
    hf = tokenizer.hf  # type: ignore[attr-defined]
    unk = getattr(hf, "unk_token_id", None)
    usable = []
    for pair in pairs:
        ids = [hf(label, add_special_tokens=False)["input_ids"] for label in pair]
        if not all(ids) or ids[0][0] == ids[1][0]:
            continue
        first = (int(ids[0][0]), int(ids[1][0]))
        if unk not in first:
            return pair, first
        usable.append((pair, first))
    if not usable:
        raise ValueError(f"no label pair of {[list(p) for p in pairs]} starts with two "
                         "different tokens: the decision cannot tell yes from no")
    return usable[0]


def read_probabilities(llm: Engine, prompts: Sequence[Sequence[int]],
                       loras: Sequence[LoRARequest | None], labels: tuple[int, int],
                       batch: int | None = None) -> list[float]:
    """P(first label) per prompt, in calls of ``batch`` prompts (None: one call)."""
    yes, no = labels
    params = SamplingParams(max_tokens=1, allowed_token_ids=(yes, no), logprobs=2)
    size = batch or len(prompts)
    out: list[float] = []
    for lo in range(0, len(prompts), size):
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts[lo: lo + size]],
                            params, list(loras[lo: lo + size]), use_tqdm=False)
        for o in outs:
            top = o.outputs[0].logprobs[0]
            ly, ln = top.get(yes, -math.inf), top.get(no, -math.inf)
            m = max(ly, ln)
            out.append(math.exp(ly - m) / (math.exp(ly - m) + math.exp(ln - m)))
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
