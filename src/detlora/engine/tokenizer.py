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


def check_text(text: str, what: str) -> None:
    """ValueError unless ``text`` is Unicode that UTF-8 can hold: a lone surrogate (JSON's
    ``"\\ud800"``) would otherwise reach the tokenizer, which refuses it with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid text: {e.reason} at character {e.start} "
                         f"({text[e.start]!a})") from None


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
        self._fast_decode: Any = None  # decided on first use (False: none)
        self._fast_encode: Any = None  # decided on first use (False: none)
        self._token_texts: dict[int, str] = {}
        self._one_texts: dict[int, str] = {}  # decode([id]), per id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.hf.eos_token_id
        return () if eos is None else (int(eos),)

    def encode(self, text: str) -> list[int]:
        check_text(text, "the prompt")
        return list(self.hf(text, add_special_tokens=True)["input_ids"])

    def encode_many(self, texts: Sequence[str], *, add_special_tokens: bool = True,
                    what: str = "the prompt", checked: bool = False) -> list[list[int]]:
        """``hf(text, add_special_tokens=...)["input_ids"]`` of every text, in one call of the
        tokenizers backend where that gives the same ids (``_backend_encode``): its batch
        encodes in Rust on every core, where one transformers call per text costs tens of
        microseconds of Python each. ``checked``: every text passed ``check_text`` already."""
        if not checked:
            for i, text in enumerate(texts):
                check_text(text, what if len(texts) == 1 else f"{what} {i}")
        if not texts:
            return []
        if self._fast_encode is None:
            self._fast_encode = _backend_encode(self.hf) or False
        backend = getattr(self.hf, "_tokenizer", None)
        if self._fast_encode and backend.truncation is None and backend.padding is None \
                and backend.encode_special_tokens == bool(self.hf.split_special_tokens):
            return self._fast_encode(list(texts), add_special_tokens)
        return [list(ids) for ids in self.hf(list(texts), add_special_tokens=add_special_tokens)[
            "input_ids"]]

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
        continue_final_message: bool = False, chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Render ``messages`` through the chat template (``chat_template`` replaces the
        tokenizer's) and encode the text; vLLM's arguments."""
        text = self.render_chat(messages, add_generation_prompt,
                                continue_final_message=continue_final_message,
                                chat_template=chat_template,
                                chat_template_kwargs=chat_template_kwargs, tools=tools)
        # The template writes any BOS itself.
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
        continue_final_message: bool = False, chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The text ``encode_chat`` encodes (without special tokens of its own: the template
        writes any BOS itself)."""
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
        check_text(text, "the rendered chat")
        return text

    def decode(self, token_ids: Sequence[int]) -> str:
        """``hf.decode(token_ids, skip_special_tokens=True)``; through the tokenizers
        backend directly where that gives the same text (``_backend_decode``): a server
        decodes a window twice per streamed token, and transformers' wrapper costs several
        times the decode itself. One token's text is remembered per id: a one-token output
        is decoded once per vocabulary entry, not once per request."""
        if len(token_ids) == 1 and type(token_ids[0]) is int:
            key = token_ids[0]
            text = self._one_texts.get(key)
            if text is None:
                text = self._one_texts[key] = self._decode([key])
            return text
        return self._decode(token_ids)

    def _decode(self, token_ids: Sequence[int]) -> str:
        if self._fast_decode is None:
            self._fast_decode = _backend_decode(self.hf) or False
        if self._fast_decode:
            return self._fast_decode(list(token_ids), skip_special_tokens=True)
        return self.hf.decode(list(token_ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token alone, as text (special tokens included); remembered per id."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.hf.decode([token_id])
        return text


# Text whose decoding shows transformers' post-processing when a tokenizer has it: spaces
# before punctuation and contractions (clean_up_tokenization_spaces), accents, CJK, an emoji
# (bytes split over tokens), whitespace runs.
_PROBE = ("Hello , world . It 's a test ! Isn 't it ? We 're here , they 've gone , I 'm "
          "fine . naïve café 東京 🙂 \n\t  end")


def _backend_decode(hf: Any) -> Any:
    """The tokenizers backend's ``decode`` when it is what ``hf.decode`` runs: a fast tokenizer
    whose ``_decode`` is transformers' own (not a model's override) and whose decoding of a
    probe text, its tokens one by one, the first 512 ids and the special tokens, with and
    without special tokens, equals ``hf.decode``'s (post-processing such as
    clean_up_tokenization_spaces is either on for a tokenizer or off, so a probe that holds
    its patterns tells). None otherwise."""
    backend = getattr(hf, "_tokenizer", None)
    impl = getattr(type(hf), "_decode", None)
    if backend is None or not hasattr(backend, "decode") or impl is None \
            or not getattr(impl, "__module__", "").startswith("transformers.tokenization_utils"):
        return None
    try:
        probe = list(hf(_PROBE, add_special_tokens=True)["input_ids"])
        vocab = len(hf)
        samples = [probe, probe[1:], *([i] for i in probe), *([i] for i in range(min(512, vocab))),
                   [int(i) for i in hf.all_special_ids if 0 <= int(i) < vocab]]
        for ids in samples:
            for skip in (True, False):
                if backend.decode(ids, skip_special_tokens=skip) != hf.decode(
                        ids, skip_special_tokens=skip):
                    return None
    except Exception:  # an unusual tokenizer: keep transformers' path
        return None
    return backend.decode


def _backend_encode(hf: Any) -> Any:
    """A function (texts, add_special_tokens) -> ids of each text through the tokenizers
    backend's batch encoding, when that is what ``hf(text)`` runs: a fast tokenizer whose
    ``_encode_plus`` is transformers' own and whose ids for probe texts (``_PROBE``, its
    words, special tokens' text, an empty string), with and without special tokens, equal
    ``hf``'s. None otherwise."""
    backend = getattr(hf, "_tokenizer", None)
    impl = getattr(type(hf), "_encode_plus", None)
    if backend is None or impl is None or not getattr(impl, "__module__", "").startswith(
            "transformers.tokenization_utils"):
        return None
    batch = getattr(backend, "encode_batch_fast", None) or backend.encode_batch

    def encode(texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [e.ids for e in batch(texts, add_special_tokens=add_special_tokens)]

    try:
        probes = [_PROBE, *_PROBE.split(" ")[:8], "".join(hf.all_special_tokens[:4]), ""]
        for add in (True, False):
            if encode(probes, add) != [list(hf(t, add_special_tokens=add)["input_ids"])
                                       for t in probes]:
                return None
    except Exception:  # an unusual tokenizer: keep transformers' path
        return None
    return encode
