"""Phi-3's LongRoPE ("su") rotary table, and which part of it a sequence reads.

Semantics (scaling: the spec's ``rope_type="longrope"`` mapping; L = original_max_position_
embeddings, M = max_positions, f = attention_factor, fp32 throughout as transformers 5.x
computes it):

    inv(ext) = 1.0 / (ext * base ** (arange(0, D, 2).float() / D))      # ext: a factor list
    table(inv, n)[p] = cat(cos(p * inv), sin(p * inv)) * f              # [n, D]
    cos_sin = table(inv(short), min(L, M))                              # M <= L
    cos_sin = cat(table(inv(short), L), table(inv(long), M))            # M > L: [L + M, D]

    position_offset(length) = L if length > L and M > L else 0

A sequence whose tokens reach ``length`` reads row ``p + position_offset(length)`` for its
token at position p: the short factors while it holds at most L tokens, the long ones for
every position once it holds more. That is transformers' ``generate`` for the sequence on
its own: its rotary picks the factors by ``max(position_ids) + 1`` of each forward, the
prompt is one forward, and Phi-3's ``prepare_inputs_for_generation`` drops the cache and
recomputes the whole sequence with the long factors when it first grows past L. So every
step's logits are those of one forward over the whole sequence. The engine does the same:
a sequence that grows past L is recomputed with the long rows (``engine/sched/scheduler``);
the choice depends on the sequence's own length, never on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def longrope_inv_freq(head_dim: int, base: float, factors: tuple[float, ...]) -> torch.Tensor:
    """[D/2] fp32 inverse frequencies scaled by ``factors`` (transformers' arithmetic)."""
    ext = torch.tensor(factors, dtype=torch.float32)
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (ext * base**shape)


def _table(inv: torch.Tensor, positions: int, attention_factor: float) -> torch.Tensor:
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


def longrope_cos_sin_cache(head_dim: int, max_positions: int, base: float,
                           scaling: Mapping) -> torch.Tensor:
    """fp32 [min(L, M), D], or [L + M, D] (short rows, then long) when M > L."""
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling["attention_factor"])
    short = _table(longrope_inv_freq(head_dim, base, tuple(scaling["short_factor"])),
                   min(original, max_positions), factor)
    if max_positions <= original:
        return short
    long = _table(longrope_inv_freq(head_dim, base, tuple(scaling["long_factor"])),
                  max_positions, factor)
    return torch.cat([short, long], dim=0)


def longrope_offsets_vary(scaling: Mapping | None, max_positions: int) -> bool:
    """Whether some sequence reads the long rows (LongRoPE with M > L)."""
    return bool(scaling) and scaling.get("rope_type") == "longrope" and \
        max_positions > int(scaling["original_max_position_embeddings"])


def longrope_position_offset(scaling: Mapping | None, max_positions: int, length: int) -> int:
    """The row offset of a sequence whose tokens reach ``length`` (0 without LongRoPE)."""
    if not longrope_offsets_vary(scaling, max_positions):
        return 0
    original = int(scaling["original_max_position_embeddings"])  # type: ignore[index]
    return original if length > original else 0
