"""Stop strings: does a sequence's newest token complete one, and where does its text end?

Semantics (vLLM's ``SamplingParams.stop``):
    After each generated token, the output text (``decode(output_token_ids)``) is searched for
    the stop strings, but only for occurrences that end in the characters the newest token
    added; text that was already there never stops the sequence (it may have been generated
    before ``min_tokens`` allowed stopping). On a match the sequence finishes with "stop": its
    token ids keep the token that completed the string, and its text ends where the earliest
    such occurrence starts (or, with ``include_stop_str_in_output``, where it ends). Stop
    strings depend on the sequence's own tokens alone, so they keep every determinism level's
    promise.

Cost: every step decodes a short tail of the output (the longest stop string plus a few
tokens) twice; the whole output is decoded only when the tail shows a match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Tokens decoded beyond the longest stop string's length in characters: a token adds at least
# one character to ordinary text, and the spare ones absorb a partial character or a leading
# space that decoding a tail from mid-text may drop.
_SPARE_TOKENS = 4


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string that matched
    text_end: int  # characters of the decoded output text to keep


def _shared_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _new_occurrence(text: str, before: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest (start, stop) among occurrences in ``text`` that end after the part it
    shares with ``before`` (a character split over tokens decodes as U+FFFD until its last
    byte arrives, so ``before`` need not be a prefix of ``text``)."""
    new_from = _shared_prefix(text, before)
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, max(0, new_from - len(stop) + 1))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best


def match_stop_string(
    decode: Callable[[Sequence[int]], str],
    output_ids: Sequence[int],
    stops: Sequence[str],
    include_stop: bool = False,
) -> StopMatch | None:
    """Whether the last of ``output_ids`` completes one of ``stops`` (see the module
    docstring); None when it does not."""
    if not stops or not output_ids:
        return None
    tail_from = max(0, len(output_ids) - max(len(s) for s in stops) - _SPARE_TOKENS)
    tail = list(output_ids[tail_from:])
    if _new_occurrence(decode(tail), decode(tail[:-1]), stops) is None:
        return None
    ids = list(output_ids)
    text = decode(ids)
    found = _new_occurrence(text, decode(ids[:-1]), stops)
    if found is None:  # the tail's decoding differed from the whole text's
        return None
    at, stop = found
    return StopMatch(stop, at + len(stop) if include_stop else at)


__all__ = ["StopMatch", "match_stop_string"]
