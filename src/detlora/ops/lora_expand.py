"""LoRA expand: add each row's low-rank update to the base layer's output, in place.

Semantics:
    y: [M, N] bf16/fp16/fp32 (the base output, any row stride), shrink_out: [S, M, R] fp32,
    lora_b: [L, N, R] (rows line up with y's columns), slice_offsets: S + 1 ints from 0 to N
    (slice s owns columns offsets[s]:offsets[s+1]; widths may differ, as GQA q/k/v do):

        for m, a in enumerate(token_adapter.tolist()):
            if a < 0:
                continue                     # rows without an adapter are left untouched
            for s in range(S):
                c = slice(offsets[s], offsets[s + 1])
                t = shrink_out[s, m].to(lora_b.dtype).float() @ lora_b[a, c].float().T
                y[m, c] += t.to(y.dtype)     # fp32 accumulation, rounded once, then added

    (``lora_expand_ref`` below.) The rank is summed whole by one CTA in a fixed BLOCK_R order,
    so the expand is deterministic and batch-invariant by construction: no Split-K over the
    rank.

    ``slot_ranks`` ([L, S] int32, the slots' ``lora_rank``): each slot's own rank per slice
    (0 where the adapter does not target the slice), with h and B zero past it (slots are
    zero-padded). The kernel then sums a slot's ranks in steps sized to its rank, not the
    full R (a rank-8 slot of a rank-64 engine reads one 16-rank step of B, not 64), and
    leaves rows of a rank-0 slice untouched. The steps are a function of R and the adapter's
    rank alone, so no bit depends on where the adapter sits, on what else is loaded, or on
    the batch.

    ``shrink_out`` may also be a deferred shrink's :class:`ShrinkPartials`: the expand then
    sums the partials of each h tile in the shrink's own tree and scales them, as
    ``reduce_partials_ref`` does, before the product above (the same bits as expanding the
    reduced [S, M, R]).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv
from detlora.ops.adapter_groups import AdapterGroups, check_cap, group_tokens, row_tile_programs
from detlora.ops.checks import check_same_device, check_shape, check_tensor
from detlora.ops.lora_configs import ExpandConfig, expand_config
from detlora.ops.lora_partials import ShrinkPartials, reduce_partials_ref
from detlora.ops.lora_workspace import MAX_LORA_RANK
from detlora.ops.pdl import pdl_kwargs, pdl_start

MAX_SLICES = 3
_WEIGHT_DTYPES = (torch.bfloat16, torch.float16)
_OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def lora_expand_ref(
    y: torch.Tensor,
    shrink_out: torch.Tensor | ShrinkPartials,
    lora_b: torch.Tensor,
    token_adapter: torch.Tensor,
    slice_offsets: Sequence[int] | None = None,
    slot_ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: updates ``y`` in place and returns it (with ``slot_ranks``, each
    slice over its slot's ranks only, and not at all at rank 0)."""
    if isinstance(shrink_out, ShrinkPartials):
        shrink_out = reduce_partials_ref(shrink_out, token_adapter)
    slices, _, rank = shrink_out.shape
    offsets = _offsets(slice_offsets, slices, lora_b.shape[1])
    ids = token_adapter.to(torch.int64)
    for a in torch.unique(ids).tolist():
        if a < 0:
            continue
        rows = (ids == a).nonzero().flatten()
        for s in range(slices):
            r = rank if slot_ranks is None else min(int(slot_ranks[a, s]), rank)
            if r == 0:
                continue
            lo, hi = offsets[s], offsets[s + 1]
            h = shrink_out[s, rows, :r].to(lora_b.dtype).float()
            t = (h @ lora_b[a, lo:hi, :r].float().T).to(y.dtype)
            y[rows, lo:hi] += t
    return y


