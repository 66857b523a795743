"""Rotary position embedding, neox style (Llama, Qwen3), with Llama-3 rope scaling (and
Phi-3's LongRoPE table from ``ops/longrope.py``).

Semantics:
    q: [T, Hq, D], k: [T, Hk, D] (bf16/fp16/fp32), positions: [T] ints,
    cos_sin: [max_positions, D] fp32 from ``rope_cos_sin_cache`` (cos in the first D/2
    columns, sin in the last D/2):

        cos, sin = cos_sin[positions].chunk(2, dim=-1)          # [T, D/2] each
        def rot(x):
            x1, x2 = x.float().chunk(2, dim=-1)
            c, s = cos[:, None, :], sin[:, None, :]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
        return rot(q), rot(k)

    Elementwise per token, so batch-invariant by construction.

Kernel: programs over (token, block of BLOCK_H heads of q, then of k); a program loads its
token's cos and sin once and rotates its heads' two halves in fp32, as
``fma(x1, c, -(x2 * s))`` and ``fma(x2, c, x1 * s)`` (explicit FMAs: see ``rotate``; the
torch reference rounds each product, so the two differ by an ulp at times).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv, next_power_of_2
from detlora.ops.checks import check_same_device, check_shape, check_tensor
from detlora.ops.longrope import longrope_cos_sin_cache

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_TILE = 2048  # elements of one half-head tile per program (BLOCK_H x BLOCK_HALF)


def rope_inv_freq(head_dim: int, base: float, scaling: Mapping | None = None) -> torch.Tensor:
    """Inverse frequencies [D/2] (fp64 math, fp32 result), with a scaling if given: Llama-3's
    ("llama3"), positions divided by ``factor`` ("linear"), or Gemma 4's "proportional": the
    first ``int(partial_rotary_factor * D // 2)`` frequencies base^(-2i/D) (D in the
    exponent, not the rotated width), the rest 0, so that those dims get cos 1 and sin 0 and
    pass through unchanged; all divided by ``factor``."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv.float()
    if kind == "linear":
        return (inv / float(scaling["factor"])).float()
    if kind == "proportional":
        turning = int(float(scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        inv[turning:] = 0.0
        return (inv / float(scaling.get("factor", 1.0))).float()
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: llama3, "
                         "linear, proportional)")
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    scaled = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return scaled.float()


def rope_cos_sin_cache(
    head_dim: int, max_positions: int, base: float, scaling: Mapping | None = None
) -> torch.Tensor:
    """[max_positions, D] fp32: cos | sin of position x inverse frequency (LongRoPE: its
    two tables, ``ops/longrope.py``)."""
    if scaling and scaling.get("rope_type") == "longrope":
        return longrope_cos_sin_cache(head_dim, max_positions, base, scaling)
    inv = rope_inv_freq(head_dim, base, scaling)
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin[positions.long()].chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    return rot(q), rot(k)


# ----------------------------------------------------------------------------- kernel


@triton.jit
def rotate(x1, x2, c, s):
    """The neox rotation of fp32 halves (x1, x2) by (cos, sin): the one place its arithmetic
    lives, so every kernel that rotates gives the same bits. The FMAs are explicit: left to
    itself the compiler fuses one product or the other depending on the code around the
    call (on the GPU a few elements changed bits when the fused q|k|v kernel moved its
    cos/sin loads), so the bits would change with the kernel."""
    return tl.fma(x1, c, -(x2 * s)), tl.fma(x2, c, x1 * s)


@triton.jit
def rotated_halves(src, stride_src_h, head0, n_heads, cos, sin, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Heads head0.. of one token rotated, fp32: (first halves, second halves, the [BLOCK_H,
    BLOCK_HALF] mask, head ids, column ids)."""
    h = head0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    ok = (h < n_heads)[:, None] & (d < HALF)[None, :]
    p = src + h[:, None] * stride_src_h + d[None, :]
    x1 = tl.load(p, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=ok, other=0.0).to(tl.float32)
    y1, y2 = rotate(x1, x2, cos[None, :], sin[None, :])
    return y1, y2, ok, h, d


@triton.jit
def token_cos_sin(positions_ptr, cos_sin_ptr, t, stride_cs, HALF: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    """Token t's cos and sin rows (fp32, BLOCK_HALF wide, zero past HALF)."""
    pos = tl.load(positions_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    cs = cos_sin_ptr + pos * stride_cs + d
    cos = tl.load(cs, mask=d < HALF, other=0.0)
    sin = tl.load(cs + HALF, mask=d < HALF, other=0.0)
    return cos, sin


@triton.jit
def rotate_heads(src, dst, stride_src_h, stride_dst_h, head0, n_heads, cos, sin,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Heads head0.. of one token rotated and stored into dst (dst's dtype)."""
    y1, y2, ok, h, d = rotated_halves(src, stride_src_h, head0, n_heads, cos, sin, HALF,
                                      BLOCK_H, BLOCK_HALF)
    q = dst + h[:, None] * stride_dst_h + d[None, :]
    tl.store(q, y1.to(dst.dtype.element_ty), mask=ok)
    tl.store(q + HALF, y2.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cs,
    num_q_heads,
    num_k_heads,
    q_blocks,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    cos, sin = token_cos_sin(positions_ptr, cos_sin_ptr, t, stride_cs, HALF, BLOCK_HALF)
    if hb < q_blocks:
        rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, stride_qh, stride_qoh,
                     hb * BLOCK_H, num_q_heads, cos, sin, HALF, BLOCK_H, BLOCK_HALF)
    else:
        rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * stride_kot, stride_kh, stride_koh,
                     (hb - q_blocks) * BLOCK_H, num_k_heads, cos, sin, HALF, BLOCK_H,
                     BLOCK_HALF)


# ----------------------------------------------------------------------------- wrapper


def rotary_config(num_heads: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_HALF, num_warps) for the larger head count and the head size."""
    block_half = next_power_of_2(head_dim // 2)
    block_h = max(1, min(next_power_of_2(num_heads), _TILE // block_half))
    return block_h, block_half, min(4, max(1, block_h * block_half // 256))


def check_positions(positions: torch.Tensor, num_positions: int) -> None:
    """Raise ValueError unless every position is in [0, num_positions) (one host sync)."""
    lo, hi = torch.stack(torch.aminmax(positions)).tolist()
    if lo < 0 or hi >= num_positions:
        raise ValueError(
            f"positions must be in [0, {num_positions}) (cos_sin rows), got min {lo}, max {hi}"
        )


def check_rotary_args(
    q: object, k: object, positions: object, cos_sin: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validated (q, k, positions, cos_sin) of a rotary call (ValueError naming the problem)."""
    q = check_tensor("q", q, ndim=3, dtypes=_DTYPES, unit_last_stride=True)
    k = check_tensor("k", k, ndim=3, dtypes=(q.dtype,), unit_last_stride=True)
    positions = check_tensor("positions", positions, ndim=1, dtypes=_INDEX_DTYPES,
                             unit_last_stride=True)
    cos_sin = check_tensor("cos_sin", cos_sin, ndim=2, dtypes=(torch.float32,),
                           unit_last_stride=True)
    t, hq, d = q.shape
    if t == 0 or hq == 0 or d == 0:
        raise ValueError(f"q must have at least one token, head and column, got {tuple(q.shape)}")
    if d % 2:
        raise ValueError(f"q head size must be even, got {d}")
    if k.shape[0] != t or k.shape[2] != d or k.shape[1] == 0:
        raise ValueError(f"k must have shape ({t}, Hk >= 1, {d}), got {tuple(k.shape)}")
    check_shape("positions", positions, (t,))
    if cos_sin.shape[1] != d or cos_sin.shape[0] == 0:
        raise ValueError(
            f"cos_sin must have shape (max_positions, {d}), got {tuple(cos_sin.shape)}"
        )
    return q, k, positions, cos_sin


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding of ``q`` [T, Hq, D] and ``k`` [T, Hk, D]: (q_out, k_out).

    ``out`` = (q_out, k_out) may be given, and may be (q, k) for an in-place update.
    ``validate`` checks that positions index rows of ``cos_sin`` (one host sync); hot loops
    that validated the step's positions once pass ``validate=False``.
    """
    q, k, positions, cos_sin = check_rotary_args(q, k, positions, cos_sin)
    t, hq, d = q.shape
    hk = k.shape[1]
    if out is None:
        q_out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
        k_out = torch.empty(t, hk, d, dtype=k.dtype, device=k.device)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError("out must be a (q_out, k_out) pair")
        q_out = check_tensor("out[0]", out[0], ndim=3, dtypes=(q.dtype,), unit_last_stride=True)
        k_out = check_tensor("out[1]", out[1], ndim=3, dtypes=(k.dtype,), unit_last_stride=True)
        check_shape("out[0]", q_out, q.shape)
        check_shape("out[1]", k_out, k.shape)
    check_same_device(q=q, k=k, positions=positions, cos_sin=cos_sin, q_out=q_out, k_out=k_out)
    if validate:
        check_positions(positions, cos_sin.shape[0])
    block_h, block_half, num_warps = rotary_config(max(hq, hk), d)
    q_blocks = cdiv(hq, block_h)
    _rotary_kernel[(t, q_blocks + cdiv(hk, block_h))](
        q, k, q_out, k_out, positions, cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_sin.stride(0), hq, hk, q_blocks,
        HALF=d // 2, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=num_warps,
    )
    return q_out, k_out


__all__ = ["check_rotary_args", "rope_cos_sin_cache", "rope_inv_freq", "rotary",
           "rotary_config", "rotary_ref"]
