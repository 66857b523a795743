"""The prompt forms ``LLM.generate`` accepts, normalised to one shape.

A prompt is text, token ids (a list of Python or numpy integers, a 1-D integer numpy array or
torch tensor), ``{"prompt_token_ids": [...]}`` (or ``{"prompt": text}``), or chat messages
``[{"role": ..., "content": ...}, ...]`` (rendered through the tokenizer's chat template; a
content may be a list of text parts). ``generate`` takes one prompt or a list of them.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Prompt:
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None


_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})  # vLLM's TextPrompt / TokensPrompt


def _is_messages(x: object) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(
        isinstance(m, dict) and "role" in m for m in x
    )


def _is_id(t: object) -> bool:
    """A Python or numpy integer (a bool is not a token id)."""
    if type(t) is int:
        return True
    return isinstance(t, numbers.Integral) and not isinstance(t, bool) and \
        type(t).__name__ != "bool_"


def _is_array(x: object) -> bool:
    """A numpy array or a torch tensor (checked by name: neither is imported for this)."""
    return type(x).__module__ in ("numpy", "torch") and hasattr(x, "ndim") \
        and hasattr(x, "tolist")


def _is_token_ids(x: object) -> bool:
    """Token ids: a non-empty list or tuple of integers, or a 1-D array or tensor."""
    if _is_array(x):
        return x.ndim == 1  # type: ignore[attr-defined]
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(_is_id(t) for t in x)


def token_id_list(ids: object, where: str = "prompt_token_ids") -> list[int]:
    """``ids`` as a list of Python ints: a list or tuple of Python or numpy integers, or a
    1-D integer numpy array or torch tensor. Anything else is a ValueError naming the
    offending element and its type."""
    if _is_array(ids):
        dtype = str(ids.dtype)  # type: ignore[attr-defined]
        if ids.ndim != 1:  # type: ignore[attr-defined]
            raise ValueError(f"{where} must be 1-D, got a {ids.ndim}-D "  # type: ignore
                             f"{type(ids).__name__}")
        if not any(k in dtype for k in ("int", "uint")) or "bool" in dtype:
            raise ValueError(f"{where} must hold integers, got a {type(ids).__name__} of "
                             f"{dtype}")
        return [int(t) for t in ids.tolist()]  # type: ignore[attr-defined]
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{where} must be a list of token ids, got {type(ids).__name__}")
    if set(map(type, ids)) == {int}:  # plain ints (the common case), checked in C
        return list(ids)
    for i, t in enumerate(ids):
        if not _is_id(t):
            raise ValueError(f"{where}[{i}] must be an integer token id, got "
                             f"{type(t).__name__} {t!r}")
    return [int(t) for t in ids]


def _message_content(m: dict[str, Any], where: str) -> dict[str, Any]:
    """The message with its content as text: a string, or a list of {"type": "text",
    "text": ...} parts (joined by newlines, as vLLM's "string" content format)."""
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ValueError(f"{where}: a message content part must be "
                                 f"{{'type': 'text', 'text': ...}} (text only), got {part!r}")
            texts.append(part["text"])
        return {**m, "content": "\n".join(texts)}
    if not isinstance(content, str):
        raise ValueError(f"{where}: every chat message needs a 'content' (text, or a list of "
                         f"text parts), got {type(content).__name__}")
    return dict(m)


def parse_prompt(p: object, where: str = "prompt") -> Prompt:
    if isinstance(p, str):
        return Prompt(text=p)
    if _is_messages(p):
        return Prompt(messages=tuple(_message_content(m, where) for m in p))
    if _is_array(p) or (isinstance(p, (list, tuple)) and p
                        and not any(isinstance(x, dict) for x in p)):
        ids = token_id_list(p, where)
        if not ids:
            raise ValueError(f"{where} is empty")
        return Prompt(token_ids=tuple(ids))
    if isinstance(p, dict):
        unknown = sorted(str(k) for k in p if k not in _PROMPT_KEYS)
        if unknown:  # a misspelt key must not silently drop what it carried
            raise ValueError(f"{where}: unknown prompt keys {unknown} (known: "
                             f"{sorted(_PROMPT_KEYS)})")
        if "prompt_token_ids" in p:
            ids = token_id_list(p["prompt_token_ids"], f"{where}['prompt_token_ids']")
            if not ids:
                raise ValueError(f"{where}: prompt_token_ids is empty")
            return Prompt(text=p.get("prompt"), token_ids=tuple(ids))
        if isinstance(p.get("prompt"), str):
            return Prompt(text=p["prompt"])
        raise ValueError(f"{where}: a dict prompt needs 'prompt_token_ids' or 'prompt'")
    if isinstance(p, (list, tuple)) and len(p) == 0:
        raise ValueError(f"{where} is empty")
    raise ValueError(
        f"{where} must be text, token ids, {{'prompt_token_ids': [...]}} or chat "
        f"messages [{{'role': ..., 'content': ...}}], got {type(p).__name__}"
    )


def parse_prompts(prompts: object) -> list[Prompt]:
    """One prompt or a list of prompts -> a list of Prompt. A list whose items are all
    integers is one prompt of token ids; a list of lists, several."""
    if _is_array(prompts) and prompts.ndim != 1:  # type: ignore[attr-defined]
        raise ValueError(f"prompts: a {prompts.ndim}-D {type(prompts).__name__} is not a "  # type: ignore
                         "prompt; pass one 1-D array per prompt, in a list")
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts) or _is_messages(prompts):
        return [parse_prompt(prompts)]
    if isinstance(prompts, (list, tuple)) and any(_is_id(x) for x in prompts) and not any(
            isinstance(x, (str, dict, list, tuple)) or _is_array(x) for x in prompts):
        return [parse_prompt(prompts)]  # token ids with a bad one: the error names it
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts is empty")
        return [parse_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
    return [parse_prompt(prompts)]


def per_prompt(value: object, n: int, name: str, check: Callable[[object], bool],
               unit: str = "prompt") -> list:
    """``value`` is one item for every prompt, or a list with one item per prompt (``unit``
    names what is counted in the error: a prompt, a state)."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries but there are {n} {unit}s "
                             f"(give one, or one per {unit})")
        items = list(value)
    else:
        items = [value] * n
    for i, item in enumerate(items):
        if not check(item):
            raise ValueError(f"{name}[{i}] has the wrong type: {type(item).__name__}")
    return items
