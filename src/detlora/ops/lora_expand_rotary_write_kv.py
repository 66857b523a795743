"""LoRA expand of a fused q|k|v projection, fused with rotary and the KV page write.

Semantics:
    y: [M, (Hq + 2 Hk) D] bf16/fp16/fp32, the base q|k|v output (any row stride); shrink_out,
    lora_b, groups as ``lora_expand`` takes them, with three slices (q, k, v) whose offsets
    are (0, Hq D, (Hq + Hk) D, (Hq + 2 Hk) D); positions, cos_sin, k_cache, v_cache and
    slot_mapping as ``rotary_write_kv`` takes them:

        y2 = lora_expand_ref(y.clone(), shrink_out, lora_b, groups, slice_offsets)
        q, k, v = y2.split((Hq D, Hk D, Hk D), dim=-1)           # viewed as [M, H, D]
        return rotary_write_kv_ref(q, k, v, positions, cos_sin, k_cache, v_cache,
                                   slot_mapping)                 # q_out [M, Hq, D]

    ``y`` is read and never written. Every element gets the expand kernel's arithmetic (its
    ``lora_update``: the rank summed in steps fixed by R and the slot's rank, the update
    rounded to y's dtype and added in fp32, the sum rounded), then ``rotary``'s own rotation
    helper: the fused op has the bits of ``lora_expand`` followed by ``rotary_write_kv``, and is as
    deterministic and batch-invariant as they are. What it saves is a launch per layer and
    the round trip of the updated q|k|v through memory.

Kernel: programs over (row tiles of an adapter group x heads: Hq of q, Hk of k, Hk of v,
adapter groups). A program loads its head for its rows as one tile, adds the slice's update
when the group has an adapter (a ``lora_update`` per half), rotates q and k with
each row's cos/sin, and stores q, or writes k or v into each row's page slot (padding slots
< 0 and slots past the cache are skipped, as ``write_kv`` skips them).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import next_power_of_2
from detlora.ops.adapter_groups import AdapterGroups, row_tile_programs
from detlora.ops.checks import check_same_device
from detlora.ops.lora_configs import ExpandConfig
from detlora.ops.lora_expand import (
    expand_args,
    group_tile_rows,
    lora_expand_ref,
    lora_update,
    row_tile_of,
    slot_rank,
    tile_config,
)
from detlora.ops.lora_partials import ShrinkPartials
from detlora.ops.paged_attention import check_write_kv_args
from detlora.ops.pdl import pdl_kwargs, pdl_start
from detlora.ops.rotary import check_positions, check_rotary_args, rotate
from detlora.ops.rotary_write_kv import rotary_write_kv_ref


def lora_expand_rotary_write_kv_ref(
    y: torch.Tensor,
    shrink_out: torch.Tensor | ShrinkPartials,
    lora_b: torch.Tensor,
    token_adapter: torch.Tensor,
    slice_offsets: Sequence[int],
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    slot_ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: the expand on a copy of ``y``, then rotary + KV write."""
    q, k, v = _qkv_views(lora_expand_ref(y.clone(), shrink_out, lora_b, token_adapter,
                                         slice_offsets, slot_ranks), slice_offsets,
                         k_cache.shape[3])
    return rotary_write_kv_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)


