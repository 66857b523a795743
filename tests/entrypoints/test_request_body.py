"""``parse_body`` validates a body from its bytes in one pass, and gives exactly what the
two-pass way (``json.loads``, an object check, ``model_validate``) gives: the same model for a
body both take, the same 400 for one either refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from detlora.entrypoints.openai.errors import OpenAIError
from detlora.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DecisionsRequest,
)
from detlora.entrypoints.openai.request_body import parse_body


def _two_pass(raw: bytes, model: type[BaseModel]) -> Any:
    """The body as the server read it before: json.loads, then the model."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        return ("error", f"the body is not valid JSON: {e}", None)
    if not isinstance(data, dict):
        return ("error", "the body must be a JSON object", None)
    try:
        return ("ok", model.model_validate(data).model_dump(by_alias=True))
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        return ("error", f"{where}: {first.get('msg')}" if where else str(first.get("msg")),
                where or None)


def _one_pass(raw: bytes, model: type[BaseModel]) -> Any:
    try:
        return ("ok", parse_body(raw, model).model_dump(by_alias=True))
    except OpenAIError as e:
        assert e.status == 400
        return ("error", e.message, e.param)


COMPLETION_BODIES = [
    b'{"prompt": "a b", "max_tokens": 4}', b'{"prompt": [1, 2, 3]}', b'{"prompt": [[1], [2, 3]]}',
    b'{"prompt": ["a", "b"], "n": 2, "stop": ["x"], "logit_bias": {"5": 1, "6": -1.5}}',
    b'{"model": "a1", "prompt": [5], "temperature": 0.8, "top_p": 0.95, "seed": 7, '
    b'"logprobs": 0, "stream": true, "stream_options": {"include_usage": true}}',
    b'{"prompt": "a", "prompt": [1, 2]}', b'{"prompt": [1.0, 2.0]}', b'{"prompt": ["a", 1]}',
    b'{"prompt": "a", "max_tokens": "16"}', b'{"prompt": "a", "max_tokens": 1.0}',
    b'{"prompt": "a", "max_tokens": 1.5}', b'{"prompt": "a", "max_tokens": 1e20}',
    b'{"prompt": "a", "n": true}', b'{"prompt": "a", "stream": "yes"}',
    b'{"prompt": "a", "stream": 1.0}', b'{"prompt": "a", "stream": "maybe"}',
    b'{"prompt": "a", "top_p": 0.30000000000000004}', b'{"prompt": "a", "top_p": 5e-324}',
    b'{"prompt": "a", "temperature": 1e400}', b'{"prompt": "a", "temperature": -Infinity}',
    b'{"prompt": "a", "seed": 123456789012345678901234567890}', b'{"prompt": "a", "user": 5}',
    b'{"prompt": "a", "response_format": {"type": "json_schema", "json_schema": '
    b'{"schema": {"a": [1, 2.5, null, true, "\\u00e9"]}}}}',
    b'{"prompt": "a", "response_format": {"type": "xml"}}', b'{"prompt": "\\u0000 \\ud83d\\ude00"}',
    b'{"prompt": "a \\ud800"}', b'{"prompt": "\xed\xa0\x80"}', b'{"prompt": "a\xffb"}',
    b'{"prompt": "a\x01b"}', b'\xef\xbb\xbf{"prompt": "a"}', '{"prompt": "a"}'.encode("utf-16"),
    b'  {"prompt": "a"}  \n', b'{"prompt": "a",}', b'{"prompt": "a"} x', b'{"prompt": 01}',
    b"", b"[1, 2]", b'"x"', b"null", b"{}", b'{"prompt": null}',
    b'{"prompt": "a", "x": ' + b"[" * 300 + b"]" * 300 + b"}",
]


@pytest.mark.parametrize("raw", COMPLETION_BODIES)
def test_completion_bodies_as_before(raw: bytes) -> None:
    assert _one_pass(raw, CompletionRequest) == _two_pass(raw, CompletionRequest)


@pytest.mark.parametrize("raw", [
    b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 2}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}',
    b'{"messages": [{"role": "user"}], "tool_choice": {"x": [1, 2.5]}}',
    b'{"messages": "hi"}', b'{"messages": [{"content": "hi"}]}', b'{"messages": []}',
])
def test_chat_bodies_as_before(raw: bytes) -> None:
    assert _one_pass(raw, ChatCompletionRequest) == _two_pass(raw, ChatCompletionRequest)


@pytest.mark.parametrize("raw", [
    b'{"state": {"a": [1, 2.5e3, "x"]}, "questions": {"q": {"type": "noul", "criteria": "c"}}}',
    b'{"state": "s", "questions": {"q": {"criteria": "c"}}}', b'{"state": "s"}',
])
def test_decision_bodies_as_before(raw: bytes) -> None:
    assert _one_pass(raw, DecisionsRequest) == _two_pass(raw, DecisionsRequest)


def test_nesting_past_the_parser_limit_fails_as_before() -> None:
    raw = b'{"prompt": "a", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(RecursionError):
        json.loads(raw)
    with pytest.raises(RecursionError):
        parse_body(raw, CompletionRequest)
