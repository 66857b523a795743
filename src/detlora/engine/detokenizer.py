"""Output text in pieces, as the tokens arrive: deltas that never split a character.

``IncrementalDetokenizer.update(output_ids)`` returns the text the new tokens add. It decodes
a short window of the newest tokens twice (with and without the new ones: a tokenizer that
drops a leading space or merges pieces at the start of a text does so in both) and holds the
delta back while it ends in U+FFFD (a character whose bytes are split over tokens). With stop
strings, the last ``hold_back`` characters wait until the request finishes, so a stop string
that completes later is never streamed. ``finish`` returns the rest of the exact text
``decode(output_ids)[:text_end]`` that the offline API gives, so the deltas concatenate to it.
Each update costs O(window), not O(output). ``decode_one`` (optional, ``decode([id])`` kept
per id, shared by a server's streams) serves the older window when it is one token, the usual
case once tokens arrive one at a time: one tokenizer call per update instead of two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str], hold_back: int = 0,
                 decode_one: Callable[[int], str] | None = None) -> None:
        self._decode = decode
        self._decode_one = decode_one
        self._hold_back = max(0, hold_back)
        self._prefix_offset = 0  # the window starts here (tokens already turned into text)
        self._read_offset = 0  # tokens whose text is in ``_text``
        self._text = ""  # text of the first ``_read_offset`` tokens
        self._emitted = 0  # characters of ``_text`` already returned

    @property
    def text(self) -> str:
        """The text returned so far."""
        return self._text[: self._emitted]

    def update(self, output_ids: Sequence[int]) -> str:
        """``output_ids``: every output token so far (earlier ones unchanged)."""
        if len(output_ids) > self._read_offset:
            window = self._read_offset - self._prefix_offset
            if window == 0:
                before = ""
            elif window == 1 and self._decode_one is not None:
                before = self._decode_one(output_ids[self._prefix_offset])
            else:
                before = self._decode(output_ids[self._prefix_offset: self._read_offset])
            after = self._decode(output_ids[self._prefix_offset:])
            if len(after) > len(before) and not after.endswith(_REPLACEMENT) \
                    and after.startswith(before):
                self._text += after[len(before):]
                self._prefix_offset = self._read_offset
                self._read_offset = len(output_ids)
        ready = len(self._text) - self._hold_back
        if ready <= self._emitted:
            return ""
        delta = self._text[self._emitted: ready]
        self._emitted = ready
        return delta

    def finish(self, output_ids: Sequence[int], text_end: int | None = None) -> str:
        """The last delta: what the exact final text adds to what was returned."""
        final = self._decode(list(output_ids))
        if text_end is not None:
            final = final[:text_end]
        sent = self._text[: self._emitted]
        self._text, self._emitted = final, len(final)
        self._prefix_offset = self._read_offset = len(output_ids)
        # Windowed decoding gives the whole text's prefix (tested per tokenizer family); were
        # it ever to differ, what was sent cannot be taken back: the rest follows it.
        return final[len(sent):]


__all__ = ["IncrementalDetokenizer"]
