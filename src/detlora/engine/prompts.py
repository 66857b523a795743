"""The prompt forms ``LLM.generate`` accepts, normalised to one shape.

A prompt is text, a list of token ids, ``{"prompt_token_ids": [...]}`` (or ``{"prompt":
text}``), or chat messages ``[{"role": ..., "content": ...}, ...]`` (rendered through the
tokenizer's chat template). ``generate`` takes one prompt or a list of them.
"""

from __future__ import annotations

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


def _is_token_ids(x: object) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x
    )


def parse_prompt(p: object, where: str = "prompt") -> Prompt:
    if isinstance(p, str):
        return Prompt(text=p)
    if _is_token_ids(p):
        return Prompt(token_ids=tuple(p))
    if _is_messages(p):
        for m in p:
            if not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: every chat message needs a string 'content'")
        return Prompt(messages=tuple(dict(m) for m in p))
    if isinstance(p, dict):
        unknown = sorted(str(k) for k in p if k not in _PROMPT_KEYS)
        if unknown:  # a misspelt key must not silently drop what it carried
            raise ValueError(f"{where}: unknown prompt keys {unknown} (known: "
                             f"{sorted(_PROMPT_KEYS)})")
        if "prompt_token_ids" in p:
            ids = p["prompt_token_ids"]
            if not _is_token_ids(ids):
                raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of ints")
            return Prompt(text=p.get("prompt"), token_ids=tuple(ids))
        if isinstance(p.get("prompt"), str):
            return Prompt(text=p["prompt"])
        raise ValueError(f"{where}: a dict prompt needs 'prompt_token_ids' or 'prompt'")
    if isinstance(p, (list, tuple)) and len(p) == 0:
        raise ValueError(f"{where} is empty")
    raise ValueError(
        f"{where} must be text, a list of token ids, {{'prompt_token_ids': [...]}} or chat "
        f"messages [{{'role': ..., 'content': ...}}], got {type(p).__name__}"
    )


def parse_prompts(prompts: object) -> list[Prompt]:
    """One prompt or a list of prompts -> a list of Prompt."""
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts) or _is_messages(prompts):
        return [parse_prompt(prompts)]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts is empty")
        return [parse_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
    return [parse_prompt(prompts)]


def per_prompt(value: object, n: int, name: str, check: Callable[[object], bool]) -> list:
    """``value`` is one item for every prompt, or a list with one item per prompt."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries but there are {n} prompts "
                             "(give one, or one per prompt)")
        items = list(value)
    else:
        items = [value] * n
    for i, item in enumerate(items):
        if not check(item):
            raise ValueError(f"{name}[{i}] has the wrong type: {type(item).__name__}")
    return items
