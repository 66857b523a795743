"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from detlora.layers.backend import OpBackend


class RMSNorm(nn.Module):
    """norm(x) or, given the residual stream, (norm(x + residual), x + residual)."""

    def __init__(
        self,
        size: int,
        eps: float,
        *,
        backend: OpBackend,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.size = size
        self.eps = float(eps)
        self.weight = nn.Parameter(
            torch.empty(size, dtype=dtype, device=device), requires_grad=False
        )

    def load_weight(self, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != (self.size,):
            raise ValueError(f"norm weight must have shape ({self.size},), "
                             f"got {tuple(tensor.shape)}")
        with torch.no_grad():
            self.weight.copy_(tensor)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.backend.rms_norm(x, self.weight, self.eps)
        return self.backend.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.size}, eps={self.eps}"
