"""Rotary embedding of q and k fused with the write of k and v into the KV pages.

Semantics:
    q: [T, Hq, D], k, v: [T, Hk, D] (bf16/fp16/fp32, rows may be strided views of one fused
    qkv output), positions: [T] ints, cos_sin: [max_positions, D] fp32 (``rotary``'s table),
    k_cache, v_cache: [num_blocks, block_size, Hk, D], slot_mapping: [T] ints (< 0: padding):

        q_out, k_rot = rotary(q, k, positions, cos_sin)
        write_kv(k_rot, v, k_cache, v_cache, slot_mapping)
        return q_out                                           # [T, Hq, D], contiguous

    The same bits as the two ops one after the other (both are elementwise per token, and
    the rotation is ``rotary``'s own jit helper): the rotated k is never materialised, and a
    layer's attention input costs one launch instead of two.

Kernel: programs over (token, block of BLOCK_H heads of q, then of k); a k program also
copies its heads of v, and skips both writes for a padding slot (< 0) or a slot past the
cache, as ``write_kv`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv
from detlora.ops.checks import check_same_device, check_shape
from detlora.ops.paged_attention import check_write_kv_args, write_kv_ref
from detlora.ops.rotary import (
    check_positions,
    check_rotary_args,
    rotary_config,
    rotary_ref,
    rotate_heads,
    rotated_halves,
    token_cos_sin,
)


def rotary_write_kv_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    q_out, k_rot = rotary_ref(q, k, positions, cos_sin)
    write_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_out


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, cos_sin_ptr,
    slot_ptr, num_slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_cs,
    num_q_heads, num_k_heads, q_blocks,
    PAGE: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    cos, sin = token_cos_sin(positions_ptr, cos_sin_ptr, t, stride_cs, HALF, BLOCK_HALF)
    if hb < q_blocks:
        rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, stride_qh, stride_qoh,
                     hb * BLOCK_H, num_q_heads, cos, sin, HALF, BLOCK_H, BLOCK_HALF)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0 and slot < num_slots:
            head0 = (hb - q_blocks) * BLOCK_H
            y1, y2, ok, h, d = rotated_halves(k_ptr + t * stride_kt, stride_kh, head0,
                                              num_k_heads, cos, sin, HALF, BLOCK_H, BLOCK_HALF)
            page = slot // PAGE
            off = slot % PAGE
            kc = k_cache_ptr + page * stride_kcb + off * stride_kcs + h[:, None] * stride_kch \
                + d[None, :]
            # Rounded to k's dtype first, as rotary's output is, then to the cache's.
            cache_ty = k_cache_ptr.dtype.element_ty
            tl.store(kc, y1.to(k_ptr.dtype.element_ty).to(cache_ty), mask=ok)
            tl.store(kc + HALF, y2.to(k_ptr.dtype.element_ty).to(cache_ty), mask=ok)
            vp = v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :]
            vc = v_cache_ptr + page * stride_vcb + off * stride_vcs + h[:, None] * stride_vch \
                + d[None, :]
            vty = v_cache_ptr.dtype.element_ty
            tl.store(vc, tl.load(vp, mask=ok).to(vty), mask=ok)
            tl.store(vc + HALF, tl.load(vp + HALF, mask=ok).to(vty), mask=ok)


# ----------------------------------------------------------------------------- wrapper


def rotary_write_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, *, validate: bool = True,
) -> torch.Tensor:
    """Rotate ``q`` and ``k``, write the rotated ``k`` and ``v`` into their page slots;
    returns the rotated q [T, Hq, D] (see the module docstring). ``validate`` checks the
    positions against ``cos_sin`` (one host sync), as ``rotary``'s does."""
    q, k, positions, cos_sin = check_rotary_args(q, k, positions, cos_sin)
    k, v, k_cache, v_cache, slot_mapping = check_write_kv_args(k, v, k_cache, v_cache,
                                                               slot_mapping)
    t, hq, d = q.shape
    hk = k.shape[1]
    check_shape("v", v, k.shape)
    check_same_device(q=q, positions=positions, cos_sin=cos_sin, k=k)
    if validate:
        check_positions(positions, cos_sin.shape[0])
    num_blocks, page = k_cache.shape[:2]
    q_out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    block_h, block_half, num_warps = rotary_config(max(hq, hk), d)
    q_blocks = cdiv(hq, block_h)
    _rotary_write_kv_kernel[(t, q_blocks + cdiv(hk, block_h))](
        q, k, v, q_out, k_cache, v_cache, positions, cos_sin, slot_mapping, num_blocks * page,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), cos_sin.stride(0),
        hq, hk, q_blocks,
        PAGE=page, HALF=d // 2, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=num_warps,
    )
    return q_out


__all__ = ["rotary_write_kv", "rotary_write_kv_ref"]
