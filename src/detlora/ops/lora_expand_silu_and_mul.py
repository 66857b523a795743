"""LoRA expand of a gate|up projection fused with SwiGLU: one kernel instead of two.

Semantics:
    y: [M, 2 * I] bf16/fp16/fp32, the base gate|up output (any row stride); shrink_out and
    lora_b as ``lora_expand`` takes them, with two slices of I columns each (gate, up).

        out = silu_and_mul_ref(lora_expand_ref(y.clone(), shrink_out, lora_b, groups))   # [M, I]

    ``y`` is read and never written. Each element is computed exactly as the two kernels
    compute it one after the other (the expand's update rounded to y's dtype and added, the
    sum rounded, then ``g / (1 + exp(-g)) * u`` in fp32, rounded once), so the fused op has
    the unfused ops' bits: it is as deterministic and batch-invariant as they are. What it
    saves is the second launch and the round trip of the updated [M, 2 I] through memory.

Kernel: programs over (row tiles x column tiles of I, adapter groups), like the expand's; a
program loads its gate and up tiles, adds both slices' updates when its group has an
adapter, and stores SiLU(gate) * up. Rows without an adapter form a group of their own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv
from detlora.ops.adapter_groups import AdapterGroups, row_tile_programs
from detlora.ops.checks import check_shape, check_tensor
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
from detlora.ops.pdl import pdl_kwargs, pdl_start
from detlora.ops.silu_and_mul import silu_and_mul_ref


def lora_expand_silu_and_mul_ref(
    y: torch.Tensor,
    shrink_out: torch.Tensor | ShrinkPartials,
    lora_b: torch.Tensor,
    token_adapter: torch.Tensor,
    slice_offsets: Sequence[int] | None = None,
    slot_ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: the two ops one after the other (``y`` left as it was)."""
    return silu_and_mul_ref(lora_expand_ref(y.clone(), shrink_out, lora_b, token_adapter,
                                            slice_offsets, slot_ranks))


@triton.jit
def _silu_and_mul_tile(y_ptr, out_ptr, h_ptr, b_ptr, scale_ptr, ranks_ptr, stride_rl,
                       rows_ptr, group_start_ptr,
                       group_adapter_ptr, group, group_rows, tile_m, tile_n, R, inter,
                       stride_ym, stride_yn, stride_om, stride_hp, stride_ha, stride_hs,
                       stride_hm, stride_bl, stride_bn, NUM_PARTS: tl.constexpr,
                       TAIL_GROUP: tl.constexpr, PARTIALS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                       EVEN_R: tl.constexpr, RANKS: tl.constexpr):
    """One output tile: row tile ``tile_m`` of ``group``, column tile ``tile_n`` of I."""
    if tile_m * BLOCK_M >= group_rows:
        return
    adapter = tl.load(group_adapter_ptr + group)
    rows, m_ok = group_tile_rows(rows_ptr, group_start_ptr, group, group_rows, tile_m, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    cols = offs_n % inter  # padding columns wrap onto real ones: loads need no mask
    ok = m_ok[:, None] & n_ok[None, :]
    g_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :].to(tl.int64) * stride_yn
    g = tl.load(g_ptrs, mask=ok, other=0.0)
    u = tl.load(g_ptrs + inter * stride_yn, mask=ok, other=0.0)
    # The expand's arithmetic: update rounded to y's dtype, added in fp32, rounded; a slice
    # of rank 0 (untargeted) is left as it is, as the expand leaves it.
    rank_g = slot_rank(ranks_ptr, stride_rl, adapter, 0, R, RANKS)
    rank_u = slot_rank(ranks_ptr, stride_rl, adapter, 1, R, RANKS)
    if (adapter >= 0) & (rank_g > 0):
        dg = lora_update(h_ptr, b_ptr, scale_ptr, adapter, 0, rows, cols, rank_g, R,
                         stride_hp, stride_ha, stride_hs, stride_hm, stride_bl, stride_bn,
                         NUM_PARTS, TAIL_GROUP, PARTIALS, BLOCK_M, BLOCK_N, BLOCK_R, EVEN_R,
                         RANKS)
        g = (g.to(tl.float32) + dg.to(y_ptr.dtype.element_ty).to(tl.float32)).to(
            y_ptr.dtype.element_ty)
    if (adapter >= 0) & (rank_u > 0):
        du = lora_update(h_ptr, b_ptr, scale_ptr, adapter, 1, rows, cols + inter, rank_u, R,
                         stride_hp, stride_ha, stride_hs, stride_hm, stride_bl, stride_bn,
                         NUM_PARTS, TAIL_GROUP, PARTIALS, BLOCK_M, BLOCK_N, BLOCK_R, EVEN_R,
                         RANKS)
        u = (u.to(tl.float32) + du.to(y_ptr.dtype.element_ty).to(tl.float32)).to(
            y_ptr.dtype.element_ty)
    # silu_and_mul's arithmetic.
    gf = g.to(tl.float32)
    act = gf / (1.0 + tl.exp(-gf)) * u.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], act.to(
        out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["num_row_tiles"])
