"""RMSNorm, plain and with a fused residual add; one fixed reduction order per row.

Semantics:
    x: [T, H] bf16/fp16/fp32, weight: [H], eps: float.

        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)

    fused_add_rms_norm(x, residual, weight, eps) returns (rms_norm(r), r) with
    r = (x.float() + residual.float()).to(x.dtype), the new residual stream.

    Batch invariance: each row is reduced by one program with a block size fixed per H, so a
    row's bits never depend on T.

Kernels (``rms_norm``, ``fused_add_rms_norm``):
    One program per row. A row of H <= 8192 is one register tile of BLOCK = next power of two
    >= H; its sum of squares is one ``tl.sum`` whose tree is fixed by H through BLOCK and the
    warp count. Wider rows are walked in fixed BLOCK-sized blocks: an fp32 vector adds block
    after block elementwise, then one ``tl.sum``. Operands whose rows are not 16-byte aligned
    the way a fresh contiguous tensor's are go through an aligned copy
    (``detlora.ops.reductions.canonical_rows``), because Triton specializes a kernel on
    pointer alignment and the layout it then picks decides the ``tl.sum`` tree.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv, next_power_of_2
from detlora.ops.checks import check_same_device, check_shape, check_tensor
from detlora.ops.reductions import canonical_out, canonical_rows, finish_out

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_BLOCK = 8192  # widest row held in registers in one tile; wider rows loop over blocks


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    r = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(r, weight, eps), r


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _normalize_store(x, inv_rms, w_ptr, y_row, o, ok):
    """y = (x * inv_rms) * w, in the reference's order; x is fp32."""
    w = tl.load(w_ptr + o, mask=ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(y_row + o, (x * inv_rms * w).to(y_row.dtype.element_ty), mask=ok)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    stride_x,
    stride_y,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    offs = tl.arange(0, BLOCK)
    if NUM_BLOCKS == 1:
        ok = offs < H
        x = tl.load(x_row + offs, mask=ok, other=0.0, eviction_policy="evict_first")
        x = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.div_rn(tl.sum(x * x, axis=0), H) + eps)
        _normalize_store(x, inv_rms, w_ptr, y_row, offs, ok)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for b in range(NUM_BLOCKS):
            o = b * BLOCK + offs
            ok = o < H
            x = tl.load(x_row + o, mask=ok, other=0.0).to(tl.float32)
            acc += x * x
        inv_rms = tl.rsqrt(tl.div_rn(tl.sum(acc, axis=0), H) + eps)
        for b in range(NUM_BLOCKS):
            o = b * BLOCK + offs
            ok = o < H
            x = tl.load(x_row + o, mask=ok, other=0.0, eviction_policy="evict_first")
            _normalize_store(x.to(tl.float32), inv_rms, w_ptr, y_row, o, ok)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_y,
    stride_ro,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = res_ptr + row * stride_r
    y_row = y_ptr + row * stride_y
    ro_row = res_out_ptr + row * stride_ro
    offs = tl.arange(0, BLOCK)
    if NUM_BLOCKS == 1:
        ok = offs < H
        x = tl.load(x_row + offs, mask=ok, other=0.0, eviction_policy="evict_first")
        r = tl.load(r_row + offs, mask=ok, other=0.0, eviction_policy="evict_first")
        # The new residual is rounded to x's dtype before it is normalized (the semantics).
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(ro_row + offs, s.to(res_out_ptr.dtype.element_ty), mask=ok)
        sf = s.to(tl.float32)
        inv_rms = tl.rsqrt(tl.div_rn(tl.sum(sf * sf, axis=0), H) + eps)
        _normalize_store(sf, inv_rms, w_ptr, y_row, offs, ok)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for b in range(NUM_BLOCKS):
            o = b * BLOCK + offs
            ok = o < H
            x = tl.load(x_row + o, mask=ok, other=0.0)
            r = tl.load(r_row + o, mask=ok, other=0.0)
            s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(ro_row + o, s.to(res_out_ptr.dtype.element_ty), mask=ok)
            sf = s.to(tl.float32)
            acc += sf * sf
        inv_rms = tl.rsqrt(tl.div_rn(tl.sum(acc, axis=0), H) + eps)
        # Pass 2 reads the new residual back: it may alias the old one (in-place use), and
        # other threads of this program wrote parts of it, hence the barrier.
        tl.debug_barrier()
        for b in range(NUM_BLOCKS):
            o = b * BLOCK + offs
            ok = o < H
            s = tl.load(ro_row + o, mask=ok, other=0.0, eviction_policy="evict_first")
            _normalize_store(s.to(tl.float32), inv_rms, w_ptr, y_row, o, ok)


