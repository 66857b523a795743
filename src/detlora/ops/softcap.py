"""Final logit soft-capping (Gemma): logits squashed into (-cap, cap).

Semantics:
    x: [N, V] bf16/fp16/fp32 logits, cap > 0:

        y = (torch.tanh(x.float() / cap) * cap).to(x.dtype)

    Elementwise, so batch-invariant by construction. (HF divides, takes tanh and multiplies
    in the logits' dtype, rounding three times; here the fp32 result is rounded once.)

Kernel: programs over (row, block of BLOCK columns), in place allowed; tanh(z) as
1 - 2 / (exp(2z) + 1) in fp32, exact at both ends; within a few fp32 ulps of torch's tanh.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv
from detlora.ops.checks import check_same_device, check_shape, check_tensor

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK = 2048


def softcap_ref(x: torch.Tensor, cap: float) -> torch.Tensor:
    return (torch.tanh(x.float() / cap) * cap).to(x.dtype)


@triton.jit
def _softcap_kernel(x_ptr, y_ptr, stride_x, stride_y, n_cols, cap, inv_cap,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = o < n_cols
    x = tl.load(x_ptr + row * stride_x + o, mask=ok, other=0.0).to(tl.float32)
    z = x * inv_cap
    t = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)
    tl.store(y_ptr + row * stride_y + o, (t * cap).to(y_ptr.dtype.element_ty), mask=ok)


def check_cap(cap: object) -> float:
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) \
            or cap <= 0:
        raise ValueError(f"cap must be a finite positive number, got {cap!r}")
    return float(cap)


def softcap(x: torch.Tensor, cap: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` of [N, V] logits; ``out`` may be ``x`` (in place)."""
    x = check_tensor("x", x, ndim=2, dtypes=_DTYPES, unit_last_stride=True)
    cap = check_cap(cap)
    if out is None:
        out = torch.empty_like(x)
    else:
        check_tensor("out", out, ndim=2, dtypes=(x.dtype,), unit_last_stride=True)
        check_shape("out", out, x.shape)
    check_same_device(x=x, out=out)
    n, v = x.shape
    if n == 0 or v == 0:
        return out
    _softcap_kernel[(n, cdiv(v, _BLOCK))](x, out, x.stride(0), out.stride(0), v, cap,
                                          1.0 / cap, BLOCK=_BLOCK, num_warps=8)
    return out


__all__ = ["check_cap", "softcap", "softcap_ref"]
