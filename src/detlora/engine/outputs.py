"""What ``LLM.generate`` returns, shaped like vLLM's ``RequestOutput`` (lists, as there)."""

from __future__ import annotations

from dataclasses import dataclass, field

from detlora.lora.request import LoRARequest


@dataclass(frozen=True)
class Logprob:
    """One token's entry in ``logprobs`` / ``prompt_logprobs`` (vLLM's ``Logprob``).

    ``logprob``: the value the engine's ``logprobs_mode`` reports (by default the model's raw
    log-probability, before temperature, penalties and filters). ``rank``: 1 + the number of
    tokens whose value (logit) in that same distribution is strictly higher; the listed top
    tokens carry their place 1, 2, ... in the sorted order. ``decoded_token``: the token
    alone, decoded (None without a tokenizer).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: the chosen (or prompt) token first, then the top ones.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(frozen=True)
class RequestMetrics:
    """When a request passed each stage (``time.time()`` seconds, as vLLM's
    ``RequestMetrics``); None for a stage not reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        """Seconds from arrival to the first step that ran the request."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None  # one {token_id: Logprob} per output token
    finish_reason: str | None  # "length" | "stop" | "abort" | "error", None while unfinished
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS
    cumulative_logprob: float | None = None  # sum of the chosen tokens' logprobs (with logprobs)
    # With finish_reason "error": what went wrong (e.g. non-finite logits from an adapter);
    # the tokens before it are kept, the other requests of the batch are unaffected.
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    fingerprint: str  # what decided the bits; equal fingerprints, equal outputs
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then one
    # {token_id: Logprob} per prompt token (its own first, then the top ones), as in vLLM.
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # With add_request(label_token_ids=...): {token id: logprob} of the first output position,
    # log_softmax of its raw logits (no temperature, filter or adjustment), fp32 values.
    label_logprobs: dict[int, float] | None = None
    lora_request: LoRARequest | None = None
    # Wall-clock times differ from run to run: left out of ==, so equal outputs compare equal.
    metrics: RequestMetrics | None = field(default=None, compare=False)
