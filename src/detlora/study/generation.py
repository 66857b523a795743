"""Running prompts through an engine alone, batched or in another order, and comparing runs.

Prompts are token-id lists (rendered once per model), each with its LoRARequest. Any object
with ``generate(prompts, sampling_params, lora_request, use_tqdm)`` and
``reset_prefix_cache()`` serves as the engine (tests plant differences with a fake one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from detlora import LoRARequest, SamplingParams


class Engine(Protocol):
    def generate(self, prompts: Any, sampling_params: Any = None, lora_request: Any = None,
                 use_tqdm: bool = True) -> list[Any]: ...

    def reset_prefix_cache(self) -> bool: ...


@dataclass(frozen=True)
class Generation:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None  # the chosen tokens' logprobs
    text: str
    num_cached_tokens: int = 0


def logprob_value(x: Any) -> float:
    """A logprob entry's value: a float, or a vLLM-style ``Logprob`` object."""
    return float(getattr(x, "logprob", x))


def _of(out: Any) -> Generation:
    c = out.outputs[0]
    lps = None if c.logprobs is None else tuple(
        logprob_value(d[t]) for d, t in zip(c.logprobs, c.token_ids, strict=True))
    return Generation(tuple(c.token_ids), lps, c.text, out.num_cached_tokens)


def generate(llm: Engine, prompts: Sequence[Sequence[int]], loras: Sequence[LoRARequest | None],
             params: SamplingParams) -> list[Generation]:
    """All ``prompts`` in one call (the engine batches them as they fit)."""
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, list(loras),
                        use_tqdm=False)
    return [_of(o) for o in outs]


def generate_in_batches(llm: Engine, prompts: Sequence[Sequence[int]],
                        loras: Sequence[LoRARequest | None], params: SamplingParams, size: int,
                        order: Sequence[int] | None = None) -> list[Generation]:
    """The prompts in calls of ``size`` (in ``order``); results in prompt order."""
    order = list(range(len(prompts))) if order is None else list(order)
    got: dict[int, Generation] = {}
    for lo in range(0, len(order), size):
        idx = order[lo: lo + size]
        outs = generate(llm, [prompts[i] for i in idx], [loras[i] for i in idx], params)
        got.update(zip(idx, outs, strict=True))
    return [got[i] for i in range(len(prompts))]


def generate_alone(llm: Engine, prompts: Sequence[Sequence[int]],
                   loras: Sequence[LoRARequest | None], params: SamplingParams) -> list[Generation]:
    """Each prompt in a call of its own, with a cold prefix cache."""
    out = []
    for p, lr in zip(prompts, loras, strict=True):
        llm.reset_prefix_cache()
        out += generate(llm, [p], [lr], params)
    return out


def tokens_changed(a: Generation, b: Generation) -> bool:
    return a.token_ids != b.token_ids


def bits_changed(a: Generation, b: Generation) -> bool:
    """Token ids or the chosen tokens' logprobs differ (to the bit)."""
    return a.token_ids != b.token_ids or a.logprobs != b.logprobs


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