@triton.jit
def group_tile_rows(rows_ptr, group_start_ptr, group, group_rows, tile_m,
                    BLOCK_M: tl.constexpr):
    """(row indices [BLOCK_M] int64, valid mask) of row tile ``tile_m`` of an adapter group;
    rows past the group read row 0 (never stored)."""
    row_start = tl.load(group_start_ptr + group)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < group_rows
    return tl.load(rows_ptr + row_start + offs_m, mask=m_ok, other=0).to(tl.int64), m_ok


@triton.jit
def row_tile_of(row_tiles_ptr, group_size_ptr, t, num_row_tiles):
    """(group, its row tile, its rows) of the batch's row tile ``t`` (``AdapterGroups.
    row_tiles``); 0 rows past the last tile."""
    entry = tl.load(row_tiles_ptr + t, mask=t < num_row_tiles, other=-1)
    tile = tl.maximum(entry, 0)  # past the last: group 0's tile 0, with 0 rows
    group = tile // 65536
    rows = tl.load(group_size_ptr + group, mask=entry >= 0, other=0)
    return group, tile % 65536, rows


@triton.jit
def _rank_steps(h_rows, b_cols, scale, rank, R, stride_hp, NUM_PARTS: tl.constexpr,
                TAIL_GROUP: tl.constexpr, PARTIALS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, STEP: tl.constexpr, EVEN_R: tl.constexpr):
    """h[rows] @ B^T over ranks [0, rank) rounded up to STEP, summed in STEP-rank dots (loads
    masked at the full rank R unless EVEN_R)."""
    offs_r = tl.arange(0, STEP)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, STEP):
        r = r0 + offs_r
        r_ok = r < R
        if PARTIALS:
            # The shrink's tree: groups of TAIL_GROUP partials from zero, group sums added
            # to a total from zero, then scaled. Unrolled: every load is issued up front.
            total = tl.zeros((BLOCK_M, STEP), dtype=tl.float32)
            group_sum = tl.zeros((BLOCK_M, STEP), dtype=tl.float32)
            for p in tl.static_range(NUM_PARTS):
                group_sum += tl.load(h_rows[:, None] + p * stride_hp + r[None, :],
                                     mask=r_ok[None, :], other=0.0)
                if (p + 1) % TAIL_GROUP == 0 or p == NUM_PARTS - 1:
                    total += group_sum
                    group_sum = tl.zeros((BLOCK_M, STEP), dtype=tl.float32)
            hb = total * scale
        elif EVEN_R:
            hb = tl.load(h_rows[:, None] + r[None, :])
        else:
            hb = tl.load(h_rows[:, None] + r[None, :], mask=r_ok[None, :], other=0.0)
        if EVEN_R:
            bb = tl.load(b_cols[None, :] + r[:, None])
        else:
            bb = tl.load(b_cols[None, :] + r[:, None], mask=r_ok[:, None], other=0.0)
        acc += tl.dot(hb.to(bb.dtype), bb)
    return acc


