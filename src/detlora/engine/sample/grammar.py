"""Grammar-constrained decoding through xgrammar: a token mask per row, from a matcher that
follows the row's own tokens.

``SamplingParams.structured_outputs`` (vLLM's ``StructuredOutputsParams``) names a JSON schema,
any JSON object, a regular expression, a choice of strings or an EBNF grammar. The engine
compiles it once (xgrammar caches compiled grammars) and gives the sequence a matcher; before
each sampling step the matcher writes the row's allowed tokens as a bitmask (bit ``t % 32`` of
word ``t // 32`` is token t), the sampler sets every other token's logit to -inf, and the
sampled token advances the matcher. The mask depends only on the row's own tokens and is
applied elementwise to its own logits, so constrained rows keep every determinism level's
promise. JSON is compact (no whitespace between tokens): a model cannot pad it without end.

xgrammar is imported on first use: a server that never sees a constrained request never loads
it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from detlora.config import StructuredOutputsParams


class GrammarBackend:
    """Compiles ``StructuredOutputsParams`` for one tokenizer and model vocabulary."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        try:
            import xgrammar
        except ImportError as e:  # pragma: no cover - a declared dependency
            raise ValueError(f"structured outputs need the xgrammar package: {e}") from None
        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self._compiler = xgrammar.GrammarCompiler(info)
        self.vocab_size = vocab_size
        self.mask_words = -(-vocab_size // 32)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar; ValueError naming the problem for an invalid spec."""
        c = self._compiler
        try:
            if spec.json is not None:
                return c.compile_json_schema(spec.json, any_whitespace=False)
            if spec.json_object:  # OpenAI's json_object: any JSON object
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.choice is not None:
                alternatives = " | ".join(json.dumps(x) for x in spec.choice)
                return c.compile_grammar(f"root ::= {alternatives}")
            assert spec.grammar is not None
            return c.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            kind = spec.kind
            raise ValueError(f"structured_outputs {kind} is not valid: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        return GrammarMatcher(self._xgr.GrammarMatcher(self.compile(spec)), self.mask_words)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, mask_words: int) -> None:
        self._m = matcher
        self.mask_words = mask_words

    def fill_mask(self, out: torch.Tensor) -> None:
        """Write the allowed next tokens into ``out`` (int32 [mask_words], CPU)."""
        self._m.fill_next_token_bitmask(out.view(1, -1), 0)

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the grammar does not allow it."""
        return bool(self._m.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


def apply_token_bitmask(x: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """``x[rows[i], t] = -inf`` for every token t whose bit is clear in ``bitmask[i]``
    (int32 [R, ceil(V / 32)], bit ``t % 32`` of word ``t // 32``); elementwise, in place."""
    vocab = x.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    x[rows] = x[rows].masked_fill(~allowed, float("-inf"))


__all__ = ["GrammarBackend", "GrammarMatcher", "apply_token_bitmask"]
