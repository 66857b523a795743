"""Section 6, performance: end-to-end decode latency and throughput per configuration and
batch (the paper's section 6.6), on a GPU with CUDA graphs.

Each trial generates exactly ``tokens`` tokens per prompt (EOS ignored) for a batch of B
prompts, after one warm-up; TPOT = (t(tokens) - t(1)) / (tokens - 1), output tok/s =
B * tokens / t(tokens); the medians over trials are reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from detlora import LoRARequest, SamplingParams
from detlora.study.generation import Engine, generate


def _timed(llm: Engine, prompts: Sequence[Sequence[int]], loras: Sequence[LoRARequest | None],
           tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    generate(llm, prompts, loras, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(llm: Engine, model: str, level: str, reduction: str,
            prompts: Sequence[Sequence[int]], loras: Sequence[LoRARequest | None], batch: int,
            tokens: int, trials: int) -> dict:
    """One row: the first ``batch`` prompts (cycled when there are fewer)."""
    ps = [prompts[i % len(prompts)] for i in range(batch)]
    ls = [loras[i % len(loras)] for i in range(batch)]
    _timed(llm, ps, ls, tokens)  # warm-up
    ones, fulls = [], []
    for _ in range(trials):
        llm.reset_prefix_cache()
        ones.append(_timed(llm, ps, ls, 1))
        llm.reset_prefix_cache()
        fulls.append(_timed(llm, ps, ls, tokens))
    one, full = statistics.median(ones), statistics.median(fulls)
    return {"model": model, "level": level, "reduction": reduction, "batch": batch,
            "tpot_ms": 1000 * (full - one) / (tokens - 1),
            "output_tok_per_s": batch * tokens / full, "e2e_s": full, "trials": trials}


def add_ratios(rows: list[dict]) -> None:
    """``e2e_vs_atomic`` (time of the whole batch) and ``tpot_vs_atomic``: each row against
    the atomic row of its model and batch (absent when there is none)."""
    base = {(r["model"], r["batch"]): r for r in rows if r["reduction"] == "atomic"}
    for r in rows:
        b = base.get((r["model"], r["batch"]))
        if b is not None:
            r["e2e_vs_atomic"] = r["e2e_s"] / b["e2e_s"]
            r["tpot_vs_atomic"] = r["tpot_ms"] / b["tpot_ms"] if b["tpot_ms"] > 0 else None
