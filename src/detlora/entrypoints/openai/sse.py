"""Server-sent events of the streamed routes: cheap per chunk, the same bytes as before.

A streamed response sends one event per delta of each choice, so its per-chunk work is the
front end's per-token cost. ``CompletionChunks`` and ``ChatChunks`` write each event from
text parts fixed once per response (id, created, model, fingerprint, the choice's index) and
the few values that change, each encoded exactly as ``json.dumps`` encodes it: the events are
byte for byte ``"data: " + json.dumps(chunk) + "\\n\\n"`` of the chunk dicts the routes used to
build. ``SSEResponse`` hands the body chunks to the server's own ``send`` once the response has
started (the middlewares in between only look at ``http.response.start``), and ends the body
with the chunk that carries ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

# json.dumps' defaults (separators ", " and ": ", ASCII only): dumps(x) == json.dumps(x).
dumps = json.JSONEncoder().encode
encode_str = json.encoder.encode_basestring_ascii  # what json.dumps does with a str

DONE = "data: [DONE]\n\n"
RAW_SEND = "detlora.raw_send"  # the scope key of the server's own ``send`` (set by the app)


def _null_or(value: Any) -> str:
    return "null" if value is None else dumps(value)


class CompletionChunks:
    """The ``text_completion`` events of one streamed completion response."""

    def __init__(self, rid: str, created: int, model: str, fingerprint: str) -> None:
        self._head = (f'data: {{"id": {encode_str(rid)}, "object": "text_completion", '
                      f'"created": {dumps(created)}, "model": {encode_str(model)}, '
                      '"choices": [{"index": ')
        self._tail = f'}}], "system_fingerprint": {encode_str(fingerprint)}}}\n\n'
        self._usage_head = (f'data: {{"id": {encode_str(rid)}, "object": "text_completion", '
                            f'"created": {dumps(created)}, "model": {encode_str(model)}, '
                            f'"choices": [], "system_fingerprint": {encode_str(fingerprint)}, '
                            '"usage": ')

    def choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None,
               stop_reason: int | str | None, token_ids: list[int] | None) -> str:
        """One choice's delta: ``{"index", "text", "logprobs", "finish_reason",
        "stop_reason"[, "token_ids"]}``."""
        parts = [self._head, str(index), ', "text": ', encode_str(text), ', "logprobs": ',
                 "null" if logprobs is None else dumps(logprobs), ', "finish_reason": ',
                 "null" if finish_reason is None else encode_str(finish_reason),
                 ', "stop_reason": ', _null_or(stop_reason)]
        if token_ids is not None:
            parts += (', "token_ids": ', dumps(token_ids))
        parts.append(self._tail)
        return "".join(parts)

    def usage(self, usage: dict[str, Any]) -> str:
        """The last event with ``stream_options.include_usage``: no choices, the usage."""
        return f"{self._usage_head}{dumps(usage)}}}\n\n"


class ChatChunks:
    """The ``chat.completion.chunk`` events of one streamed chat response."""

    def __init__(self, rid: str, created: int, model: str, fingerprint: str) -> None:
        self._head = (f'data: {{"id": {encode_str(rid)}, "object": "chat.completion.chunk", '
                      f'"created": {dumps(created)}, "model": {encode_str(model)}, '
                      f'"system_fingerprint": {encode_str(fingerprint)}, "choices": [')

    def role(self, index: int) -> str:
        """A choice's first event: the assistant's role, as OpenAI sends it."""
        return (f'{self._head}{{"index": {index}, "delta": {{"role": "assistant", '
                '"content": ""}, "logprobs": null, "finish_reason": null}]}\n\n')

    def choice(self, index: int, text: str | None, logprobs: dict | None,
               finish_reason: str | None, stop_reason: int | str | None, finished: bool,
               token_ids: list[int] | None) -> str:
        """One choice's delta: ``{"index", "delta", "logprobs", "finish_reason"[,
        "stop_reason" once finished][, "token_ids"]}``; ``text`` None: an empty delta."""
        parts = [self._head, '{"index": ', str(index),
                 ', "delta": {}' if text is None else
                 f', "delta": {{"content": {encode_str(text)}}}',
                 ', "logprobs": ', "null" if logprobs is None else dumps(logprobs),
                 ', "finish_reason": ',
                 "null" if finish_reason is None else encode_str(finish_reason)]
        if finished:
            parts += (', "stop_reason": ', _null_or(stop_reason))
        if token_ids is not None:
            parts += (', "token_ids": ', dumps(token_ids))
        parts.append("}]}\n\n")
        return "".join(parts)

    def usage(self, usage: dict[str, Any]) -> str:
        """The last event with ``stream_options.include_usage``: no choices, the usage."""
        return f'{self._head}], "usage": {dumps(usage)}}}\n\n'


def event(payload: dict[str, Any]) -> str:
    """Any other event (an error): ``data: <json>``."""
    return f"data: {dumps(payload)}\n\n"


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response of str chunks, the last one ending in ``DONE``.

    Body chunks go to the server's ``send`` itself when the app put it in the scope (under
    ``RAW_SEND``): the middlewares and exception handlers between only watch the start of the
    response, and skipping their wrappers saves a few coroutine calls per chunk. The chunk
    that ends in ``DONE`` also ends the body (``more_body`` false), so the response does not
    need one more write for its end.

    A client that goes away mid-stream stops the stream, as Starlette's ``StreamingResponse``
    does, but watched by one plain task that cancels the streaming one, instead of an AnyIO
    task group of two tasks (cheaper per response).
    """

    def __init__(self, content: AsyncIterable[str]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._raw_send: Send | None = None
        self._streaming = False  # the stream is being written (the watcher may stop it)
        self._disconnected = False  # the watcher saw the client go and stopped the stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._raw_send = scope.get(RAW_SEND)
        task = asyncio.current_task()
        assert task is not None
        self._streaming = True
        watcher = asyncio.get_running_loop().create_task(self._stop_on_disconnect(receive, task))
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            # The watcher's cancellation ends the response quietly; any other goes on.
            uncancel = getattr(task, "uncancel", None)  # Python 3.11+
            if not self._disconnected or (uncancel is not None and uncancel() > 0):
                raise
        finally:
            self._streaming = False
            watcher.cancel()
        if self.background is not None:
            await self.background()

    async def _stop_on_disconnect(self, receive: Receive, task: asyncio.Task) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        if self._streaming:
            self._disconnected = True
            task.cancel()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        body_send = self._raw_send or send
        ended = False
        async for chunk in self.body_iterator:
            ended = chunk.endswith(DONE)
            await body_send({"type": "http.response.body", "body": chunk.encode(),
                             "more_body": not ended})
        if not ended:
            await body_send({"type": "http.response.body", "body": b"", "more_body": False})


__all__ = ["DONE", "RAW_SEND", "ChatChunks", "CompletionChunks", "SSEResponse", "dumps",
           "encode_str", "event"]