@triton.jit
def lora_update(h_ptr, b_ptr, scale_ptr, adapter, slice_id, rows, cols, rank, R, stride_hp,
                stride_ha, stride_hs, stride_hm, stride_bl, stride_bn,
                NUM_PARTS: tl.constexpr, TAIL_GROUP: tl.constexpr, PARTIALS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                EVEN_R: tl.constexpr, RANKS: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N]: h[rows] @ B[adapter, cols]^T of one slice, unrounded, over the
    full rank R in BLOCK_R steps (BLOCK_R a function of R alone), or with RANKS over the
    slot's own ``rank`` in steps of min(BLOCK_R, max(16, next power of two of rank)): a
    function of R and the adapter alone. Any tiling gives the same bits. Past ``rank`` h and
    B must be zero (slots are zero-padded). EVEN_R: R is a multiple of BLOCK_R (no masks)."""
    h_rows = h_ptr + adapter.to(tl.int64) * stride_ha + slice_id * stride_hs + rows * stride_hm
    b_cols = b_ptr + adapter.to(tl.int64) * stride_bl + cols.to(tl.int64) * stride_bn
    scale = 0.0
    if PARTIALS:
        scale = tl.load(scale_ptr + adapter)
    if RANKS and BLOCK_R == 64:
        if rank > 32:
            acc = _rank_steps(h_rows, b_cols, scale, rank, R, stride_hp, NUM_PARTS, TAIL_GROUP,
                              PARTIALS, BLOCK_M, BLOCK_N, 64, EVEN_R)
        elif rank > 16:
            acc = _rank_steps(h_rows, b_cols, scale, rank, R, stride_hp, NUM_PARTS, TAIL_GROUP,
                              PARTIALS, BLOCK_M, BLOCK_N, 32, EVEN_R)
        else:
            acc = _rank_steps(h_rows, b_cols, scale, rank, R, stride_hp, NUM_PARTS, TAIL_GROUP,
                              PARTIALS, BLOCK_M, BLOCK_N, 16, EVEN_R)
    elif RANKS and BLOCK_R == 32:
        if rank > 16:
            acc = _rank_steps(h_rows, b_cols, scale, rank, R, stride_hp, NUM_PARTS, TAIL_GROUP,
                              PARTIALS, BLOCK_M, BLOCK_N, 32, EVEN_R)
        else:
            acc = _rank_steps(h_rows, b_cols, scale, rank, R, stride_hp, NUM_PARTS, TAIL_GROUP,
                              PARTIALS, BLOCK_M, BLOCK_N, 16, EVEN_R)
    elif RANKS:
        acc = _rank_steps(h_rows, b_cols, scale, rank, R, stride_hp, NUM_PARTS, TAIL_GROUP,
                          PARTIALS, BLOCK_M, BLOCK_N, BLOCK_R, EVEN_R)
    else:
        acc = _rank_steps(h_rows, b_cols, scale, R, R, stride_hp, NUM_PARTS, TAIL_GROUP,
                          PARTIALS, BLOCK_M, BLOCK_N, BLOCK_R, EVEN_R)
    return acc


@triton.jit
def slot_rank(ranks_ptr, stride_rl, adapter, slice_id, R, RANKS: tl.constexpr):
    """The ranks an adapter row sums for one slice: its slot's own (``slot_ranks``), or all
    R without them. ``adapter`` may be -1 (then any value: the caller skips the row)."""
    if RANKS:
        rank = tl.minimum(
            tl.load(ranks_ptr + tl.maximum(adapter, 0).to(tl.int64) * stride_rl + slice_id), R)
    else:
        rank = R
    return rank


@triton.jit
def _expand_tile(y_ptr, h_ptr, b_ptr, scale_ptr, ranks_ptr, stride_rl, rows_ptr,
                 group_start_ptr, group_adapter_ptr,
                 group, group_rows, tile_m, tile_n, slice_id, col_lo, width, R,
                 stride_ym, stride_yn, stride_hp, stride_ha, stride_hs, stride_hm, stride_bl,
                 stride_bn, NUM_PARTS: tl.constexpr, TAIL_GROUP: tl.constexpr,
                 PARTIALS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_R: tl.constexpr, EVEN_R: tl.constexpr, RANKS: tl.constexpr):
    """One output tile: row tile ``tile_m`` of ``group``, column tile ``tile_n`` of a slice."""
    if (tile_m * BLOCK_M >= group_rows) | (tile_n * BLOCK_N >= width):
        return
    adapter = tl.load(group_adapter_ptr + group)
    if adapter < 0:
        return
    rank = slot_rank(ranks_ptr, stride_rl, adapter, slice_id, R, RANKS)
    if rank == 0:
        return
    rows, m_ok = group_tile_rows(rows_ptr, group_start_ptr, group, group_rows, tile_m, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < width
    cols = col_lo + offs_n % width  # padding columns wrap onto real ones: loads need no mask

    acc = lora_update(h_ptr, b_ptr, scale_ptr, adapter, slice_id, rows, cols, rank, R,
                      stride_hp, stride_ha, stride_hs, stride_hm, stride_bl, stride_bn,
                      NUM_PARTS, TAIL_GROUP, PARTIALS, BLOCK_M, BLOCK_N, BLOCK_R, EVEN_R, RANKS)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :].to(tl.int64) * stride_yn
    ok = m_ok[:, None] & n_ok[None, :]
    y_old = tl.load(y_ptrs, mask=ok, other=0.0)
    update = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptrs, (y_old.to(tl.float32) + update).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["num_row_tiles"])
def _expand_kernel(
    y_ptr,
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
    off1,
    off2,
    off3,
    stride_ym,
    stride_yn,
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
    # Grid: (n tiles of the widest slice, slices, row tiles: one program per row tile the
    # batch can have, or with ROW_LOOP fewer, each taking tiles t, t + programs, ...).
    tile_n = tl.program_id(0)
    slice_id = tl.program_id(1)
    t = tl.program_id(2)
    col_lo = tl.where(slice_id == 0, 0, tl.where(slice_id == 1, off1, off2))
    col_hi = tl.where(slice_id == 0, off1, tl.where(slice_id == 1, off2, off3))
    width = col_hi - col_lo
    group, tile_m, group_rows = row_tile_of(row_tiles_ptr, group_size_ptr, t, num_row_tiles)
    if not ROW_LOOP:
        _expand_tile(y_ptr, h_ptr, b_ptr, scale_ptr, ranks_ptr, stride_rl, rows_ptr,
                     group_start_ptr, group_adapter_ptr, group, group_rows, tile_m, tile_n,
                     slice_id, col_lo, width, R, stride_ym, stride_yn, stride_hp, stride_ha,
                     stride_hs, stride_hm, stride_bl, stride_bn, NUM_PARTS, TAIL_GROUP,
                     PARTIALS, BLOCK_M, BLOCK_N, BLOCK_R, EVEN_R, RANKS)
    else:
        while group_rows > 0:
            _expand_tile(y_ptr, h_ptr, b_ptr, scale_ptr, ranks_ptr, stride_rl, rows_ptr,
                         group_start_ptr, group_adapter_ptr, group, group_rows, tile_m,
                         tile_n, slice_id, col_lo, width, R, stride_ym, stride_yn, stride_hp,
                         stride_ha, stride_hs, stride_hm, stride_bl, stride_bn, NUM_PARTS,
                         TAIL_GROUP, PARTIALS, BLOCK_M, BLOCK_N, BLOCK_R, EVEN_R, RANKS)
            t += tl.num_programs(2)
            group, tile_m, group_rows = row_tile_of(row_tiles_ptr, group_size_ptr, t,
                                                    num_row_tiles)


@dataclass(frozen=True)
class ExpandArgs:
    """A checked expand call, as the kernels take it (shared with the fused expand ops)."""

    h: torch.Tensor  # the shrink output, or the partials' storage
    h_strides: tuple[int, int, int, int]  # part, adapter, slice and row strides of h
    scale: torch.Tensor  # fp32 [L] (partials only; any tensor otherwise)
    num_parts: int
    tail_group: int
    partials: bool
    rank: int
    offsets: list[int]  # S + 1 column offsets
    groups: AdapterGroups
    slot_ranks: torch.Tensor | None  # int32 [L, S], or None: every slot sums all R ranks

    @property
    def widths(self) -> list[int]:
        return [b - a for a, b in itertools.pairwise(self.offsets)]

    def even_r(self, block_r: int) -> bool:
        """EVEN_R: rank loads need no mask (the full rank is a multiple of ``block_r``)."""
        return self.rank % block_r == 0

    def rank_args(self) -> tuple[torch.Tensor, int, bool]:
        """(ranks pointer, its adapter stride, RANKS) as the kernels take them."""
        if self.slot_ranks is None:
            return self.scale, 0, False  # never read
        return self.slot_ranks, self.slot_ranks.stride(0), True


def expand_args(
    y: torch.Tensor,
    shrink_out: torch.Tensor | ShrinkPartials,
    lora_b: torch.Tensor,
    groups: AdapterGroups | torch.Tensor,
    slice_offsets: Sequence[int] | None,
    slot_ranks: torch.Tensor | None = None,
) -> ExpandArgs:
    """Check an expand's operands (see ``lora_expand``) and put them in kernel form."""
    y = check_tensor("y", y, ndim=2, dtypes=_OUTPUT_DTYPES)
    if isinstance(shrink_out, ShrinkPartials):
        partials = _check_partials(shrink_out)
        h = partials.partials
        slices, m, rank = partials.slices, partials.num_rows, partials.rank
        h_strides = (h.stride(0), partials.adapter_stride, rank, h.stride(1))
        scale = partials.scale
        num_parts, tail_group = partials.num_parts, partials.tail_group
    else:
        h = check_tensor(
            "shrink_out", shrink_out, ndim=3, dtypes=(torch.float32,), unit_last_stride=True
        )
        slices, m, rank = h.shape
        h_strides = (0, 0, h.stride(0), h.stride(1))
        scale = h  # unused
        num_parts, tail_group = 1, 1
    lora_b = check_tensor("lora_b", lora_b, ndim=3, dtypes=_WEIGHT_DTYPES, unit_last_stride=True)
    num_adapters, n_out, b_rank = lora_b.shape
    if not 1 <= slices <= MAX_SLICES:
        raise ValueError(f"shrink_out must have 1 to {MAX_SLICES} slices, got {slices}")
    if isinstance(shrink_out, ShrinkPartials) and scale.shape[0] != lora_b.shape[0]:
        raise ValueError(f"the partials' scale has {scale.shape[0]} adapter slots but lora_b "
                         f"has {lora_b.shape[0]}")
    if not 1 <= rank <= MAX_LORA_RANK:
        raise ValueError(f"shrink_out rank {rank} is outside [1, {MAX_LORA_RANK}]")
    if b_rank != rank:
        raise ValueError(f"lora_b rank {b_rank} must match shrink_out rank {rank}")
    check_shape("y", y, (m, n_out))
    offsets = _offsets(slice_offsets, slices, n_out)
    if isinstance(groups, torch.Tensor):
        groups = group_tokens(groups, num_adapters)
    elif not isinstance(groups, AdapterGroups):
        raise ValueError(f"groups must be AdapterGroups or a token_adapter tensor, got {groups!r}")
    if groups.num_rows != m:
        raise ValueError(f"groups cover {groups.num_rows} rows but y has {m}")
    if groups.num_adapters > num_adapters:
        raise ValueError(
            f"groups index {groups.num_adapters} adapter slots but lora_b has {num_adapters}"
        )
    if slot_ranks is not None:
        slot_ranks = check_tensor("slot_ranks", slot_ranks, ndim=2, dtypes=(torch.int32,),
                                  unit_last_stride=True)
        check_shape("slot_ranks", slot_ranks, (num_adapters, slices))
    check_same_device(y=y, shrink_out=h, lora_b=lora_b, scale=scale,
                      token_adapter=groups.token_adapter,
                      **({} if slot_ranks is None else {"slot_ranks": slot_ranks}))
    return ExpandArgs(h, h_strides, scale, num_parts, tail_group,
                      isinstance(shrink_out, ShrinkPartials), rank, offsets, groups,
                      slot_ranks)


