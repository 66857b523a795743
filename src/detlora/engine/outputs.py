"""What ``LLM.generate`` returns, shaped like vLLM's ``RequestOutput`` (lists, as there)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # one {token_id: logprob} per token
    finish_reason: str | None  # "length" | "stop" | "abort" | "error", None while unfinished
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS
    cumulative_logprob: float | None = None  # sum of the chosen tokens' logprobs (with logprobs)
    # With finish_reason "error": what went wrong (e.g. non-finite logits from an adapter);
    # the tokens before it are kept, the other requests of the batch are unaffected.
    error: str | None = None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    fingerprint: str  # what decided the bits; equal fingerprints, equal outputs
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then one
    # {token_id: logprob} per prompt token (its own first, then the top ones), as in vLLM.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # With add_request(label_token_ids=...): {token id: logprob} of the first output position,
    # log_softmax of its raw logits (no temperature, filter or adjustment), fp32 values.
    label_logprobs: dict[int, float] | None = None
