"""A request's JSON body as its pydantic model: 413 past the size cap, 400 for bad JSON or fields.

A body is validated from its bytes in one pass (``model_validate_json``). One that fails there
is parsed again the way the messages are defined (``json.loads``, an object check, then the
model), so a refused body gets the same 400 either way, and a body only Python's parser reads
(another encoding, a lone surrogate escape) is still taken.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from detlora.entrypoints.openai.errors import bad_request
from detlora.entrypoints.openai.security import BodyTooLarge, too_large

M = TypeVar("M", bound=BaseModel)


def parse_body(raw: bytes, model: type[M]) -> M:
    """``raw`` as ``model`` (400 naming the first problem)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError:
        pass
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise bad_request(f"{where}: {first.get('msg')}" if where else str(first.get("msg")),
                          where or None) from None


async def read_body(request: Request, model: type[M]) -> Any:
    """The JSON body of a FastAPI route's request as ``model``."""
    try:
        raw = await request.body()
    except BodyTooLarge:
        raise too_large(request.app.state.config.max_request_bytes) from None
    return parse_body(raw, model)


__all__ = ["parse_body", "read_body"]
