"""Softmax and log-softmax over the last axis (the vocabulary), one reduction order per row.

Semantics:
    x: [T, V] bf16/fp16/fp32.
        log_softmax(x) = torch.log_softmax(x.float(), dim=-1).to(x.dtype)
        softmax(x)     = torch.softmax(x.float(), dim=-1).to(x.dtype)
    Computed as max, then sum of exp(x - max) in a fixed block order per row; the order
    depends on V alone, never on T.
"""

from __future__ import annotations

import torch


def log_softmax_ref(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x.float(), dim=-1).to(x.dtype)


def softmax_ref(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.float(), dim=-1).to(x.dtype)
