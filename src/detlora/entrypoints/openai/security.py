"""ASGI middleware in front of every route: the API key and the body-size cap.

Plain ASGI (not Starlette's BaseHTTPMiddleware, which buffers streamed responses). With an
API key, every ``/v1`` route needs ``Authorization: Bearer KEY`` (or ``x-api-key``), compared
in constant time (``hmac.compare_digest``); ``/health`` and ``/metrics`` stay open, as in vLLM.
A body longer than ``max_bytes`` gets 413 as soon as its declared length (or its running
count) passes the cap, before it is read whole.
"""

from __future__ import annotations

import hmac
from typing import Any

from detlora.entrypoints.openai.errors import OpenAIError

Scope = dict[str, Any]


class BodyTooLarge(Exception):
    """Raised by ``receive`` once a body passes the cap (handlers answer 413)."""


class GuardMiddleware:
    def __init__(self, app: Any, *, api_key: str | None, max_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_bytes = max_bytes

    def _authorized(self, scope: Scope) -> bool:
        assert self.api_key is not None
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
            elif name == b"x-api-key" and not given:
                given = value.strip()
        return hmac.compare_digest(given, self.api_key)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        if self.api_key is not None and path.startswith("/v1") and not self._authorized(scope):
            await _send_error(send, OpenAIError(401, "missing or wrong API key",
                                                code="invalid_api_key"))
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await _send_error(send, too_large(self.max_bytes))
                    return
        seen = 0
        started = False

        async def counted_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge
            return message

        async def tracked_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await _send_error(send, too_large(self.max_bytes))


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than this server's limit of {limit} "
                       "bytes", code="request_too_large")


async def _send_error(send: Any, error: OpenAIError) -> None:
    response = error.response()
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


__all__ = ["BodyTooLarge", "GuardMiddleware", "too_large"]
