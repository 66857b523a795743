"""Rotary position embedding, neox style (Llama, Qwen3), with Llama-3 rope scaling.

Semantics:
    q: [T, Hq, D], k: [T, Hk, D] (bf16/fp16/fp32), positions: [T] ints,
    cos_sin: [max_positions, D] fp32 from ``rope_cos_sin_cache`` (cos in the first D/2
    columns, sin in the last D/2):

        cos, sin = cos_sin[positions].chunk(2, dim=-1)          # [T, D/2] each
        def rot(x):
            x1, x2 = x.float().chunk(2, dim=-1)
            c, s = cos[:, None, :], sin[:, None, :]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
        return rot(q), rot(k)

    Elementwise per token, so batch-invariant by construction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch


def rope_inv_freq(head_dim: int, base: float, scaling: Mapping | None = None) -> torch.Tensor:
    """Inverse frequencies [D/2] (fp64 math, fp32 result), with Llama-3 scaling if given."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv.float()
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: llama3)")
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    scaled = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return scaled.float()


def rope_cos_sin_cache(
    head_dim: int, max_positions: int, base: float, scaling: Mapping | None = None
) -> torch.Tensor:
    """[max_positions, D] fp32: cos | sin of position x inverse frequency."""
    inv = rope_inv_freq(head_dim, base, scaling)
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin[positions.long()].chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    return rot(q), rot(k)
