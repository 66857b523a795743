"""The OpenAI-compatible server: FastAPI routes over one ``AsyncLLM``, run by uvicorn.

Routes: ``GET /health``, ``GET /v1/models``, ``GET /metrics``, ``POST /v1/completions``,
``POST /v1/chat/completions``, ``POST /v1/decisions``, ``POST /v1/systemone``, and with
runtime loading on ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``. Every response
carries ``system_fingerprint``: equal fingerprints and equal requests (seed included) give
equal outputs at ``batch_invariant``, whatever else the server runs. Errors are OpenAI-shaped
JSON; an unexpected exception is logged here and answered 500 without its trace.

``run_server`` binds the port first (a port in use fails at once, and port 0 takes a free one
that the log line names), starts the engine process, loads ``--lora-modules``, serves until
SIGINT or SIGTERM, then lets in-flight requests finish (up to ``graceful_timeout`` seconds;
the rest are aborted) and stops the engine.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from detlora.audit.records import AuditRecorder
from detlora.engine.async_llm import AsyncLLM
from detlora.engine_args import EngineArgs
from detlora.entrypoints.openai.direct_routes import DirectRoute, DirectRoutes
from detlora.entrypoints.openai.errors import OpenAIError, internal_error
from detlora.entrypoints.openai.metrics import ServerMetrics
from detlora.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DecisionsRequest,
    LoadLoRAAdapterRequest,
    SystemOneRequest,
    UnloadLoRAAdapterRequest,
)
from detlora.entrypoints.openai.request_body import read_body
from detlora.entrypoints.openai.security import GuardMiddleware
from detlora.entrypoints.openai.server_config import ServerConfig
from detlora.entrypoints.openai.serving_chat import ServingChat
from detlora.entrypoints.openai.serving_completion import ServingCompletion
from detlora.entrypoints.openai.serving_decisions import ServingDecisions
from detlora.entrypoints.openai.serving_models import ServingModels
from detlora.entrypoints.openai.sse import RAW_SEND

logger = logging.getLogger("detlora.server")

_ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
           "/v1/decisions", "/v1/systemone", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")


class _CountStatus:
    """ASGI wrapper: counts responses by route and status for /metrics, and puts the
    server's own ``send`` in the scope for ``SSEResponse``'s body chunks."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in _ROUTES else "other"
        scope[RAW_SEND] = send

        async def counting_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_response(route, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


def build_app(llm: AsyncLLM, models: ServingModels, config: ServerConfig,
              audit: AuditRecorder | None = None) -> Any:
    """The ASGI application: FastAPI (its generation routes' POSTs answered directly,
    ``direct_routes``) inside the guard and the status counter. ``audit``: the audit log
    every finished request and decision goes to."""
    app = FastAPI(title="detlora", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(llm, config.served_model_name,
                            audit=audit.stats if audit is not None else None)
    app.state.config = config
    app.state.llm = llm
    app.state.metrics = metrics
    completions = ServingCompletion(llm, models, config, metrics, audit)
    chat = ServingChat(llm, models, config, metrics, audit)
    decisions = ServingDecisions(llm, models, config, metrics, audit)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> Response:
        return exc.response()

    app.add_exception_handler(Exception, internal_error)

    @app.get("/health")
    async def health() -> Response:
        if not llm.is_alive:
            return OpenAIError(503, "the engine is not running").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse(models.list())

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await completions.create(await read_body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await chat.create(await read_body(request, ChatCompletionRequest), request)

    @app.post("/v1/decisions")
    async def create_decision(request: Request) -> Response:
        req = await read_body(request, DecisionsRequest)
        return await decisions.decide(req, request, systemone=False)

    @app.post("/v1/systemone")
    async def create_systemone(request: Request) -> Response:
        req = await read_body(request, SystemOneRequest)
        return await decisions.decide(req, request, systemone=True)

    if config.enable_lora_loading:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            req = await read_body(request, LoadLoRAAdapterRequest)
            await models.add(req.lora_name, req.lora_path, trusted=False)
            return JSONResponse({"status": "ok", "lora_name": req.lora_name})

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            req = await read_body(request, UnloadLoRAAdapterRequest)
            await models.remove(req.lora_name)
            return JSONResponse({"status": "ok", "lora_name": req.lora_name})

    async def decide_direct(req: DecisionsRequest, request: Request) -> Response:
        return await decisions.decide(req, request, systemone=False)

    async def systemone_direct(req: SystemOneRequest, request: Request) -> Response:
        return await decisions.decide(req, request, systemone=True)

    # The generation and decision routes stay FastAPI's too (their other methods get its
    # 405), but their POSTs are answered by DirectRoutes, without FastAPI's per-request
    # layers.
    asgi: Any = DirectRoutes(app, {
        "/v1/completions": DirectRoute(CompletionRequest, completions.create),
        "/v1/chat/completions": DirectRoute(ChatCompletionRequest, chat.create),
        "/v1/decisions": DirectRoute(DecisionsRequest, decide_direct),
        "/v1/systemone": DirectRoute(SystemOneRequest, systemone_direct),
    }, max_body_bytes=config.max_request_bytes)
    if config.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        asgi = CORSMiddleware(asgi, allow_origins=list(config.cors_origins),
                              allow_methods=["GET", "POST"],
                              allow_headers=["authorization", "content-type", "x-api-key"])
    asgi = GuardMiddleware(asgi, api_key=config.api_key, max_bytes=config.max_request_bytes)
    return _CountStatus(asgi, metrics)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not listening yet: bound before the engine starts,
    so the port is ours while it loads. Port 0 takes a free port. Raises ValueError naming
    the address when it cannot be bound.

    Made from ``getaddrinfo`` as asyncio's ``create_server`` makes its own: the protocol must
    be ``IPPROTO_TCP``, or asyncio does not set ``TCP_NODELAY`` on accepted connections and
    small writes wait for the client's delayed ACK (Nagle)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


async def serve(engine_config: EngineArgs, config: ServerConfig, sock: socket.socket, *,
                tokenizer_dir: str | None = None) -> None:
    """Start the engine, serve on ``sock`` (bound, from ``bind_socket``) until a signal, then
    shut down gracefully."""
    import uvicorn

    from detlora.entrypoints.openai.front_ends import (
        spawn_front_ends,
        stop_front_ends,
        unfinished_share,
    )

    llm = await AsyncLLM.start(
        engine_config, tokenizer_dir=tokenizer_dir,
        max_unfinished=unfinished_share(engine_config, config),
        front_ends=config.api_server_count)
    audit = None
    others: list[Any] = []
    try:
        if config.audit_log is not None:
            from detlora.audit.writer import AuditConfig

            audit = AuditRecorder(
                AuditConfig(config.audit_log, hash_only=config.audit_log_hash_only,
                            max_bytes=config.audit_log_max_bytes),
                model=config.served_model_name, engine_args=engine_config,
                fingerprint_parts=llm.info.fingerprint_parts, writer="detlora serve")
            logger.info("audit log: %s%s", config.audit_log,
                        " (hashes only)" if config.audit_log_hash_only else "")
        # Further front ends (--api-server-count) serve the same socket over this engine.
        others = await asyncio.to_thread(spawn_front_ends, llm, engine_config, config, sock,
                                         tokenizer_dir)
        models = ServingModels(llm, config.served_model_name, lora_root=config.lora_root,
                               enable_loading=config.enable_lora_loading)
        for name, path in config.lora_modules:
            try:
                await models.add(name, path, trusted=True)
            except OpenAIError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e.message}") from None
        app = build_app(llm, models, config, audit)
        uv = uvicorn.Server(uvicorn.Config(
            app, host=config.host, port=config.port, log_level=config.log_level,
            timeout_graceful_shutdown=max(1, int(config.graceful_timeout)),
            access_log=False, lifespan="off"))
        # What start-up built lives as long as the server: out of the collector's way, so
        # that the full collections that per-chunk garbage triggers stay short.
        gc.collect()
        gc.freeze()
        await uv.serve(sockets=[sock])
    finally:
        if others:  # their requests finish first, on the engine that is still up
            await asyncio.to_thread(stop_front_ends, others, config.graceful_timeout + 10)
        await llm.shutdown(drain=False)
        if audit is not None:  # what the last requests left in its queue, then synced
            audit.close()


def run_server(engine_config: EngineArgs, config: ServerConfig,
               tokenizer_dir: str | None = None) -> int:
    """``detlora serve``: blocks until the server stops; the exit status."""
    import signal

    def stop(signum: int, frame: Any) -> None:
        # Before uvicorn serves, and once it re-raises the signal after its graceful
        # shutdown: unwind (the engine stops in ``serve``'s finally) and exit 0.
        raise SystemExit(0)

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sock = bind_socket(config.host, config.port)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    logger.info("serving %s on http://%s:%d (determinism=%s)", config.served_model_name,
                url_host, port, engine_config.resolved_determinism.value)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        asyncio.run(serve(engine_config, config, sock, tokenizer_dir=tokenizer_dir))
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        sock.close()
    return 0


__all__ = ["bind_socket", "build_app", "read_body", "run_server", "serve"]