def lora_expand(
    y: torch.Tensor,
    shrink_out: torch.Tensor | ShrinkPartials,
    lora_b: torch.Tensor,
    groups: AdapterGroups | torch.Tensor,
    slice_offsets: Sequence[int] | None = None,
    *,
    slot_ranks: torch.Tensor | None = None,
    config: ExpandConfig | None = None,
) -> torch.Tensor:
    """Add the LoRA update to ``y`` in place (see the module docstring) and return ``y``."""
    e = expand_args(y, shrink_out, lora_b, groups, slice_offsets, slot_ranks)
    m, widths = y.shape[0], e.widths
    cfg = tile_config(config, m, e.rank, max(widths))
    padded = e.offsets + [e.offsets[-1]] * (MAX_SLICES + 1 - len(e.offsets))
    g = e.groups
    programs, row_loop = row_tile_programs(m, cfg.block_m, g.num_groups, cfg.group_cap)
    row_tiles = g.row_tiles_for(cfg.block_m)
    grid = (cdiv(max(widths), cfg.block_n), len(widths), programs)
    ranks, stride_rl, has_ranks = e.rank_args()
    _expand_kernel[grid](
        y, e.h, lora_b, e.scale, ranks, stride_rl,
        g.sorted_rows, g.group_start, g.group_size, g.group_adapter, row_tiles,
        row_tiles.shape[0], e.rank, padded[1], padded[2], padded[3],
        y.stride(0), y.stride(1), *e.h_strides,
        lora_b.stride(0), lora_b.stride(1),
        NUM_PARTS=e.num_parts, TAIL_GROUP=e.tail_group, PARTIALS=e.partials,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r,
        EVEN_R=e.even_r(cfg.block_r), RANKS=has_ranks, ROW_LOOP=row_loop,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(y),
    )
    return y


