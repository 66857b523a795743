"""Per-head RMSNorm of the q and k heads of a fused q|k|v projection, in place, one launch.

Semantics:
    qkv: [T, (Hq + 2 * Hk) * D] bf16/fp16/fp32, the q heads then the k heads then the v heads;
    q_weight, k_weight: [D]; eps: float.

        q = qkv[:, :Hq * D].reshape(T * Hq, D)
        k = qkv[:, Hq * D:(Hq + Hk) * D].reshape(T * Hk, D)
        qkv[:, :Hq * D] = rms_norm_ref(q, q_weight, eps).view(T, Hq * D)
        qkv[:, Hq * D:(Hq + Hk) * D] = rms_norm_ref(k, k_weight, eps).view(T, Hk * D)

    The v heads are untouched. Returns ``qkv``.

Why: Qwen3 normalizes every q and k head before rotary. Two ``rms_norm`` calls on the heads
need contiguous [T * H, D] rows, which a slice of the fused projection is not once T > 1: each
call copied its heads first, four launches a layer where one does (Qwen3-0.6B decode).

Kernel: one program normalizes ROWS head rows as a [ROWS, BLOCK] tile, exactly as
``ops.rms_norm`` tiles rows of H = D (the same ``rms_norm_config(D)``, the same ``inv_rms``
and store), reading each row where it sits in ``qkv``; the first programs take q heads, the
rest k heads. A row's reduction is fixed by D alone, never by T: batch-invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv
from detlora.ops.checks import check_same_device, check_tensor
from detlora.ops.pdl import pdl_kwargs, pdl_start
from detlora.ops.rms_norm import (
    check_eps,
    check_weight,
    inv_rms,
    rms_norm_blocks,
    rms_norm_config,
    rms_norm_ref,
)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    check_tensor("qkv", qkv, ndim=2, dtypes=_DTYPES, unit_last_stride=True)
    for name, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.shape[1] != width:
        raise ValueError(f"qkv has {qkv.shape[1]} columns; {num_heads} q and {num_kv_heads} "
                         f"KV heads of {head_dim} make {width}")
    return qkv.shape[0]


def qk_rms_norm_ref(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    num_heads: int, num_kv_heads: int, head_dim: int,
) -> torch.Tensor:
    t = _check(qkv, num_heads, num_kv_heads, head_dim)
    q_cols, k_cols = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_cols].reshape(t * num_heads, head_dim)
    k = qkv[:, q_cols:q_cols + k_cols].reshape(t * num_kv_heads, head_dim)
    qkv[:, :q_cols] = rms_norm_ref(q, q_weight, eps).view(t, q_cols)
    qkv[:, q_cols:q_cols + k_cols] = rms_norm_ref(k, k_weight, eps).view(t, k_cols)
    return qkv


@triton.jit(do_not_specialize=["n_tokens", "q_programs"])
def _qk_rms_norm_kernel(
    qkv_ptr, wq_ptr, wk_ptr, n_tokens, q_programs, stride_t, eps,
    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    ROWS: tl.constexpr, PDL: tl.constexpr,
):
    pdl_start(PDL)  # ops/pdl.py: before any read or store
    pid = tl.program_id(0)
    is_q = pid < q_programs
    part = tl.where(is_q, pid, pid - q_programs)
    heads = tl.where(is_q, HQ, HK)
    rows = part.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = (rows < n_tokens * heads)[:, None]
    # Head row r of a part sits at token r // heads, head r % heads of that part's columns.
    first_col = tl.where(is_q, 0, HQ * D)
    base = qkv_ptr + (rows // heads)[:, None] * stride_t + first_col \
        + (rows % heads)[:, None] * D
    offs = tl.arange(0, BLOCK)
    ok = row_ok & (offs < D)[None, :]
    x = tl.load(base + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    inv = inv_rms(tl.sum(x * x, axis=1), eps, D)
    wq = tl.load(wq_ptr + offs, mask=offs < D, other=0.0).to(tl.float32)
    wk = tl.load(wk_ptr + offs, mask=offs < D, other=0.0).to(tl.float32)
    w = tl.where(is_q, wq, wk)
    # (x * inv_rms) * w, in the reference's order, as ops.rms_norm stores it.
    y = x * inv[:, None] * w[None, :]
    tl.store(base + offs[None, :], y.to(qkv_ptr.dtype.element_ty), mask=ok)


def qk_rms_norm(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    num_heads: int, num_kv_heads: int, head_dim: int,
) -> torch.Tensor:
    """The q and k heads of ``qkv`` normalized in place in one launch (module docstring);
    returns ``qkv``."""
    t = _check(qkv, num_heads, num_kv_heads, head_dim)
    q_weight = check_weight(q_weight, head_dim)
    k_weight = check_weight(k_weight, head_dim)
    eps = check_eps(eps)
    check_same_device(qkv=qkv, q_weight=q_weight, k_weight=k_weight)
    block, num_blocks = rms_norm_blocks(head_dim)
    if num_blocks != 1:
        raise ValueError(f"head_dim {head_dim} is wider than one RMSNorm tile")
    if t == 0:
        return qkv
    # Rows read and written where they sit need the alignment a fresh tensor has (Triton
    # specializes on it and the layout decides the sum's tree): else through a fresh copy.
    aligned = qkv.data_ptr() % 16 == 0 and (qkv.stride(0) * qkv.element_size()) % 16 == 0
    work = qkv if aligned else qkv.contiguous().clone()
    cfg = rms_norm_config(head_dim)
    q_programs = cdiv(t * num_heads, cfg.rows)
    grid = (q_programs + cdiv(t * num_kv_heads, cfg.rows),)
    _qk_rms_norm_kernel[grid](
        work, q_weight.contiguous(), k_weight.contiguous(), t, q_programs, work.stride(0), eps,
        HQ=num_heads, HK=num_kv_heads, D=head_dim, BLOCK=block, ROWS=cfg.rows,
        num_warps=cfg.num_warps, **pdl_kwargs(qkv),
    )
    if work is not qkv:
        qkv.copy_(work)
    return qkv


__all__ = ["qk_rms_norm", "qk_rms_norm_ref"]
