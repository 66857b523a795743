"""GeGLU activation (Gemma): tanh-approximated GELU of a gate times an up tensor.

Semantics:
    gelu_tanh_and_mul(x): x [T, 2 * I] bf16/fp16/fp32 (gate | up, as a fused gate_up
    projection writes it):

        g, u = x.float().chunk(2, dim=-1)
        y = (torch.nn.functional.gelu(g, approximate="tanh") * u).to(x.dtype)     # [T, I]

    gelu_tanh_mul(g, u): the same of two tensors [T, I] (Gemma 4's per-layer-input gate
    times the layer's per-layer input), rounded once to g's dtype.

    Elementwise, so batch-invariant by construction.

Kernel: programs over (row, block of BLOCK output columns), BLOCK fixed per I; each element is
``0.5 * g * (1 + tanh(c * (g + 0.044715 g^3))) * u`` in fp32 with c = sqrt(2 / pi) and
tanh(z) = 1 - 2 / (exp(2z) + 1) (exact at both ends: exp overflows to inf or underflows to
0), rounded once. It is within a few fp32 ulps of torch's gelu, not bit-equal to it: one
engine binds one of the two for every row.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv, next_power_of_2
from detlora.ops.checks import check_same_device, check_shape, check_tensor

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_BLOCK = 2048
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    g, u = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.gelu(g, approximate="tanh") * u).to(x.dtype)


def gelu_tanh_mul_ref(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.gelu(g.float(), approximate="tanh") * u.float()).to(g.dtype)


@triton.jit
def gelu_tanh(g):
    """GELU with the tanh approximation of an fp32 tensor."""
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    t = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)
    return 0.5 * g * (1.0 + t)


@triton.jit
def _gelu_tanh_mul_kernel(g_ptr, u_ptr, y_ptr, stride_g, stride_u, stride_y, inter,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = o < inter
    g = tl.load(g_ptr + row * stride_g + o, mask=ok, other=0.0,
                eviction_policy="evict_first").to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + o, mask=ok, other=0.0, eviction_policy="evict_first")
    y = gelu_tanh(g) * u.to(tl.float32)
    tl.store(y_ptr + row * stride_y + o, y.to(y_ptr.dtype.element_ty), mask=ok)


def gelu_config(inter: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for I output columns."""
    block = min(next_power_of_2(inter), _MAX_BLOCK)
    return block, min(8, max(1, block // 256))


def gelu_tanh_mul(g: torch.Tensor, u: torch.Tensor, *,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu_tanh(g) * u`` of [T, I] rows (strided rows allowed): [T, I] in g's dtype."""
    g = check_tensor("g", g, ndim=2, dtypes=_DTYPES, unit_last_stride=True)
    u = check_tensor("u", u, ndim=2, dtypes=_DTYPES, unit_last_stride=True)
    check_shape("u", u, g.shape)
    t, inter = g.shape
    if t == 0 or inter == 0:
        raise ValueError(f"g must have at least one row and column, got {tuple(g.shape)}")
    if out is None:
        out = torch.empty(t, inter, dtype=g.dtype, device=g.device)
    else:
        check_tensor("out", out, ndim=2, dtypes=(g.dtype,), unit_last_stride=True)
        check_shape("out", out, (t, inter))
    check_same_device(g=g, u=u, out=out)
    block, num_warps = gelu_config(inter)
    _gelu_tanh_mul_kernel[(t, cdiv(inter, block))](
        g, u, out, g.stride(0), u.stride(0), out.stride(0), inter, BLOCK=block,
        num_warps=num_warps)
    return out


def gelu_tanh_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``x`` = [T, 2 * I] (gate | up): [T, I] in x's dtype."""
    x = check_tensor("x", x, ndim=2, dtypes=_DTYPES, unit_last_stride=True)
    if x.shape[1] % 2:
        raise ValueError(f"x.shape[1] must be even (gate | up halves), got {x.shape[1]}")
    inter = x.shape[1] // 2
    return gelu_tanh_mul(x[:, :inter], x[:, inter:], out=out)


__all__ = ["gelu_config", "gelu_tanh", "gelu_tanh_and_mul", "gelu_tanh_and_mul_ref",
           "gelu_tanh_mul", "gelu_tanh_mul_ref"]
