"""Row reductions: mean over the last axis, and argmax with ties to the lowest index.

Semantics:
    x: [T, N] bf16/fp16/fp32.
        mean(x)   = x.float().mean(dim=-1).to(x.dtype)                       # [T]
        argmax(x) = index of the largest x[t, :]; among equal maxima the lowest index  # [T]
    One fixed block order per row, depending on N alone.
"""

from __future__ import annotations

import torch


def mean_ref(x: torch.Tensor) -> torch.Tensor:
    return x.float().mean(dim=-1).to(x.dtype)


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    # torch.argmax documents "the first maximal value" for ties; make it explicit anyway.
    xf = x.float()
    is_max = xf == xf.max(dim=-1, keepdim=True).values
    idx = torch.arange(x.shape[-1], device=x.device).expand_as(xf)
    return torch.where(is_max, idx, x.shape[-1]).min(dim=-1).values