def _expand_silu_and_mul_kernel(
    y_ptr,
    out_ptr,
    h_ptr,
    b_ptr,
    scale_ptr,
    ranks_ptr,
    stride_rl,
    rows_ptr,
    group_start_ptr,
    group_size_ptr,
    group_adapter_ptr,
    row_tiles_ptr,
    num_row_tiles,
    R,
    inter,
    stride_ym,
    stride_yn,
    stride_om,
    stride_hp,
    stride_ha,
    stride_hs,
    stride_hm,
    stride_bl,
    stride_bn,
    NUM_PARTS: tl.constexpr,
    TAIL_GROUP: tl.constexpr,
    PARTIALS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    EVEN_R: tl.constexpr,
    RANKS: tl.constexpr,
    ROW_LOOP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)  # ops/pdl.py: before any read or store
    # Grid: (n tiles of I, row tiles: one program per row tile the batch can have, or with
    # ROW_LOOP fewer that loop, as the expand's do).
    tile_n = tl.program_id(0)
    t = tl.program_id(1)
    group, tile_m, group_rows = row_tile_of(row_tiles_ptr, group_size_ptr, t, num_row_tiles)
    if not ROW_LOOP:
        _silu_and_mul_tile(y_ptr, out_ptr, h_ptr, b_ptr, scale_ptr, ranks_ptr, stride_rl,
                           rows_ptr, group_start_ptr, group_adapter_ptr, group, group_rows,
                           tile_m, tile_n, R, inter, stride_ym, stride_yn, stride_om,
                           stride_hp, stride_ha, stride_hs, stride_hm, stride_bl, stride_bn,
                           NUM_PARTS, TAIL_GROUP, PARTIALS, BLOCK_M, BLOCK_N, BLOCK_R, EVEN_R,
                           RANKS)
    else:
        while group_rows > 0:
            _silu_and_mul_tile(y_ptr, out_ptr, h_ptr, b_ptr, scale_ptr, ranks_ptr, stride_rl,
                               rows_ptr, group_start_ptr, group_adapter_ptr, group,
                               group_rows, tile_m, tile_n, R, inter, stride_ym, stride_yn,
                               stride_om, stride_hp, stride_ha, stride_hs, stride_hm,
                               stride_bl, stride_bn, NUM_PARTS, TAIL_GROUP, PARTIALS,
                               BLOCK_M, BLOCK_N, BLOCK_R, EVEN_R, RANKS)
            t += tl.num_programs(1)
            group, tile_m, group_rows = row_tile_of(row_tiles_ptr, group_size_ptr, t,
                                                    num_row_tiles)


def lora_expand_silu_and_mul(
    y: torch.Tensor,
    shrink_out: torch.Tensor | ShrinkPartials,
    lora_b: torch.Tensor,
    groups: AdapterGroups | torch.Tensor,
    slice_offsets: Sequence[int] | None = None,
    *,
    slot_ranks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: ExpandConfig | None = None,
) -> torch.Tensor:
    """``silu(gate') * up'`` where gate'|up' = y + the LoRA update (module docstring):
    returns [M, I] in y's dtype and leaves ``y`` unchanged."""
    e = expand_args(y, shrink_out, lora_b, groups, slice_offsets, slot_ranks)
    m, widths = y.shape[0], e.widths
    if len(widths) != 2 or widths[0] != widths[1]:
        raise ValueError(f"lora_expand_silu_and_mul needs two slices of equal width (gate, "
                         f"up), got widths {widths}")
    inter = widths[0]
    if out is None:
        out = torch.empty(m, inter, dtype=y.dtype, device=y.device)
    else:
        check_tensor("out", out, ndim=2, dtypes=(y.dtype,), unit_last_stride=True)
        check_shape("out", out, (m, inter))
    if m == 0:
        return out
    cfg = tile_config(config, m, e.rank, inter)
    g = e.groups
    programs, row_loop = row_tile_programs(m, cfg.block_m, g.num_groups, cfg.group_cap)
    row_tiles = g.row_tiles_for(cfg.block_m)
    grid = (cdiv(inter, cfg.block_n), programs)
    ranks, stride_rl, has_ranks = e.rank_args()
    _expand_silu_and_mul_kernel[grid](
        y, out, e.h, lora_b, e.scale, ranks, stride_rl,
        g.sorted_rows, g.group_start, g.group_size, g.group_adapter, row_tiles,
        row_tiles.shape[0],
        e.rank, inter, y.stride(0), y.stride(1), out.stride(0), *e.h_strides,
        lora_b.stride(0), lora_b.stride(1),
        NUM_PARTS=e.num_parts, TAIL_GROUP=e.tail_group, PARTIALS=e.partials,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r,
        EVEN_R=e.even_r(cfg.block_r), RANKS=has_ranks, ROW_LOOP=row_loop,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(y),
    )
    return out


__all__ = ["lora_expand_silu_and_mul", "lora_expand_silu_and_mul_ref"]
