"""A loaded LoRA adapter: per targeted projection its A and B matrices and scale."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One targeted projection: y += scale * (x A^T) B^T."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    """A checked adapter, on the CPU in its stored dtype, keyed by base-model module name
    (e.g. ``model.layers.0.self_attn.q_proj``)."""

    path: str
    modules: Mapping[str, LoRAModuleWeights]
    hash: str

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())