def tile_config(config: ExpandConfig | None, m: int, rank: int, width: int) -> ExpandConfig:
    """``config``, checked, or the default tiles for M rows of ``width`` columns."""
    cfg = config or expand_config(m, rank, width)
    if not isinstance(cfg, ExpandConfig):
        raise ValueError(f"config must be an ExpandConfig, got {type(cfg).__name__}")
    check_cap(cfg.group_cap)
    return cfg


def _check_partials(sp: ShrinkPartials) -> ShrinkPartials:
    check_tensor("shrink_out.partials", sp.partials, ndim=3, dtypes=_OUTPUT_DTYPES,
                 unit_last_stride=True)
    check_tensor("shrink_out.scale", sp.scale, ndim=1, dtypes=(torch.float32,))
    if not 1 <= sp.rank <= MAX_LORA_RANK or sp.slices < 1:
        raise ValueError(f"shrink_out has {sp.slices} slices of rank {sp.rank}")
    n = sp.slices * sp.rank
    if sp.adapter_stride < 0 or 0 < sp.adapter_stride < n:
        raise ValueError(f"shrink_out.adapter_stride must be 0 or >= slices x rank = {n}, "
                         f"got {sp.adapter_stride}")
    want = n + sp.adapter_stride * (sp.scale.shape[0] - 1)
    if sp.partials.shape[2] != (want if sp.adapter_stride else n):
        raise ValueError(f"shrink_out.partials has {sp.partials.shape[2]} columns, not "
                         f"{want if sp.adapter_stride else n} (slices x rank per adapter slot)")
    if sp.tail_group < 1:
        raise ValueError(f"shrink_out.tail_group must be >= 1, got {sp.tail_group}")
    return sp


def _offsets(slice_offsets: Sequence[int] | None, slices: int, n_out: int) -> list[int]:
    if slice_offsets is None:
        if n_out % slices:
            raise ValueError(
                f"slice_offsets is required: {n_out} output columns do not split evenly "
                f"into {slices} slices"
            )
        width = n_out // slices
        return [i * width for i in range(slices + 1)]
    offsets = [int(o) for o in slice_offsets]
    if len(offsets) != slices + 1:
        raise ValueError(f"slice_offsets must hold {slices + 1} ints, got {len(offsets)}")
    if offsets[0] != 0 or offsets[-1] != n_out:
        raise ValueError(f"slice_offsets must run from 0 to {n_out}, got {offsets}")
    if any(b <= a for a, b in itertools.pairwise(offsets)):
        raise ValueError(f"slice_offsets must be strictly increasing, got {offsets}")
    return offsets


__all__ = ["ExpandArgs", "expand_args", "group_tile_rows", "lora_expand", "lora_expand_ref",
           "lora_update", "row_tile_of", "slot_rank", "tile_config"]
