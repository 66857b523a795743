"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with its status.

Messages say what was wrong with the request; they never carry a stack trace, and paths only
where the client gave them (an adapter path under ``--lora-root``).
"""

from __future__ import annotations

import json
import logging

from starlette.requests import Request
from starlette.responses import Response

logger = logging.getLogger("detlora.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "server_overloaded"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return Response(json.dumps(self.body()), status_code=self.status, headers=headers,
                        media_type="application/json")


async def internal_error(request: Request, exc: Exception) -> Response:
    """The answer to an unexpected exception: logged here with its trace, answered 500
    without it."""
    logger.error("unexpected error on %s: %s: %s", request.url.path, type(exc).__name__,
                 exc, exc_info=exc)
    return OpenAIError(500, "internal server error").response()


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_request")


def model_not_found(name: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{name}` does not exist.", param="model",
                       code="model_not_found")


def overloaded(message: str) -> OpenAIError:
    return OpenAIError(503, message, code="server_overloaded")


__all__ = ["OpenAIError", "bad_request", "internal_error", "model_not_found", "overloaded"]
