"""Mamba-2's gated RMSNorm: the scan output times silu(z), normalized within groups.

Semantics:
    y: [T, D] (fp32: the scan's output), z: [T, D] bf16/fp16/fp32 (the gate, unit column
    stride), weight: [D], group_size: gs dividing D, eps: float.

        v = y.float() * silu(z.float())                 silu(u) = u / (1 + exp(-u))
        v = v.view(T, D // gs, gs)
        out = (v * rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).view(T, D)
        out = out.to(z.dtype)

    (Nemotron-H's ``NemotronHRMSNormGated``, norm_before_gate=False, as its torch path runs
    it: the scan output is fp32 there, so the weight multiplies in fp32 before the rounding.)
    Each (row, group) is reduced on its own, so batch-invariant.

Kernel: one program per row, its groups the rows of one [groups, next_power_of_2(gs)]
register tile (a function of D and gs alone, as is the warp count), each reduced by one
``tl.sum`` along the tile's rows; operands are copied to aligned rows where Triton would
otherwise specialize differently (``canonical_rows``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import next_power_of_2
from detlora.ops.checks import check_same_device, check_shape, check_tensor
from detlora.ops.mamba_conv import silu_ref
from detlora.ops.reductions import canonical_rows

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_GROUP = 16384


def gated_rms_norm_ref(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                       group_size: int, eps: float) -> torch.Tensor:
    t, d = y.shape
    v = (y.float() * silu_ref(z.float())).view(t, d // group_size, group_size)
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return (v.view(t, d) * weight.float()).to(z.dtype)


@triton.jit(do_not_specialize=["n_rows"])
def _gated_rms_norm_kernel(
    y_ptr, z_ptr, w_ptr, out_ptr, n_rows, stride_y, stride_z, stride_o, eps,
    G: tl.constexpr, GS: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    grp = tl.arange(0, GP)
    cols = grp[:, None] * GS + tl.arange(0, BLOCK)[None, :]
    ok = (grp < G)[:, None] & (tl.arange(0, BLOCK) < GS)[None, :]
    y = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * stride_z + cols, mask=ok, other=0.0).to(tl.float32)
    v = y * (z / (1.0 + tl.exp(-z)))
    inv = tl.rsqrt(tl.div_rn(tl.sum(v * v, axis=1), GS) + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols,
             (v * inv[:, None] * w).to(out_ptr.dtype.element_ty), mask=ok)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                   eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The gated, grouped RMSNorm of every row (module docstring): [T, D] in z's dtype."""
    y = check_tensor("y", y, ndim=2, dtypes=_DTYPES, unit_last_stride=True)
    t, d = y.shape
    z = check_tensor("z", z, ndim=2, dtypes=_DTYPES, unit_last_stride=True)
    check_shape("z", z, (t, d))
    check_shape("weight", weight, (d,))
    if group_size < 1 or d % group_size or group_size > _MAX_GROUP:
        raise ValueError(f"group_size {group_size} must divide {d} (and be at most "
                         f"{_MAX_GROUP})")
    if out is None:
        out = torch.empty(t, d, dtype=z.dtype, device=z.device)
    else:
        check_tensor("out", out, ndim=2, dtypes=(z.dtype,), unit_last_stride=True)
        check_shape("out", out, (t, d))
    check_same_device(y=y, z=z, weight=weight, out=out)
    if t == 0:
        return out
    groups, block = d // group_size, next_power_of_2(group_size)
    gp = next_power_of_2(groups)
    yc, zc = canonical_rows(y), canonical_rows(z)
    _gated_rms_norm_kernel[(t,)](
        yc, zc, canonical_rows(weight), out, t, yc.stride(0), zc.stride(0), out.stride(0),
        float(eps), G=groups, GS=group_size, GP=gp, BLOCK=block,
        num_warps=min(16, max(1, gp * block // 1024)))
    return out


__all__ = ["gated_rms_norm", "gated_rms_norm_ref"]
