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

    def __post_init__(self) -> None:
        self.engine = FakeEngine(self)

    def answer(self, i: int, n: int, ids: tuple[int, ...]):
        return (self.plant(Call(self.calls, i, n, ids)) if self.plant else None) or \
            default_answer(ids)

    def generate(self, prompts, sampling_params=None, lora_request=None, use_tqdm=True):
        outs = []
        self.batches.append(len(prompts))
        for i, p in enumerate(prompts):
            tokens, lps, text = self.answer(i, len(prompts), tuple(p["prompt_token_ids"]))
            entries = [{t: lp} for t, lp in zip(tokens, lps, strict=True)]
            outs.append(SimpleNamespace(
                outputs=[SimpleNamespace(token_ids=list(tokens), text=text, logprobs=entries)],
                num_cached_tokens=0, fingerprint="fake", finished=True))
        self.calls += 1
        return outs

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True


@dataclass
class FakeEngine:
    """The engine calls decisions make: requests with label ids, answered in one step whose
    label logprobs are (x, -x) for the plant's first logprob x."""

    llm: FakeLLM
    queue: list = field(default_factory=list)
    count: int = 0

    def add_request(self, prompt_token_ids, params, *, lora=None, label_token_ids=None):
        self.count += 1
        seq = SimpleNamespace(request_id=str(self.count), ids=tuple(prompt_token_ids),
                              labels=tuple(label_token_ids))
        self.queue.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def step(self):
        batch, self.queue = self.queue, []
        self.llm.batches.append(len(batch))
        outs = []
        for i, seq in enumerate(batch):
            _, lps, _ = self.llm.answer(i, len(batch), seq.ids)
            yes, no = seq.labels
            outs.append(SimpleNamespace(request_id=seq.request_id, finished=True,
                                        label_logprobs={yes: lps[0], no: -lps[0]}))
        self.llm.calls += 1
        return outs
