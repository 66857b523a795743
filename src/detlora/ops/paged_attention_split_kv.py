"""Split-KV paged attention tuned for speed, *not* batch-invariant: the ``fast`` level's kernel.

Semantics:
    Exactly ``detlora.ops.paged_attention.paged_attention``'s (same arguments, same result up to
    rounding; ``paged_attention_ref`` is the reference). The KV axis of every query tile is cut
    into ``num_splits`` equal ranges of whole 64-key blocks, ``num_splits`` chosen from the work
    size (query tiles x KV heads) to fill the GPU, as FlashDecoding does, and a second kernel
    combines the partial (max, sum, acc) of each row. So the split points move with the batch
    size and the context length: a row's bits change with what shares its batch. Use
    ``paged_attention`` when that matters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv, next_power_of_2
from detlora.ops.paged_attention import (
    BLOCK_N,
    INDEX_POINTERS,
    LOG2E,
    STEP_INTS,
    attend_blocks,
    check_attention_args,
    find_tile,
    head_lanes,
    head_lanes_width,
    search_block,
    tile_config,
    tile_slots,
)
from detlora.ops.pdl import pdl_kwargs, pdl_start

_TARGET_CTAS = 264  # 132 SMs (H100/H200), two CTAs each
_MAX_SPLITS = 128
_MAX_SCRATCH_FLOATS = 1 << 25


@triton.jit(do_not_specialize=[*STEP_INTS, "window"],
            do_not_specialize_on_alignment=INDEX_POINTERS)
def _split_kv_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_acc_ptr,  # fp32 [splits, T, Hq, D]
    part_ml_ptr,  # fp32 [splits, T, Hq, 2]
    qk_scale,
    num_seqs,
    num_tokens,
    num_q_heads,
    max_blocks,
    num_pages,
    tiles_per_seq,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEARCH: tl.constexpr,
    BLOCK_B: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)  # ops/pdl.py: before any read or store
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq, q_tile = find_tile(pid, query_start_loc_ptr, num_seqs, tiles_per_seq,
                            BLOCK_Q, SEARCH, BLOCK_B)
    if seq >= num_seqs:
        return
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    q_lo = q_tile * BLOCK_Q
    if q_lo >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq).to(tl.int32)
    kv_end = tl.minimum(ctx - q_len + tl.minimum(q_lo + BLOCK_Q, q_len), max_blocks * PAGE)
    n_blocks = tl.cdiv(kv_end, BLOCK_N)
    blk_start = 0
    if HAS_WINDOW:  # the block of the tile's first window start
        blk_start = tl.maximum(ctx - q_len + q_lo - window + 1, 0) // BLOCK_N
    if SPLIT:
        split = tl.program_id(2)
        per_split = tl.cdiv(n_blocks - blk_start, tl.num_programs(2))
        blk_lo = blk_start + split * per_split
        blk_hi = tl.minimum(blk_lo + per_split, n_blocks)
    else:
        blk_lo = blk_start
        blk_hi = n_blocks

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qi = offs_m // GROUP
    tok = q_start + q_lo + qi
    row_ok = (qi < BLOCK_Q) & (q_lo + qi < q_len) & (tok >= 0) & (tok < num_tokens)
    tok = tl.where(row_ok, tok, 0).to(tl.int64)
    head = kv_head * GROUP + offs_m % GROUP
    pos = ctx - q_len + q_lo + qi
    row_lanes = head_lanes(row_ok, offs_d, HEAD_DIM, BLOCK_D)
    q = tl.load(q_ptr + (tok * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
                mask=row_lanes, other=0.0)
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    den = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # Pages read a block ahead only when the KV axis is split: few query tiles, so each CTA's
    # latency is what counts (see attend_blocks).
    m, den, acc = attend_blocks(
        m, den, acc, q,
        k_cache_ptr + kv_head.to(tl.int64) * stride_kh,
        v_cache_ptr + kv_head.to(tl.int64) * stride_vh,
        block_tables_ptr + seq.to(tl.int64) * stride_bt,
        blk_lo, blk_hi, ctx, pos, max_blocks, num_pages, qk_scale, stride_kb, stride_ks, stride_vb,
        stride_vs, window, PAGE, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, SPLIT, HAS_WINDOW,
    )
    if SPLIT:
        # Every split stores, empty ones too (max -inf, sum 0), so the combine reads them all.
        idx = (tl.full((), 0, tl.int64) + split) * (num_tokens * num_q_heads) \
            + tok * num_q_heads + head
        tl.store(part_ml_ptr + 2 * idx, m, mask=row_ok)
        tl.store(part_ml_ptr + 2 * idx + 1, den, mask=row_ok)
        tl.store(part_acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_lanes)
    else:
        out = acc / tl.where(den > 0, den, 1.0)[:, None]
        tl.store(out_ptr + (tok * stride_ot + head * stride_oh)[:, None] + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_lanes)


@triton.jit(do_not_specialize=["num_splits", "num_tokens"])
def _combine_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    num_splits,
    num_tokens,
    num_q_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)  # ops/pdl.py: before any read or store
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, BLOCK_D)
    ok = offs_s < num_splits
    idx = offs_s.to(tl.int64) * (num_tokens * num_q_heads) + t * num_q_heads + h
    m = tl.load(part_ml_ptr + 2 * idx, mask=ok, other=float("-inf"))
    den = tl.load(part_ml_ptr + 2 * idx + 1, mask=ok, other=0.0)
    big_m = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - big_m))
    total = tl.sum(den * w, axis=0)
    acc = tl.load(part_acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=head_lanes(ok, offs_d, HEAD_DIM, BLOCK_D), other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / total
    out_ptrs = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d
    if BLOCK_D == HEAD_DIM:
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty))
    else:  # a padded head: its real lanes only
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def split_kv_config(head_dim: int, group: int, decode_only: bool) -> tuple[int, int, int]:
    """(BLOCK_M, num_warps, num_stages): a 16-row tile when every query is a decode step."""
    if decode_only and group <= 16 and head_lanes_width(head_dim) <= 256:
        return 16, 4, 3
    cfg = tile_config(head_dim, group)
    return cfg.block_m, cfg.num_warps, cfg.num_stages


def paged_attention_split_kv(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    num_splits: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Fast, non-batch-invariant paged attention (see the module docstring).

    ``num_splits`` None: chosen from the number of query tiles x KV heads (FlashDecoding's
    rule: enough CTAs to fill the GPU twice), capped by the block-table width (with a sliding
    ``window``, by the blocks a window spans).
    """
    problem = check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                   scale, out, max_query_len, window)
    if num_splits is not None and (isinstance(num_splits, bool)
                                   or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= _MAX_SPLITS):
        raise ValueError(f"num_splits must be an int in [1, {_MAX_SPLITS}] or None, "
                         f"got {num_splits!r}")
    if out is None:
        out = torch.empty_like(q)
    if problem.num_tokens == 0 or problem.num_seqs == 0:
        return out
    group = problem.group
    block_m, warps, stages = split_kv_config(problem.head_dim, group,
                                             problem.max_query_len == 1)
    block_q = block_m // group
    slots, per_seq, search = tile_slots(problem, block_q)
    hk = problem.num_kv_heads
    max_splits = min(_MAX_SPLITS, cdiv(problem.capacity, BLOCK_N))
    if window is not None:
        max_splits = min(max_splits, cdiv(window + block_q - 1, BLOCK_N) + 1)
    rows = problem.num_tokens * problem.num_q_heads
    if num_splits is None:
        splits = 1
        if slots * hk < _TARGET_CTAS:
            splits = min(cdiv(_TARGET_CTAS, slots * hk), max_splits)
            while splits > 1 and splits * rows * (problem.head_dim + 2) > _MAX_SCRATCH_FLOATS:
                splits //= 2
    else:
        splits = num_splits
    if splits > 1:
        part_acc = torch.empty(splits * rows * problem.head_dim, dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty(splits * rows * 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    _split_kv_kernel[(slots, hk, splits)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, part_acc, part_ml,
        float(scale) * LOG2E,
        problem.num_seqs, problem.num_tokens, problem.num_q_heads, problem.max_blocks,
        k_cache.shape[0], per_seq, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        PAGE=problem.page_size, GROUP=group, HEAD_DIM=problem.head_dim,
        BLOCK_D=head_lanes_width(problem.head_dim), BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_N=BLOCK_N,
        SEARCH=search, BLOCK_B=search_block(problem.num_seqs) if search else 128,
        SPLIT=splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_WINDOW=window is not None,
        num_warps=warps, num_stages=stages, **pdl_kwargs(q),
    )
    if splits > 1:
        _combine_kernel[(problem.num_tokens, problem.num_q_heads)](
            part_acc, part_ml, out, splits, problem.num_tokens, problem.num_q_heads,
            out.stride(0), out.stride(1),
            HEAD_DIM=problem.head_dim, BLOCK_D=head_lanes_width(problem.head_dim),
            SPLITS_P2=next_power_of_2(splits), num_warps=4,
            **pdl_kwargs(q),
        )
    return out


__all__ = ["paged_attention_split_kv", "split_kv_config"]
