"""``echo`` on ``/v1/completions``, as OpenAI and vLLM answer it: the prompt before the
completion, in the text and, with ``logprobs``, in the logprobs (the prompt tokens' logprobs,
``null`` for the first token, which nothing predicts). lm-evaluation-harness scores
loglikelihood requests this way (``echo``, ``logprobs=1``, ``max_tokens=1``).

``max_tokens=0`` with ``echo`` returns the prompt alone; the engine still reads one token (a
request always generates), which the response leaves out, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from detlora.entrypoints.openai.errors import bad_request
from detlora.entrypoints.openai.protocol import CompletionRequest


@dataclass(frozen=True)
class EchoPlan:
    """What the engine runs for a completion request and what the response shows."""

    max_tokens: int | None  # the engine's max_tokens (1 where the request says 0)
    prompt_logprobs: int | None  # the engine's prompt_logprobs (echo + logprobs: logprobs)
    echo: bool
    prompt_only: bool  # max_tokens 0 with echo: the prompt alone


def plan(req: CompletionRequest) -> EchoPlan:
    """The engine's side of ``req`` (400 for the combinations vLLM refuses)."""
    if req.max_tokens is not None and req.max_tokens < 0:
        raise bad_request(f"max_tokens must be >= 0, got {req.max_tokens}", "max_tokens")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens=0 generates nothing: it is allowed only with echo=true "
                          "(the prompt, and with logprobs its tokens' logprobs)", "max_tokens")
    if req.stream and req.prompt_logprobs is not None and req.prompt_logprobs > 0:
        raise bad_request("prompt_logprobs are not available with stream=true (echo with "
                          "logprobs streams the prompt tokens' logprobs)", "prompt_logprobs")
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = req.logprobs
    prompt_only = req.echo and req.max_tokens == 0
    return EchoPlan(max_tokens=1 if prompt_only else req.max_tokens,
                    prompt_logprobs=prompt_logprobs, echo=req.echo, prompt_only=prompt_only)


def echoed(plan: EchoPlan, prompt_text: str, prompt_ids: list[int],
           prompt_entries: list | None, text: str, token_ids: list[int],
           entries: list | None) -> tuple[str, list[int], list | None]:
    """(text, token ids, logprob entries) of a choice whose completion is (``text``,
    ``token_ids``, ``entries``): the prompt's before them (``prompt_entries`` starts with
    None), or the prompt's alone for ``max_tokens=0``. Entries are None when either part has
    none."""
    if not plan.echo:
        return text, token_ids, entries
    if plan.prompt_only:
        return prompt_text, list(prompt_ids), prompt_entries
    both = None if prompt_entries is None or entries is None else [*prompt_entries, *entries]
    return prompt_text + text, [*prompt_ids, *token_ids], both


def clamp_logprob(value: float) -> float:
    """A logprob as JSON can carry it: -inf becomes -9999.0, as vLLM and OpenAI send it."""
    return max(value, -9999.0)


def no_tokenizer_echo(tokenizer: Any, plan: EchoPlan) -> None:
    """Echo shows the prompt's text: 400 for a model without a tokenizer."""
    if plan.echo and tokenizer is None:
        raise bad_request("echo needs the model's tokenizer (to show the prompt's text), and "
                          "this model has none", "echo")


__all__ = ["EchoPlan", "clamp_logprob", "echoed", "no_tokenizer_echo", "plan"]
