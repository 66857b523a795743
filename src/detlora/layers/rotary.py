"""Rotary position embedding (neox style), with the cos/sin table built once per model."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from detlora.layers.backend import OpBackend
from detlora.ops.rotary import rope_cos_sin_cache


class RotaryEmbedding(nn.Module):
    """Rotates q [T, Hq, D] and k [T, Hk, D] by their tokens' positions."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: float,
        scaling: Mapping | None = None,
        *,
        backend: OpBackend,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.backend = backend
        self.head_dim = head_dim
        self.max_positions = max_positions
        # fp32 table, computed on the CPU so every device gets the same bits.
        cos_sin = rope_cos_sin_cache(head_dim, max_positions, base, scaling)
        self.register_buffer("cos_sin", cos_sin.to(device), persistent=False)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backend.rotary(q, k, positions, self.cos_sin)

    def rotate_and_write_kv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """Rotates q and k, writes the rotated k and v into their page slots; the rotated q
        (the backend fuses the two where it has the kernel: the same bits)."""
        return self.backend.rotate_and_write_kv(q, k, v, positions, self.cos_sin, k_cache,
                                                v_cache, slot_mapping)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}"
