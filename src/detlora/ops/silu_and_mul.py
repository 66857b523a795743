"""SwiGLU activation: SiLU of the first half times the second half.

Semantics:
    x: [T, 2 * I] bf16/fp16/fp32 (gate | up, as a fused gate_up projection writes it).

        g, u = x.float().chunk(2, dim=-1)
        y = (torch.nn.functional.silu(g) * u).to(x.dtype)        # [T, I]

    Elementwise, so batch-invariant by construction.

Kernel: programs over (row, block of BLOCK output columns), BLOCK fixed per I; each element
is ``g / (1 + exp(-g)) * u`` in fp32, rounded once to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv, next_power_of_2
from detlora.ops.checks import check_same_device, check_shape, check_tensor

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_BLOCK = 2048


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    g, u = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(x.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, stride_x, stride_y, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = o < inter
    x_row = x_ptr + row * stride_x
    g = tl.load(x_row + o, mask=ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
    u = tl.load(x_row + inter + o, mask=ok, other=0.0, eviction_policy="evict_first")
    y = g / (1.0 + tl.exp(-g)) * u.to(tl.float32)
    tl.store(y_ptr + row * stride_y + o, y.to(y_ptr.dtype.element_ty), mask=ok)


def silu_and_mul_config(inter: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for I output columns."""
    block = min(next_power_of_2(inter), _MAX_BLOCK)
    return block, min(8, max(1, block // 256))


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``x`` = [T, 2 * I] (gate | up): returns [T, I] in x's dtype."""
    x = check_tensor("x", x, ndim=2, dtypes=_DTYPES, unit_last_stride=True)
    t, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"x.shape[1] must be even (gate | up halves), got {two_i}")
    if t == 0 or two_i == 0:
        raise ValueError(f"x must have at least one row and column, got {tuple(x.shape)}")
    inter = two_i // 2
    if out is None:
        out = torch.empty(t, inter, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, ndim=2, dtypes=(x.dtype,), unit_last_stride=True)
        check_shape("out", out, (t, inter))
    check_same_device(x=x, out=out)
    block, num_warps = silu_and_mul_config(inter)
    _silu_and_mul_kernel[(t, cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=num_warps
    )
    return out


__all__ = ["silu_and_mul", "silu_and_mul_config", "silu_and_mul_ref"]