# ----------------------------------------------------------------------------- wrappers


def rms_norm_config(hidden: int) -> tuple[int, int, int]:
    """(BLOCK, NUM_BLOCKS, num_warps) for rows of ``hidden`` elements: a function of H only."""
    block = min(next_power_of_2(hidden), _MAX_BLOCK)
    # 16 elements a thread per block (two 16-byte loads in bf16), at most 8 warps.
    return block, cdiv(hidden, block), min(8, max(1, block // 512))


def _check_eps(eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise ValueError(f"eps must be a float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    return float(eps)


def _check_rows(name: str, x: object) -> torch.Tensor:
    x = check_tensor(name, x, ndim=2, dtypes=_DTYPES, unit_last_stride=True)
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must have at least one row and column, got {tuple(x.shape)}")
    return x


def _check_out(name: str, out: object, like: torch.Tensor) -> torch.Tensor:
    out = check_tensor(name, out, ndim=2, dtypes=(like.dtype,), unit_last_stride=True)
    check_shape(name, out, like.shape)
    return out


def _check_weight(weight: object, hidden: int) -> torch.Tensor:
    weight = check_tensor("weight", weight, ndim=1, dtypes=_DTYPES, unit_last_stride=True)
    check_shape("weight", weight, (hidden,))
    return weight


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of every row of ``x`` [T, H] (see the module docstring); returns ``out``.

    ``out`` ([T, H], x's dtype) is written in full and may be ``x`` itself. A row's bits
    depend on its values, ``weight``, ``eps`` and H, never on T.
    """
    x = _check_rows("x", x)
    t, h = x.shape
    weight = _check_weight(weight, h)
    eps = _check_eps(eps)
    if out is not None:
        _check_out("out", out, x)
    check_same_device(x=x, weight=weight, **({} if out is None else {"out": out}))
    block, num_blocks, num_warps = rms_norm_config(h)
    # A misaligned out is written through an aligned temporary (module docstring).
    dst = canonical_out(out, (t, h), x)
    xc = canonical_rows(x)
    _rms_norm_kernel[(t,)](
        xc, canonical_rows(weight), dst,
        xc.stride(0), dst.stride(0), eps,
        H=h, BLOCK=block, NUM_BLOCKS=num_blocks, num_warps=num_warps,
    )
    return finish_out(out, dst)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(r), r)`` with ``r = x + residual`` rounded to x's dtype, in one pass.

    ``out`` and ``residual_out`` ([T, H], x's dtype) are written in full; ``out`` may be
    ``x`` and ``residual_out`` may be ``residual`` (in-place update of the residual stream),
    but they must not be the same tensor.
    """
    x = _check_rows("x", x)
    t, h = x.shape
    residual = check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,),
                            unit_last_stride=True)
    check_shape("residual", residual, (t, h))
    weight = _check_weight(weight, h)
    eps = _check_eps(eps)
    outs = {}
    if out is not None:
        outs["out"] = _check_out("out", out, x)
    if residual_out is not None:
        outs["residual_out"] = _check_out("residual_out", residual_out, x)
    if out is not None and residual_out is not None and out.data_ptr() == residual_out.data_ptr():
        raise ValueError("out and residual_out must be different tensors")
    check_same_device(x=x, residual=residual, weight=weight, **outs)
    block, num_blocks, num_warps = rms_norm_config(h)
    y, r = canonical_out(out, (t, h), x), canonical_out(residual_out, (t, h), x)
    xc, rc = canonical_rows(x), canonical_rows(residual)
    _fused_add_rms_norm_kernel[(t,)](
        xc, rc, canonical_rows(weight), y, r,
        xc.stride(0), rc.stride(0), y.stride(0), r.stride(0), eps,
        H=h, BLOCK=block, NUM_BLOCKS=num_blocks, num_warps=num_warps,
    )
    return finish_out(out, y), finish_out(residual_out, r)


__all__ = [
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "rms_norm",
    "rms_norm_config",
    "rms_norm_ref",
]
