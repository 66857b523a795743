"""Squared ReLU, the activation of Nemotron-H's (non-gated) MLP.

Semantics:
    x: [T, I] bf16/fp16/fp32 (unit column stride).

        y = torch.square(torch.relu(x))        # x's dtype: one rounding of x * x

    Elementwise, so batch-invariant by construction (the torch reference is too).

Kernel: programs over (row, block of BLOCK columns); each element is ``max(x, 0)`` squared
in fp32, rounded once to x's dtype (the reference's bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv, next_power_of_2
from detlora.ops.checks import check_same_device, check_shape, check_tensor

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_BLOCK = 2048


def relu_squared_ref(x: torch.Tensor) -> torch.Tensor:
    return torch.square(torch.relu(x))


@triton.jit
def _relu_squared_kernel(x_ptr, y_ptr, stride_x, stride_y, cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = o < cols
    x = tl.load(x_ptr + row * stride_x + o, mask=ok, other=0.0).to(tl.float32)
    x = tl.maximum(x, 0.0)
    tl.store(y_ptr + row * stride_y + o, (x * x).to(y_ptr.dtype.element_ty), mask=ok)


def relu_squared(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``relu(x) ** 2`` of ``x`` [T, I], in x's dtype."""
    x = check_tensor("x", x, ndim=2, dtypes=_DTYPES, unit_last_stride=True)
    t, cols = x.shape
    if out is None:
        out = torch.empty(t, cols, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, ndim=2, dtypes=(x.dtype,), unit_last_stride=True)
        check_shape("out", out, (t, cols))
    check_same_device(x=x, out=out)
    if t == 0 or cols == 0:
        return out
    block = min(next_power_of_2(cols), _MAX_BLOCK)
    _relu_squared_kernel[(t, cdiv(cols, block))](
        x, out, x.stride(0), out.stride(0), cols, BLOCK=block,
        num_warps=min(8, max(1, block // 256)))
    return out


__all__ = ["relu_squared", "relu_squared_ref"]
