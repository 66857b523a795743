"""SwiGLU activation: SiLU of the first half times the second half.

Semantics:
    x: [T, 2 * I] bf16/fp16/fp32 (gate | up, as a fused gate_up projection writes it).

        g, u = x.float().chunk(2, dim=-1)
        y = (torch.nn.functional.silu(g) * u).to(x.dtype)        # [T, I]

    Elementwise, so batch-invariant by construction.
"""

from __future__ import annotations

import torch


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    g, u = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(x.dtype)
