"""The streamed routes' events, written from templates, are byte for byte what
``"data: " + json.dumps(chunk) + "\\n\\n"`` gives for the chunk dicts the routes used to build."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from detlora.entrypoints.openai.sse import ChatChunks, CompletionChunks

IDS = ("cmpl-0123abc", 'odd "id"\\ é')
TEXTS = ("", " hello", "é ☃ \U0001f600", 'quote " back \\ nl \n tab \t \x00', "\ufffd")
LOGPROBS: tuple[dict | None, ...] = (
    None,
    {"tokens": [" a"], "token_logprobs": [-1.2345678901234567], "top_logprobs": [None],
     "text_offset": [3]},
    {"tokens": ["é", "b"], "token_logprobs": [float("-inf"), 0.0],
     "top_logprobs": [{"é": -0.5, "x": -1e-300}, {"b": float("nan")}], "text_offset": [0, 1]},
    {"content": [{"token": "a", "logprob": -0.25, "bytes": [97], "top_logprobs": []}]},
)
ENDINGS: tuple[tuple[str | None, Any], ...] = (
    (None, None), ("length", None), ("stop", 7), ("stop", "END\u2603"), ("abort", None))


def _event(chunk: dict) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


@pytest.mark.parametrize("rid", IDS)
def test_completion_events_equal_json_dumps(rid: str) -> None:
    created, model, fp = 1_700_000_000, "a0 \u00e9", "fp-123"
    chunks = CompletionChunks(rid, created, model, fp)
    for index, text, lps, (reason, stop), ids in itertools.product(
            (0, 3, 12), TEXTS, LOGPROBS, ENDINGS, (None, [], [5, 0, 2047])):
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": lps,
                                  "finish_reason": reason, "stop_reason": stop}
        if ids is not None:
            choice["token_ids"] = ids
        want = _event({"id": rid, "object": "text_completion", "created": created,
                       "model": model, "choices": [choice], "system_fingerprint": fp})
        assert chunks.choice(index, text, lps, reason, stop, ids) == want
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
             "prompt_tokens_details": {"cached_tokens": 0}}
    assert chunks.usage(usage) == _event(
        {"id": rid, "object": "text_completion", "created": created, "model": model,
         "choices": [], "system_fingerprint": fp, "usage": usage})


@pytest.mark.parametrize("rid", IDS)
def test_chat_events_equal_json_dumps(rid: str) -> None:
    created, model, fp = 1_700_000_000, "tox", "fp-\u00e9"
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": fp}
    chunks = ChatChunks(rid, created, model, fp)
    for index in (0, 5):
        role = {"index": index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}
        assert chunks.role(index) == _event({**head, "choices": [role]})
    for index, text, lps, (reason, stop), ids in itertools.product(
            (0, 2), TEXTS, LOGPROBS, ENDINGS, (None, [9])):
        finished = reason is not None
        choice: dict[str, Any] = {
            "index": index, "delta": {"content": text} if text or not finished else {},
            "logprobs": lps, "finish_reason": reason}
        if finished:
            choice["stop_reason"] = stop
        if ids is not None:
            choice["token_ids"] = ids
        got = chunks.choice(index, text if text or not finished else None, lps, reason, stop,
                            finished, ids)
        assert got == _event({**head, "choices": [choice]})
    usage = {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3,
             "prompt_tokens_details": {"cached_tokens": 2}}
    assert chunks.usage(usage) == _event({**head, "choices": [], "usage": usage})
