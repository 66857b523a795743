"""The model's tokenizer, through transformers (imported only when one exists).

Token-id prompts need no tokenizer; text and chat prompts do, and outputs carry text only
when there is one. ``hf`` is the Hugging Face tokenizer itself (what ``LLM.get_tokenizer``
returns); the methods here are the engine's own uses of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / name).is_file() for name in _TOKENIZER_FILES)


class Tokenizer:
    def __init__(self, path: str | Path, *, mode: str = "auto",
                 trust_remote_code: bool = False) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover - transformers is a declared dependency
            raise ValueError(f"reading the tokenizer in {path} needs transformers: {e}") from None
        if not Path(path).is_dir():  # else transformers reads the path as a Hub repo id
            raise FileNotFoundError(f"tokenizer directory {path} does not exist")
        try:
            self.hf: Any = AutoTokenizer.from_pretrained(
                str(path), use_fast=mode != "slow", trust_remote_code=trust_remote_code)
        except Exception as e:
            raise ValueError(f"cannot load the tokenizer in {path}: {e}") from None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.hf.eos_token_id
        return () if eos is None else (int(eos),)

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=True)["input_ids"])

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
        continue_final_message: bool = False, chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Render ``messages`` through the chat template (``chat_template`` replaces the
        tokenizer's) and encode the text; vLLM's arguments."""
        if chat_template is None and not getattr(self.hf, "chat_template", None):
            raise ValueError("the tokenizer has no chat template, so chat messages cannot be "
                             "rendered (pass chat_template=..., or text or token ids)")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message=True continues the last message: it "
                             "needs add_generation_prompt=False")
        if continue_final_message and messages[-1].get("role") != "assistant":
            raise ValueError("continue_final_message=True needs an assistant message last")
        extra = dict(chat_template_kwargs or {})
        clash = sorted(set(extra) & {"add_generation_prompt", "continue_final_message",
                                     "chat_template", "tools", "tokenize", "conversation"})
        if clash:
            raise ValueError(f"chat_template_kwargs must not set {clash}: they are arguments "
                             "of their own")
        try:
            text = self.hf.apply_chat_template(
                [dict(m) for m in messages], tokenize=False, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=list(tools) if tools is not None else None, **extra)
        except Exception as e:  # a template error (jinja2) names the template's problem
            raise ValueError(f"the chat template failed on these messages: {e}") from None
        # The template writes any BOS itself.
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token alone, as text (special tokens included)."""
        return self.hf.decode([token_id])
