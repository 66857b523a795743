"""The generation routes answered straight from ASGI: ``POST /v1/completions`` and
``POST /v1/chat/completions`` without FastAPI's per-request layers.

These two routes are the front end's per-request work under load, and their requests come in
waves (clients whose answers ended together send their next ones together) that the one event
loop handles one after another, so each request's cost adds to the wave's time to first
token. FastAPI's way to a route (its error, telemetry and body-limit middlewares, the router,
dependency solving for a bare ``Request``, its exit stacks) costs about as much as the route's
own work. ``DirectRoutes`` sits where FastAPI sat (inside the API-key and size guard) and
calls the same handlers itself; every other request (other paths and methods, a
``root_path``) goes to FastAPI.

The answers are FastAPI's: an ``OpenAIError`` is answered with its response; any other
exception is logged and answered 500 by ``internal_error``, then raised on to the server, as
FastAPI's error middleware does. FastAPI's OpenTelemetry spans (made only when a tracer or
meter is configured in the server's process) are not made for these two routes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from detlora.entrypoints.openai.errors import OpenAIError, internal_error
from detlora.entrypoints.openai.request_body import parse_body
from detlora.entrypoints.openai.security import BodyTooLarge, too_large

Handler = Callable[[Any, Request], Awaitable[Response]]


@dataclass(frozen=True)
class DirectRoute:
    """A POST route: its body's model and the handler of (body, request)."""

    model: type[BaseModel]
    handler: Handler


class DirectRoutes:
    """ASGI: the ``routes`` (by exact path, POST only) answered here, the rest by ``app``."""

    def __init__(self, app: ASGIApp, routes: dict[str, DirectRoute], *,
                 max_body_bytes: int) -> None:
        self.app = app
        self.routes = routes
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = None
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            route = self.routes.get(scope["path"])
        if route is None:
            await self.app(scope, receive, send)
            return
        scope["app"] = self.app  # as Starlette sets it: ``request.app`` is the FastAPI app
        started = False

        async def sender(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            try:
                body = parse_body(await self._read(receive), route.model)
                response = await route.handler(body, Request(scope, receive, sender))
                await response(scope, receive, sender)
            except OpenAIError as exc:
                if started:  # Starlette's rule for a handled exception
                    raise RuntimeError("Caught handled exception, but response already "
                                       "started.") from exc
                await exc.response()(scope, receive, sender)
        except Exception as exc:
            response = await internal_error(Request(scope), exc)
            if not started:
                await response(scope, receive, send)
            raise

    async def _read(self, receive: Receive) -> bytes:
        """The whole body (Starlette's ``Request.body``; 413 past the guard's cap)."""
        chunks: list[bytes] = []
        try:
            while True:
                message = await receive()
                if message["type"] == "http.request":
                    chunk = message.get("body", b"")
                    if chunk:
                        chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
                elif message["type"] == "http.disconnect":
                    raise ClientDisconnect()
        except BodyTooLarge:
            raise too_large(self.max_body_bytes) from None


__all__ = ["DirectRoute", "DirectRoutes"]
