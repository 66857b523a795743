"""The model directory's tokenizer, through transformers (imported only when one exists).

Token-id prompts need no tokenizer; text and chat prompts do, and outputs carry text only
when there is one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / name).is_file() for name in _TOKENIZER_FILES)


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover - transformers is a declared dependency
            raise ValueError(f"reading the tokenizer in {path} needs transformers: {e}") from None
        if not Path(path).is_dir():  # else transformers reads the path as a Hub repo id
            raise FileNotFoundError(f"tokenizer directory {path} does not exist")
        try:
            self.hf: Any = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:
            raise ValueError(f"cannot load the tokenizer in {path}: {e}") from None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.hf.eos_token_id
        return () if eos is None else (int(eos),)

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=True)["input_ids"])

    def encode_chat(
        self, messages: Sequence[dict], add_generation_prompt: bool = True
    ) -> list[int]:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("the tokenizer has no chat template, so chat messages cannot be "
                             "rendered (pass text or token ids instead)")
        text = self.hf.apply_chat_template(list(messages), tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        # The template writes any BOS itself.
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=True)
