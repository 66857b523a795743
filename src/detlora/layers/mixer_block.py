"""A pre-norm block around one mixer (Nemotron-H's layers: Mamba-2, attention or an MLP)."""

from __future__ import annotations

import torch
from torch import nn

from detlora.layers.norm import RMSNorm


class MixerBlock(nn.Module):
    """``x + mixer(norm(x))``, the residual add fused into the next block's norm."""

    def __init__(self, norm: RMSNorm, mixer: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.mixer = mixer

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                *mixer_args: object) -> tuple[torch.Tensor, torch.Tensor]:
        """(this block's mixer output, the residual stream before it): the next norm adds
        them, so the residual is never added twice."""
        if residual is None:
            residual = x
            h = self.norm(x)
        else:
            h, residual = self.norm(x, residual)
        return self.mixer(h, *mixer_args), residual
