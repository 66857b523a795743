"""Batch-invariant matmul and linear: the K order is fixed per (N, K), never chosen by M.

Semantics:
    a: [M, K], b: [K, N] (bf16/fp16/fp32, same dtype); bias: [N] or None.
        matmul(a, b)            = (a.float() @ b.float()).to(a.dtype)
        linear(x, weight, bias) = (x.float() @ weight.float().T + bias.float()).to(x.dtype)
    fp32 accumulation. A row's bits depend on (N, K) and the row's values alone, never on M.
"""

from __future__ import annotations

import torch


def matmul_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() @ b.float()).to(a.dtype)


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
