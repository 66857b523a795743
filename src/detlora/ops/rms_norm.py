"""RMSNorm, plain and with a fused residual add; one fixed reduction order per row.

Semantics:
    x: [T, H] bf16/fp16/fp32, weight: [H], eps: float.

        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)

    fused_add_rms_norm(x, residual, weight, eps) returns (rms_norm(r), r) with
    r = (x.float() + residual.float()).to(x.dtype), the new residual stream.

    Batch invariance: each row is reduced by one program with a block size fixed per H, so a
    row's bits never depend on T.
"""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    r = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(r, weight, eps), r
