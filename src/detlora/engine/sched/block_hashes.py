"""Content keys of full KV pages, for prefix caching.

A page's key is ``sha256(parent key + its tokens)``; the first page's parent is a key of the
adapter (name, id, path) or of the base model. Two sequences share a key for page i exactly
when they share the adapter and every token up to the end of page i, which is when page i's
K/V are the same computation. sha256 rather than Python's ``hash``: a false match would
silently serve another prompt's K/V, so a collision must be out of reach.
"""

from __future__ import annotations

import functools
import hashlib
from array import array

UNREAD = -1  # a token whose sampling step is launched but not read yet (llm_engine)


@functools.lru_cache(maxsize=1024)
def root_key(lora: object | None, position_offset: int = 0) -> bytes:
    """The parent key of page 0: which weights compute the K/V, and the sequence's position
    offset where it has one (LongRoPE's long table rotates the same tokens otherwise).
    Remembered per (adapter, offset): every admitted sequence asks (a LoRARequest is frozen,
    and equal requests give equal keys)."""
    what = "base" if lora is None else repr(("lora", lora.name, lora.id, lora.path))  # type: ignore[attr-defined]
    if position_offset:
        what += f"|positions+{position_offset}"
    return hashlib.sha256(what.encode()).digest()


def page_key(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def extend_page_keys(keys: list[bytes], token_ids: list[int], block_size: int,
                     lora: object | None, position_offset: int = 0) -> list[bytes]:
    """Append to ``keys`` the keys of the full pages of ``token_ids`` not yet keyed, stopping
    at the first page that holds an unread token; returns ``keys``."""
    first, end = len(keys), len(token_ids) // block_size
    if first >= end:
        return keys
    lo, hi = first * block_size, end * block_size
    if UNREAD in token_ids[lo: hi]:  # the pages from the one holding it on wait for it
        end = token_ids.index(UNREAD, lo, hi) // block_size
    if first >= end:
        return keys
    parent = keys[-1] if keys else root_key(lora, position_offset)
    # Every new page's tokens as bytes in one conversion; each key is page_key's.
    data = array("q", token_ids[lo: end * block_size]).tobytes()
    width = 8 * block_size
    sha256 = hashlib.sha256
    for at in range(0, len(data), width):
        parent = sha256(parent + data[at: at + width]).digest()
        keys.append(parent)
    return keys