def _qkv_views(y: torch.Tensor, offsets: Sequence[int], head_dim: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = y.shape[0]
    return tuple(y[:, lo:hi].view(m, (hi - lo) // head_dim, head_dim)
                 for lo, hi in itertools.pairwise(offsets))


@triton.jit
def _updated_head(y_ptr, h_ptr, b_ptr, scale_ptr, adapter, slice_id, rows, m_ok, base, rank,
                  R, stride_ym, stride_hp, stride_ha, stride_hs, stride_hm, stride_bl,
                  stride_bn, HALF: tl.constexpr, NUM_PARTS: tl.constexpr,
                  TAIL_GROUP: tl.constexpr, PARTIALS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, BLOCK_R: tl.constexpr, EVEN_R: tl.constexpr,
                  RANKS: tl.constexpr):
    """The two halves [BLOCK_M, BLOCK_HALF] of one head (columns base.. of y) for ``rows``,
    with the slice's LoRA update added as the expand kernel adds it (``lora_update``; none at
    ``rank`` 0); in y's dtype.

    Each half is its own [BLOCK_M, BLOCK_HALF] update tile, as the expand's decode tiles
    are."""
    d = tl.arange(0, BLOCK_HALF)
    cols = base + d % HALF  # padding columns wrap onto real ones: B loads need no mask
    ok = m_ok[:, None] & (d < HALF)[None, :]
    p = y_ptr + rows[:, None] * stride_ym + cols[None, :].to(tl.int64)
    y1 = tl.load(p, mask=ok, other=0.0)
    y2 = tl.load(p + HALF, mask=ok, other=0.0)
    if (adapter >= 0) & (rank > 0):
        u1 = lora_update(h_ptr, b_ptr, scale_ptr, adapter, slice_id, rows, cols, rank, R,
                         stride_hp, stride_ha, stride_hs, stride_hm, stride_bl, stride_bn,
                         NUM_PARTS, TAIL_GROUP, PARTIALS, BLOCK_M, BLOCK_HALF, BLOCK_R, EVEN_R,
                         RANKS)
        u2 = lora_update(h_ptr, b_ptr, scale_ptr, adapter, slice_id, rows, cols + HALF, rank,
                         R, stride_hp, stride_ha, stride_hs, stride_hm, stride_bl, stride_bn,
                         NUM_PARTS, TAIL_GROUP, PARTIALS, BLOCK_M, BLOCK_HALF, BLOCK_R, EVEN_R,
                         RANKS)
        # The expand's arithmetic: update rounded to y's dtype, added in fp32, rounded.
        ty = y_ptr.dtype.element_ty
        y1 = (y1.to(tl.float32) + u1.to(ty).to(tl.float32)).to(ty)
        y2 = (y2.to(tl.float32) + u2.to(ty).to(tl.float32)).to(ty)
    return y1, y2


@triton.jit
def _rotary_write_kv_tile(
    y_ptr, h_ptr, b_ptr, scale_ptr, ranks_ptr, stride_rl, rows_ptr, group_start_ptr,
    group_adapter_ptr, q_out_ptr,
    k_cache_ptr, v_cache_ptr, positions_ptr, cos_sin_ptr, slot_ptr, num_slots, R,
    num_q_heads, num_kv_heads, group, group_rows, tile_m, head,
    stride_ym, stride_hp, stride_ha, stride_hs, stride_hm, stride_bl, stride_bn,
    stride_qot, stride_qoh, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs,
    stride_vch, stride_cs,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    NUM_PARTS: tl.constexpr, TAIL_GROUP: tl.constexpr, PARTIALS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_R: tl.constexpr,
    EVEN_R: tl.constexpr, RANKS: tl.constexpr,
):
    """One head for row tile ``tile_m`` of ``group``."""
    if tile_m * BLOCK_M >= group_rows:
        return
    adapter = tl.load(group_adapter_ptr + group)
    rows, m_ok = group_tile_rows(rows_ptr, group_start_ptr, group, group_rows, tile_m, BLOCK_M)
    d = tl.arange(0, BLOCK_HALF)
    ok = m_ok[:, None] & (d < HALF)[None, :]
    slice_id = (head >= num_q_heads).to(tl.int32) + (head >= num_q_heads + num_kv_heads)
    rank = slot_rank(ranks_ptr, stride_rl, adapter, slice_id, R, RANKS)
    x1, x2 = _updated_head(y_ptr, h_ptr, b_ptr, scale_ptr, adapter, slice_id, rows, m_ok,
                           head * HEAD_DIM, rank, R, stride_ym, stride_hp, stride_ha,
                           stride_hs, stride_hm, stride_bl, stride_bn, HALF, NUM_PARTS,
                           TAIL_GROUP, PARTIALS, BLOCK_M, BLOCK_HALF, BLOCK_R, EVEN_R, RANKS)
    ty = y_ptr.dtype.element_ty  # rotary's output dtype (q's, k's)
    if slice_id < 2:  # q or k: rotated with each row's cos/sin
        pos = tl.load(positions_ptr + rows, mask=m_ok, other=0).to(tl.int64)
        cs = cos_sin_ptr + pos[:, None] * stride_cs + d[None, :]
        r1, r2 = rotate(x1.to(tl.float32), x2.to(tl.float32), tl.load(cs, mask=ok, other=0.0),
                        tl.load(cs + HALF, mask=ok, other=0.0))
        x1, x2 = r1.to(ty), r2.to(ty)
    if slice_id == 0:
        qo = q_out_ptr + rows[:, None] * stride_qot + head * stride_qoh + d[None, :]
        tl.store(qo, x1, mask=ok)
        tl.store(qo + HALF, x2, mask=ok)
    else:
        slot = tl.load(slot_ptr + rows, mask=m_ok, other=-1).to(tl.int64)
        keep = ok & ((slot >= 0) & (slot < num_slots))[:, None]
        page = slot // PAGE
        off = slot % PAGE
        if slice_id == 1:
            kc = k_cache_ptr + (page * stride_kcb + off * stride_kcs)[:, None] \
                + (head - num_q_heads) * stride_kch + d[None, :]
            tl.store(kc, x1.to(k_cache_ptr.dtype.element_ty), mask=keep)
            tl.store(kc + HALF, x2.to(k_cache_ptr.dtype.element_ty), mask=keep)
        else:
            vc = v_cache_ptr + (page * stride_vcb + off * stride_vcs)[:, None] \
                + (head - num_q_heads - num_kv_heads) * stride_vch + d[None, :]
            tl.store(vc, x1.to(v_cache_ptr.dtype.element_ty), mask=keep)
            tl.store(vc + HALF, x2.to(v_cache_ptr.dtype.element_ty), mask=keep)


@triton.jit(do_not_specialize=["num_row_tiles"])
def _expand_rotary_write_kv_kernel(
    y_ptr, h_ptr, b_ptr, scale_ptr, ranks_ptr, stride_rl, rows_ptr, group_start_ptr,
    group_size_ptr, group_adapter_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, positions_ptr,
    cos_sin_ptr, slot_ptr, row_tiles_ptr, num_row_tiles, num_slots, R, num_q_heads,
    num_kv_heads,
    stride_ym, stride_hp, stride_ha, stride_hs, stride_hm, stride_bl, stride_bn,
    stride_qot, stride_qoh, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs,
    stride_vch, stride_cs,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    NUM_PARTS: tl.constexpr, TAIL_GROUP: tl.constexpr, PARTIALS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_R: tl.constexpr,
    EVEN_R: tl.constexpr, RANKS: tl.constexpr, ROW_LOOP: tl.constexpr, PDL: tl.constexpr,
):
    pdl_start(PDL)  # ops/pdl.py: before any read or store
    # Grid: ((Hq + 2 Hk) heads: q, then k, then v, row tiles: one program per row tile the
    # batch can have, or with ROW_LOOP fewer that loop, as the expand's do). y's columns hold
    # the heads in that order, so head j starts at column j * HEAD_DIM.
    head = tl.program_id(0)
    t = tl.program_id(1)
    group, tile_m, group_rows = row_tile_of(row_tiles_ptr, group_size_ptr, t, num_row_tiles)
    if not ROW_LOOP:
        _rotary_write_kv_tile(
            y_ptr, h_ptr, b_ptr, scale_ptr, ranks_ptr, stride_rl, rows_ptr, group_start_ptr,
            group_adapter_ptr,
            q_out_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, cos_sin_ptr, slot_ptr,
            num_slots, R, num_q_heads, num_kv_heads, group, group_rows, tile_m, head,
            stride_ym, stride_hp, stride_ha, stride_hs, stride_hm, stride_bl, stride_bn,
            stride_qot, stride_qoh, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs,
            stride_vch, stride_cs, PAGE, HEAD_DIM, HALF, NUM_PARTS, TAIL_GROUP, PARTIALS,
            BLOCK_M, BLOCK_HALF, BLOCK_R, EVEN_R, RANKS)
    else:
        while group_rows > 0:
            _rotary_write_kv_tile(
                y_ptr, h_ptr, b_ptr, scale_ptr, ranks_ptr, stride_rl, rows_ptr,
                group_start_ptr, group_adapter_ptr,
                q_out_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, cos_sin_ptr, slot_ptr,
                num_slots, R, num_q_heads, num_kv_heads, group, group_rows, tile_m, head,
                stride_ym, stride_hp, stride_ha, stride_hs, stride_hm, stride_bl, stride_bn,
                stride_qot, stride_qoh, stride_kcb, stride_kcs, stride_kch, stride_vcb,
                stride_vcs, stride_vch, stride_cs, PAGE, HEAD_DIM, HALF, NUM_PARTS,
                TAIL_GROUP, PARTIALS, BLOCK_M, BLOCK_HALF, BLOCK_R, EVEN_R, RANKS)
            t += tl.num_programs(1)
            group, tile_m, group_rows = row_tile_of(row_tiles_ptr, group_size_ptr, t,
                                                    num_row_tiles)


def lora_expand_rotary_write_kv(
    y: torch.Tensor,
    shrink_out: torch.Tensor | ShrinkPartials,
    lora_b: torch.Tensor,
    groups: AdapterGroups | torch.Tensor,
    slice_offsets: Sequence[int],
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    slot_ranks: torch.Tensor | None = None,
    config: ExpandConfig | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Rotated q [M, Hq, D] of ``y`` + its LoRA update, with k and v written into the pages
    (module docstring); ``y`` is left unchanged. ``validate`` checks the positions against
    ``cos_sin`` (one host sync)."""
    e = expand_args(y, shrink_out, lora_b, groups, slice_offsets, slot_ranks)
    if len(e.offsets) != 4:
        raise ValueError(f"lora_expand_rotary_write_kv needs three slices (q, k, v), got "
                         f"{len(e.offsets) - 1}")
    head_dim = k_cache.shape[3] if isinstance(k_cache, torch.Tensor) and k_cache.dim() == 4 \
        else None
    q_w, k_w, v_w = e.widths
    if head_dim is None or head_dim == 0 or q_w % head_dim or k_w % head_dim or k_w != v_w:
        raise ValueError(f"the slice widths {e.widths} must be (Hq, Hk, Hk) heads of the "
                         f"cache's head size {head_dim}")
    if y.stride(1) != 1:
        raise ValueError("y must have unit column stride")
    q, k, v = _qkv_views(y, e.offsets, head_dim)
    q, k, positions, cos_sin = check_rotary_args(q, k, positions, cos_sin)
    k, v, k_cache, v_cache, slot_mapping = check_write_kv_args(k, v, k_cache, v_cache,
                                                               slot_mapping)
    check_same_device(y=y, positions=positions, cos_sin=cos_sin, k_cache=k_cache)
    if validate:
        check_positions(positions, cos_sin.shape[0])
    m, hq, hk = y.shape[0], q.shape[1], k.shape[1]
    q_out = torch.empty(m, hq, head_dim, dtype=y.dtype, device=y.device)
    cfg = tile_config(config, m, e.rank, max(e.widths))
    if config is None:  # its grid is small: a cap gains nothing and slows many adapters
        cfg = dataclasses.replace(cfg, group_cap=None)
    g = e.groups
    num_blocks, page = k_cache.shape[:2]
    programs, row_loop = row_tile_programs(m, cfg.block_m, g.num_groups, cfg.group_cap)
    row_tiles = g.row_tiles_for(cfg.block_m)
    grid = (hq + 2 * hk, programs)
    ranks, stride_rl, has_ranks = e.rank_args()
    _expand_rotary_write_kv_kernel[grid](
        y, e.h, lora_b, e.scale, ranks, stride_rl, g.sorted_rows, g.group_start, g.group_size,
        g.group_adapter, q_out, k_cache, v_cache, positions, cos_sin, slot_mapping, row_tiles,
        row_tiles.shape[0],
        num_blocks * page, e.rank,
        hq, hk, y.stride(0), *e.h_strides, lora_b.stride(0), lora_b.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), cos_sin.stride(0),
        PAGE=page, HEAD_DIM=head_dim, HALF=head_dim // 2,
        NUM_PARTS=e.num_parts, TAIL_GROUP=e.tail_group, PARTIALS=e.partials,
        BLOCK_M=cfg.block_m, BLOCK_HALF=next_power_of_2(head_dim // 2), BLOCK_R=cfg.block_r,
        EVEN_R=e.even_r(cfg.block_r), RANKS=has_ranks, ROW_LOOP=row_loop,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_kwargs(y),
    )
    return q_out


__all__ = ["lora_expand_rotary_write_kv", "lora_expand_rotary_write_kv_ref"]
