"""RMSNorm, optionally fused with the residual add that precedes it.

Every form multiplies the weight in fp32 before rounding (``ops/rms_norm.py``). Its forms are
parameters: ``unit_offset`` scales by ``1 + w`` (Gemma 3's checkpoints store w - 1), held as
the fp32 ``1 + w.float()`` HF computes, so the product is HF's; ``with_weight=False`` has no
weight at all (Gemma 4's V norm), an fp32 one, which multiplies exactly."""

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
        unit_offset: bool = False,
        with_weight: bool = True,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.size = size
        self.eps = float(eps)
        self.unit_offset = unit_offset
        self.with_weight = with_weight
        fp32 = unit_offset or not with_weight
        weight = torch.empty(size, dtype=torch.float32 if fp32 else dtype, device=device)
        if not with_weight:
            weight.fill_(1.0)
        self.weight = nn.Parameter(weight, requires_grad=False)

    def load_weight(self, tensor: torch.Tensor) -> None:
        """The checkpoint's weight (already in the model dtype)."""
        if not self.with_weight:
            raise ValueError("this norm has no weight")
        if tuple(tensor.shape) != (self.size,):
            raise ValueError(f"norm weight must have shape ({self.size},), "
                             f"got {tuple(tensor.shape)}")
        with torch.no_grad():
            self.weight.copy_(1.0 + tensor.float() if self.unit_offset else tensor)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.backend.rms_norm(x, self.weight, self.eps)
        return self.backend.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        form = ", 1 + w" if self.unit_offset else "" if self.with_weight else ", no weight"
        return f"{self.size}, eps={self.eps}{form}"
