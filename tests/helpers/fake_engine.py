"""A fake engine for the study's counters: it answers every prompt with a fixed output, and a
``plant`` function may change one, so a test proves that the change is counted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace


@dataclass(frozen=True)
class Call:
    """Where a prompt is answered: the engine's call number, its place in the call, the
    call's size, and the prompt's token ids."""

    call: int
    index: int
    batch: int
    prompt: tuple[int, ...]


# (call) -> (token ids, logprobs, text) to answer with, or None for the default answer.
Plant = Callable[[Call], "tuple[list[int], list[float], str] | None"]


def default_answer(prompt: tuple[int, ...]) -> tuple[list[int], list[float], str]:
    tokens = [sum(prompt) % 50 + k for k in range(4)]
    return tokens, [-0.5] * len(tokens), f"answer {sum(prompt)}"


@dataclass
class FakeLLM:
    plant: Plant | None = None
    calls: int = 0
    resets: int = 0
    batches: list[int] = field(default_factory=list)

    def generate(self, prompts, sampling_params=None, lora_request=None, use_tqdm=True):
        outs = []
        self.batches.append(len(prompts))
        for i, p in enumerate(prompts):
            ids = tuple(p["prompt_token_ids"])
            answer = self.plant(Call(self.calls, i, len(prompts), ids)) if self.plant else None
            tokens, lps, text = answer or default_answer(ids)
            if sampling_params is not None and sampling_params.logprobs == 2:
                # a decision: the two allowed labels' logprobs (label ids 7 and 8)
                lp = lps[0]
                entries = [{7: lp, 8: -lp}]
            else:
                entries = [{t: lp} for t, lp in zip(tokens, lps, strict=True)]
            outs.append(SimpleNamespace(
                outputs=[SimpleNamespace(token_ids=list(tokens), text=text, logprobs=entries)],
                num_cached_tokens=0, fingerprint="fake"))
        self.calls += 1
        return outs

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True
