"""A POST answered by ``DirectRoutes`` is byte for byte what FastAPI's route with the same
handler answers: bodies, errors (bad JSON, fields, 413 on a declared or a streamed length,
``OpenAIError``, an unexpected exception, logged, answered 500 and raised on to the server),
and ``SSEResponse`` streams. ``SSEResponse`` stops a stream when its client goes away, and
still lets any other cancellation through."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.testclient import TestClient

from detlora.entrypoints.openai.direct_routes import DirectRoute, DirectRoutes
from detlora.entrypoints.openai.errors import OpenAIError, bad_request, internal_error
from detlora.entrypoints.openai.request_body import read_body
from detlora.entrypoints.openai.security import GuardMiddleware
from detlora.entrypoints.openai.sse import DONE, SSEResponse

MAX_BYTES = 2_000


class Body(BaseModel):
    mode: str
    value: int = 0


async def _events(n: int) -> AsyncIterator[str]:
    for i in range(n):
        await asyncio.sleep(0)
        yield f"data: {i}\n\n"
    yield DONE


async def handler(body: Body, request: Request) -> Response:
    if body.mode == "openai":
        raise bad_request(f"value {body.value} is wrong", "value")
    if body.mode == "boom":
        raise RuntimeError("boom")
    if body.mode == "stream":
        return SSEResponse(_events(body.value))
    return JSONResponse({"mode": body.mode, "value": body.value,
                         "app": type(request.app).__name__})


def _app() -> GuardMiddleware:
    """As ``build_app`` makes it: /slow through FastAPI, /direct answered directly (and its
    other methods by FastAPI)."""
    app = FastAPI()
    app.state.config = SimpleNamespace(max_request_bytes=MAX_BYTES)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> Response:
        return exc.response()

    app.add_exception_handler(Exception, internal_error)

    for path in ("/slow", "/direct"):
        @app.post(path)
        async def route(request: Request) -> Response:
            return await handler(await read_body(request, Body), request)

    direct = DirectRoutes(app, {"/direct": DirectRoute(Body, handler)},
                          max_body_bytes=MAX_BYTES)
    return GuardMiddleware(direct, api_key=None, max_bytes=MAX_BYTES)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(_app(), raise_server_exceptions=False) as c:
        yield c


def _answer(r) -> tuple:
    headers = [(k, v) for k, v in r.headers.multi_items() if k != "date"]
    return r.status_code, headers, r.content


@pytest.mark.parametrize("content", [
    b'{"mode": "ok", "value": 3}', b'{"mode": "ok", "value": "4"}', b"{not json", b"", b"[1]",
    b'{"value": 1}', b'{"mode": "ok", "value": 1.5}', b'{"mode": "openai", "value": 7}',
    b'{"mode": "boom"}', b'{"mode": "stream", "value": 3}', b'{"mode": "stream", "value": 0}',
    b'{"mode": "ok", "pad": "' + b"x" * MAX_BYTES + b'"}',
])
def test_direct_answers_equal_fastapi(client: TestClient, content: bytes) -> None:
    headers = {"content-type": "application/json"}
    slow = client.post("/slow", content=content, headers=headers)
    direct = client.post("/direct", content=content, headers=headers)
    assert _answer(direct) == _answer(slow)


def test_streamed_body_past_the_cap(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(5):
            yield b" " * 1000

    slow = client.post("/slow", content=chunks())
    direct = client.post("/direct", content=chunks())
    assert direct.status_code == 413
    assert _answer(direct) == _answer(slow)


def test_other_methods_go_to_fastapi(client: TestClient) -> None:
    assert client.get("/direct").status_code == 405
    assert client.put("/direct", content=b"{}").status_code == 405


def test_unexpected_errors_are_logged_and_raised(caplog: pytest.LogCaptureFixture) -> None:
    with TestClient(_app()) as c, caplog.at_level(logging.ERROR, "detlora.server"):
        for path in ("/slow", "/direct"):
            with pytest.raises(RuntimeError, match="boom"):
                c.post(path, content=b'{"mode": "boom"}')
    messages = [r.getMessage() for r in caplog.records if r.name == "detlora.server"]
    assert messages == ["unexpected error on /slow: RuntimeError: boom",
                        "unexpected error on /direct: RuntimeError: boom"]


async def _stream_until(stop: str) -> tuple[list[str], bool, bool]:
    """An endless SSEResponse, then (``stop``) its client goes away or its task is
    cancelled: (bodies sent, whether the body iterator was closed, whether the response
    raised CancelledError)."""
    closed = False
    gone = asyncio.Event()

    async def endless() -> AsyncIterator[str]:
        nonlocal closed
        try:
            while True:
                await asyncio.sleep(0.001)
                yield "data: x\n\n"
        finally:
            closed = True

    async def receive() -> dict:
        await gone.wait()
        return {"type": "http.disconnect"}

    sent: list[str] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            sent.append(message["body"].decode())

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    task = asyncio.ensure_future(SSEResponse(endless())(scope, receive, send))
    while len(sent) < 3:
        await asyncio.sleep(0.001)
    if stop == "disconnect":
        gone.set()
    else:
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return sent, closed, True
    return sent, closed, False


def test_sse_stops_when_the_client_goes() -> None:
    sent, closed, cancelled = asyncio.run(_stream_until("disconnect"))
    assert sent[:3] == ["data: x\n\n"] * 3 and closed and not cancelled


def test_sse_passes_other_cancellations_on() -> None:
    _, closed, cancelled = asyncio.run(_stream_until("cancel"))
    assert closed and cancelled
