"""Section 3, batch size, order and engine state: each prompt alone against the same prompt in
batches of 16, 32 and 64, in reverse arrival order, with chunked prefill, under preemption,
and with the prefix cache cold and warm (the paper's section 6.5, whose 39% of outputs changed
with the batch size at its deterministic reductions).

Every check compares with the prompts run alone (one call each, cold cache) in the level's
main engine; ``changed`` counts generations whose token ids differ, ``bits_changed`` those
whose token ids or logprobs differ. ``batch_B_repeat`` repeats the batch-B run (the paper's
fixed-batch column).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from detlora import LoRARequest, SamplingParams
from detlora.study.generation import (
    Engine,
    Generation,
    bits_changed,
    generate,
    generate_alone,
    generate_in_batches,
    tokens_changed,
)

Prompts = Sequence[Sequence[int]]
Loras = Sequence[LoRARequest | None]


def cross_row(model: str, level: str, check: str, ref: Sequence[Generation],
              outs: Sequence[Generation], **extra: int) -> dict:
    return {"model": model, "level": level, "check": check, "comparisons": len(ref),
            "changed": sum(tokens_changed(a, b) for a, b in zip(ref, outs, strict=True)),
            "bits_changed": sum(bits_changed(a, b) for a, b in zip(ref, outs, strict=True)),
            **extra}


def main_engine_checks(llm: Engine, model: str, level: str, prompts: Prompts, loras: Loras,
                       params: SamplingParams, batches: Sequence[int],
                       tick: Callable[[], None] = lambda: None
                       ) -> tuple[list[Generation], list[dict]]:
    """(the prompts alone, the rows of the checks that run in the level's main engine)."""
    alone = generate_alone(llm, prompts, loras, params)
    tick()
    rows = []
    n = len(prompts)
    runs: dict[int, list[Generation]] = {}
    for size in [b for b in batches if b <= n] or [n]:
        llm.reset_prefix_cache()
        runs[size] = generate_in_batches(llm, prompts, loras, params, size)
        rows.append(cross_row(model, level, f"batch_{size}", alone, runs[size]))
        tick()
    largest = max(runs)
    llm.reset_prefix_cache()
    again = generate_in_batches(llm, prompts, loras, params, largest)
    rows.append(cross_row(model, level, f"batch_{largest}_repeat", runs[largest], again))
    llm.reset_prefix_cache()
    rev = generate_in_batches(llm, prompts, loras, params, largest, order=range(n - 1, -1, -1))
    rows.append(cross_row(model, level, "reverse_order", alone, rev))
    tick()
    return alone, rows


def variant_rows(llm: Engine, variant: str, model: str, level: str, prompts: Prompts,
                 loras: Loras, params: SamplingParams, alone: Sequence[Generation]) -> list[dict]:
    """The rows of one variant engine (see ``detlora.study.engines``), all prompts in one call."""
    llm.reset_prefix_cache()
    if variant == "chunked":
        return [cross_row(model, level, "chunked_prefill", alone,
                          generate(llm, prompts, loras, params))]
    if variant == "preempt":
        scheduler = llm.engine.scheduler  # type: ignore[attr-defined]
        before = scheduler.num_preemptions
        outs = generate(llm, prompts, loras, params)
        return [cross_row(model, level, "preemption", alone, outs,
                          preemptions=scheduler.num_preemptions - before)]
    if variant == "cache":
        cold = generate(llm, prompts, loras, params)
        warm = generate(llm, prompts, loras, params)  # the prompts' pages are cached now
        return [cross_row(model, level, "prefix_cache_cold", alone, cold,
                          cached_tokens=sum(g.num_cached_tokens for g in cold)),
                cross_row(model, level, "prefix_cache_warm", alone, warm,
                          cached_tokens=sum(g.num_cached_tokens for g in warm))]
    raise ValueError(f"no cross-batch check runs on the {variant!r} engine")
