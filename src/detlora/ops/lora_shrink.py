"""LoRA shrink: every row times its adapter's A, for 1 to 3 slices, in one launch.

Semantics:
    x: [M, H] bf16/fp16, lora_a: [L, S, R, H] (same dtype), scale: [L] fp32,
    token_adapter: [M] ints in [-1, L) (-1 = no adapter). Returns fp32 ``out`` [S, M, R]:

        out = torch.zeros(S, M, R, dtype=torch.float32)
        for m, a in enumerate(token_adapter.tolist()):
            if a >= 0:
                out[:, m] = scale[a] * (x[m].float() @ lora_a[a].float().transpose(1, 2))

    (``lora_shrink_ref`` below.) The S slices (q/k/v, gate/up) share x and rank R, so one
    launch treats them as one N = S * R wide output and reads each x tile once.

Reductions: how the H axis is summed when it is split across CTAs (Split-K).
    unsplit     one CTA per output tile walks all of H (Split-K = 1).
    atomic      S_k CTAs per tile add scaled partials with fp32 atomics; the order of the adds
                follows the GPU's schedule, so the bits vary run to run. Output zeroed first.
    ordered     S_k CTAs store fp32 partials to scratch and bump a per-tile counter
                (acq_rel, GPU scope); the CTA that sees S_k - 1 sums the partials in split
                order, scales, stores the tile with a plain store and resets the counter to
                zero. No init launch, no output zeroing, scratch allocated once.
    ordered_bi  ordered with a reduction tree fixed per H (chunks of 256 summed from zero,
                3 chunks a group, group sums added in order); the row count only decides
                where each level is summed (one CTA per chunk, per group, or for all of K),
                so a row's bits do not depend on how many rows share the call.
    tree        S_k CTAs store partials; a second launch sums them in a fixed pairwise tree
                ``(p0 + p1) + (p2 + p3)`` (the paper's earlier design, kept for comparison).

Deferred (``defer=True``; unsplit, ordered and ordered_bi): every CTA stores its unscaled
partial and exits, and ``lora_expand`` sums the partials in the same tree (see
``lora_partials``): the same bits, without the counter and the last CTA's reload. The engine
does not defer: beside its base GEMM the shrink's tail was not what the expand waited for,
and the expand's extra loads cost more (see docs/decisions.md, "Deferred partials").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from detlora.config import LoRAReduction
from detlora.ops._runtime import cdiv, next_power_of_2
from detlora.ops.adapter_groups import AdapterGroups, group_programs, group_tokens
from detlora.ops.checks import check_same_device, check_shape, check_tensor
from detlora.ops.lora_configs import CTA_COVERS, ShrinkConfig, shrink_config
from detlora.ops.lora_partials import ShrinkPartials
from detlora.ops.lora_workspace import MAX_LORA_RANK, LoRAWorkspace, default_workspace

MAX_SLICES = 3
_INPUT_DTYPES = (torch.bfloat16, torch.float16)

# Kernel modes (constexpr): how a CTA's K partial leaves the CTA.
_STORE, _ATOMIC, _ORDERED, _TREE, _PARTIALS = 0, 1, 2, 3, 4
# Reductions whose tree the expand can finish (atomic has no partials; tree's order differs).
DEFERRABLE = (LoRAReduction.UNSPLIT, LoRAReduction.ORDERED, LoRAReduction.ORDERED_BI)


# ----------------------------------------------------------------------------- reference


def lora_shrink_ref(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_adapter: torch.Tensor,
    scale: torch.Tensor | float,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Torch reference; ``compute_dtype=torch.float64`` gives the test oracle."""
    num_adapters, slices, rank, _ = lora_a.shape
    m = x.shape[0]
    scale_t = _scale_tensor(scale, num_adapters, x.device).to(compute_dtype)
    out = torch.zeros(slices, m, rank, dtype=compute_dtype, device=x.device)
    ids = token_adapter.to(torch.int64)
    for a in torch.unique(ids).tolist():
        if a < 0:
            continue
        rows = (ids == a).nonzero().flatten()
        xa = x[rows].to(compute_dtype)  # [m_a, H]
        wa = lora_a[a].to(compute_dtype)  # [S, R, H]
        out[:, rows] = scale_t[a] * torch.einsum("mh,srh->smr", xa, wa)
    return out.to(torch.float32) if compute_dtype != torch.float64 else out


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _load_k_block(x_rows, a_cols, kb, H, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The x tile [BLOCK_M, BLOCK_K] and A^T tile [BLOCK_K, BLOCK_N] of K block ``kb``."""
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    if EVEN_K:
        xb = tl.load(x_rows[:, None] + k[None, :])
        ab = tl.load(a_cols[None, :] + k[:, None])
    else:
        k_ok = k < H
        xb = tl.load(x_rows[:, None] + k[None, :], mask=k_ok[None, :], other=0.0)
        ab = tl.load(a_cols[None, :] + k[:, None], mask=k_ok[:, None], other=0.0)
    return xb, ab


@triton.jit
def _chunk_partial(
    x_rows,  # [BLOCK_M] pointers to x rows
    a_cols,  # [BLOCK_N] pointers to A rows (one per output column)
    k_block_lo,
    k_block_hi,
    H,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """fp32 sum over K blocks [k_block_lo, k_block_hi) in increasing order, from zero."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(k_block_lo, k_block_hi):
        xb, ab = _load_k_block(x_rows, a_cols, kb, H, BLOCK_K, EVEN_K)
        acc = tl.dot(xb, ab, acc)
    return acc


@triton.jit
def _tree_sum(
    x_rows,
    a_cols,
    k_block_lo,
    k_block_hi,
    num_k_blocks,
    blocks_per_chunk,
    blocks_per_group,
    H,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """The two-level tree over K blocks [lo, hi) (which start on a group boundary).

    Chunk sums start from zero and are built exactly as _chunk_partial builds them; group
    sums start from zero and add chunk sums in order; the result starts from zero and adds
    group sums in order. One flat loop keeps the loads software-pipelined across boundaries.
    """
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    group_sum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(k_block_lo, k_block_hi):
        xb, ab = _load_k_block(x_rows, a_cols, kb, H, BLOCK_K, EVEN_K)
        acc = tl.dot(xb, ab, acc)
        last = kb == num_k_blocks - 1
        chunk_end = ((kb + 1) % blocks_per_chunk == 0) | last
        group_end = ((kb + 1) % blocks_per_group == 0) | last
        group_sum = tl.where(chunk_end, group_sum + acc, group_sum)
        acc = tl.where(chunk_end, 0.0, acc)
        total = tl.where(group_end, total + group_sum, total)
        group_sum = tl.where(group_end, 0.0, group_sum)
    return total


@triton.jit
def _shrink_tile(
    x_ptr, a_ptr, out_ptr, scale_ptr, rows_ptr, group_start_ptr, group_adapter_ptr,
    scratch_ptr, counter_ptr, group, group_rows, split, tile_m, tile_n, n_tiles,
    H, R, N, blocks_per_chunk, blocks_per_group, blocks_per_cta,
    stride_xm, stride_al, stride_as, stride_ar, stride_os, stride_om, stride_or, stride_ps,
    MODE: tl.constexpr, SPLIT: tl.constexpr, TAIL_GROUP: tl.constexpr,
    TREE_IN_CTA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    """Split ``split`` of output tile (``tile_m`` of ``group``, ``tile_n``)."""
    if tile_m * BLOCK_M >= group_rows:
        return
    row_start = tl.load(group_start_ptr + group)
    adapter = tl.load(group_adapter_ptr + group)

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < group_rows
    rows = tl.load(rows_ptr + row_start + offs_m, mask=m_ok, other=0).to(tl.int64)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # Column n of the fused output is rank n % R of slice n // R. Padding columns wrap onto
    # real ones so their loads need no mask; their results are never stored.
    n_safe = offs_n % N
    n_slice = n_safe // R
    n_rank = n_safe % R
    out_ptrs = (
        out_ptr
        + n_slice[None, :] * stride_os
        + rows[:, None] * stride_om
        + n_rank[None, :] * stride_or
    )
    out_ok = m_ok[:, None] & n_ok[None, :]

    if adapter < 0:
        # Rows without an adapter are zero; atomic's output is zeroed already, tree's
        # second launch writes them and the expand skips them in deferred partials.
        if (MODE == 0 or MODE == 2) and split == 0:
            tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), mask=out_ok)
        return

    scale = tl.load(scale_ptr + adapter)
    x_rows = x_ptr + rows * stride_xm
    a_cols = a_ptr + adapter.to(tl.int64) * stride_al + n_slice * stride_as + n_rank * stride_ar
    num_k_blocks = tl.cdiv(H, BLOCK_K)

    # This CTA's share of K: one chunk, one group, or all of it.
    lo = split * blocks_per_cta
    hi = tl.minimum(lo + blocks_per_cta, num_k_blocks)
    if TREE_IN_CTA:
        acc = _tree_sum(x_rows, a_cols, lo, hi, num_k_blocks, blocks_per_chunk, blocks_per_group,
                        H, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    else:
        acc = _chunk_partial(x_rows, a_cols, lo, hi, H, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)

    if MODE == 0:  # _STORE: this CTA reduced all of K
        tl.store(out_ptrs, acc * scale, mask=out_ok)
    elif MODE == 1:  # _ATOMIC
        tl.atomic_add(out_ptrs, acc * scale, mask=out_ok, sem="relaxed")
    else:
        # Scratch (or the deferred partials) is [split, M, N] with N contiguous, indexed by
        # the original row; MODE 4 (_PARTIALS) stops here and leaves the sum to the expand.
        part_ptrs = scratch_ptr + rows[:, None] * N + offs_n[None, :]
        tl.store(part_ptrs + split * stride_ps, acc, mask=out_ok)
        if MODE == 2:  # _ORDERED
            # Every thread's partial is written before the counter moves (CTA barrier, then
            # a release at GPU scope); the last CTA acquires and reads them from L2.
            tl.debug_barrier()
            m_tiles = tl.num_programs(0) // (SPLIT * n_tiles)
            tile_id = (group * m_tiles + tile_m) * n_tiles + tile_n
            done = tl.atomic_add(counter_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT - 1:
                # The rest of the tree, in order: groups of TAIL_GROUP partials summed from
                # zero, then added to a total from zero. Unrolled, so every partial's load
                # is in flight before the first add.
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                group_sum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLIT):
                    group_sum += tl.load(part_ptrs + s * stride_ps, mask=out_ok, other=0.0,
                                         cache_modifier=".cg")
                    if (s + 1) % TAIL_GROUP == 0 or s == SPLIT - 1:
                        total += group_sum
                        group_sum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                tl.store(out_ptrs, total * scale, mask=out_ok)
                tl.store(counter_ptr + tile_id, 0)  # self-reset: no init launch next call


@triton.jit
def next_group(group_size_ptr, group, num_groups, GROUP_CAP: tl.constexpr):
    """(the next group a capped program takes, its rows): 0 rows past the last group."""
    group += GROUP_CAP
    return group, tl.load(group_size_ptr + group, mask=group < num_groups, other=0)


@triton.jit(do_not_specialize=["num_groups"])
def _shrink_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    scale_ptr,
    rows_ptr,
    group_start_ptr,
    group_size_ptr,
    group_adapter_ptr,
    scratch_ptr,
    counter_ptr,
    num_groups,
    H,
    R,
    N,
    blocks_per_chunk,
    blocks_per_group,
    blocks_per_cta,
    stride_xm,
    stride_al,
    stride_as,
    stride_ar,
    stride_os,
    stride_om,
    stride_or,
    stride_ps,
    MODE: tl.constexpr,
    SPLIT: tl.constexpr,
    TAIL_GROUP: tl.constexpr,
    TREE_IN_CTA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    GROUP_CAP: tl.constexpr,
):
    # Grid: (m tiles x n tiles x splits, groups: all, or GROUP_CAP programs that each loop
    # over groups z, z + GROUP_CAP, ... while they have rows). Split is the fastest axis so
    # the CTAs of one tile are scheduled together and the last one finds its partners'
    # partials in L2.
    pid = tl.program_id(0)
    group = tl.program_id(1)
    n_tiles = tl.cdiv(N, BLOCK_N)
    split = pid % SPLIT
    tile = pid // SPLIT
    tile_n = tile % n_tiles
    tile_m = tile // n_tiles
    group_rows = tl.load(group_size_ptr + group)
    if GROUP_CAP == 0:
        _shrink_tile(x_ptr, a_ptr, out_ptr, scale_ptr, rows_ptr, group_start_ptr,
                     group_adapter_ptr, scratch_ptr, counter_ptr, group, group_rows, split,
                     tile_m, tile_n, n_tiles, H, R, N, blocks_per_chunk, blocks_per_group,
                     blocks_per_cta, stride_xm, stride_al, stride_as, stride_ar, stride_os,
                     stride_om, stride_or, stride_ps, MODE, SPLIT, TAIL_GROUP, TREE_IN_CTA,
                     BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    else:
        while group_rows > 0:
            _shrink_tile(x_ptr, a_ptr, out_ptr, scale_ptr, rows_ptr, group_start_ptr,
                         group_adapter_ptr, scratch_ptr, counter_ptr, group, group_rows, split,
                         tile_m, tile_n, n_tiles, H, R, N, blocks_per_chunk, blocks_per_group,
                         blocks_per_cta, stride_xm, stride_al, stride_as, stride_ar,
                         stride_os, stride_om, stride_or, stride_ps, MODE, SPLIT, TAIL_GROUP,
                         TREE_IN_CTA, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
            group, group_rows = next_group(group_size_ptr, group, num_groups, GROUP_CAP)


@triton.jit(do_not_specialize=["M", "stride_ps"])  # rows change with the batch
def _tree_reduce_kernel(
    scratch_ptr,
    out_ptr,
    scale_ptr,
    token_adapter_ptr,
    M,
    N,
    R,
    num_splits,
    stride_ps,
    stride_os,
    stride_om,
    stride_or,
    SPLIT_P2: tl.constexpr,
    LOG2_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out[m, n] = scale * pairwise-tree sum of the partials; rows without adapter get 0."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    adapter = tl.load(token_adapter_ptr + offs_m, mask=m_ok, other=-1)
    has = adapter >= 0
    offs_s = tl.arange(0, SPLIT_P2)
    ok = (offs_s[:, None, None] < num_splits) & (m_ok & has)[None, :, None] & n_ok[None, None, :]
    parts = tl.load(
        scratch_ptr
        + offs_s[:, None, None] * stride_ps
        + offs_m[None, :, None].to(tl.int64) * N
        + offs_n[None, None, :],
        mask=ok,
        other=0.0,
    )
    # Missing partials are exact zeros, so padding to a power of two leaves the tree intact.
    for level in tl.static_range(LOG2_SPLIT):
        parts = tl.reshape(parts, (SPLIT_P2 >> (level + 1), 2, BLOCK_M, BLOCK_N))
        left, right = tl.split(tl.permute(parts, (0, 2, 3, 1)))
        parts = left + right
    total = tl.reshape(parts, (BLOCK_M, BLOCK_N))
    scale = tl.load(scale_ptr + tl.maximum(adapter, 0), mask=m_ok, other=0.0)
    result = tl.where(has[:, None], total * scale[:, None], 0.0)
    n_slice = offs_n // R
    n_rank = offs_n % R
    out_ptrs = (
        out_ptr
        + n_slice[None, :] * stride_os
        + offs_m[:, None].to(tl.int64) * stride_om
        + n_rank[None, :] * stride_or
    )
    tl.store(out_ptrs, result, mask=m_ok[:, None] & n_ok[None, :])


# ----------------------------------------------------------------------------- wrapper


@dataclass(frozen=True)
class _Plan:
    """How one call splits K: CTAs along K, what each covers, and the tail of the tree."""

    splits: int
    blocks_per_chunk: int
    blocks_per_group: int
    blocks_per_cta: int
    tree_in_cta: bool
    tail_group: int


def _plan(cfg: ShrinkConfig, hidden: int) -> _Plan:
    blocks_per_chunk = cfg.chunk_size(hidden) // cfg.block_k
    blocks_per_group = blocks_per_chunk * cfg.group_chunks
    num_k_blocks = cdiv(hidden, cfg.block_k)
    splits = cfg.ctas_along_k(hidden)  # CTAs along K
    covers = cfg.cta_covers if splits > 1 else "all"
    blocks_per_cta = {"chunk": blocks_per_chunk, "group": blocks_per_group,
                      "all": num_k_blocks}[covers]
    # A CTA that covers more than one chunk sums its share as a tree; one chunk is plain.
    tree_in_cta = blocks_per_cta > blocks_per_chunk and num_k_blocks > blocks_per_chunk
    return _Plan(splits, blocks_per_chunk, blocks_per_group, blocks_per_cta, tree_in_cta,
                 cfg.group_chunks if covers == "chunk" else 1)


def partials_shape(
    reduction: LoRAReduction | str, num_rows: int, hidden: int, slices: int, rank: int,
    config: ShrinkConfig | None = None,
) -> tuple[int, int, int]:
    """Shape [P, M, S * R] of the buffer a deferred ``lora_shrink`` fills."""
    reduction = LoRAReduction.parse(reduction)
    cfg = config or shrink_config(reduction, num_rows, hidden, slices * rank)
    return (_plan(cfg, hidden).splits, num_rows, slices * rank)


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    groups: AdapterGroups | torch.Tensor,
    scale: torch.Tensor | float,
    *,
    reduction: LoRAReduction | str = LoRAReduction.ORDERED,
    out: torch.Tensor | None = None,
    config: ShrinkConfig | None = None,
    workspace: LoRAWorkspace | None = None,
    defer: bool = False,
) -> torch.Tensor | ShrinkPartials:
    """Compute the shrink of every row with its adapter; see the module docstring.

    ``groups`` is an :class:`AdapterGroups` (built once per step) or a raw ``token_adapter``
    tensor. ``out`` ([S, M, R] fp32) is written in full, so it need not be zeroed.
    ``defer=True`` returns :class:`ShrinkPartials` for ``lora_expand`` to sum; ``out`` is then
    the [P, M, S * R] fp32 partials buffer (``partials_shape``), allocated if not given.
    """
    reduction = LoRAReduction.parse(reduction)
    if reduction is LoRAReduction.IN_GEMM:
        raise ValueError("reduction in_gemm has no shrink kernel: the base linear computes "
                         "x A^T as extra output columns (LoRASlots.expand_in_gemm)")
    x = check_tensor("x", x, ndim=2, dtypes=_INPUT_DTYPES, unit_last_stride=True)
    lora_a = check_tensor("lora_a", lora_a, ndim=4, dtypes=_INPUT_DTYPES, unit_last_stride=True)
    num_adapters, slices, rank, hidden = lora_a.shape
    m = x.shape[0]
    if lora_a.dtype != x.dtype:
        raise ValueError(f"lora_a dtype {lora_a.dtype} must match x dtype {x.dtype}")
    if hidden != x.shape[1]:
        raise ValueError(f"lora_a hidden size {hidden} must match x.shape[1] = {x.shape[1]}")
    if not 1 <= slices <= MAX_SLICES:
        raise ValueError(f"lora_a must have 1 to {MAX_SLICES} slices, got {slices}")
    if m == 0:
        raise ValueError("x must have at least one row, got 0")
    workspace = workspace or default_workspace(x.device)
    if not 1 <= rank <= workspace.max_rank:
        raise ValueError(
            f"lora_a rank {rank} is outside [1, {workspace.max_rank}] (the workspace max_rank)"
        )
    if isinstance(groups, torch.Tensor):
        groups = group_tokens(groups, num_adapters)
    elif not isinstance(groups, AdapterGroups):
        raise ValueError(f"groups must be AdapterGroups or a token_adapter tensor, got {groups!r}")
    if groups.num_rows != m:
        raise ValueError(f"groups cover {groups.num_rows} rows but x has {m}")
    if groups.num_adapters > num_adapters:
        raise ValueError(
            f"groups index {groups.num_adapters} adapter slots but lora_a has {num_adapters}"
        )
    if defer and reduction not in DEFERRABLE:
        raise ValueError(
            f"defer=True needs a reduction whose partials the expand can sum "
            f"({', '.join(r.value for r in DEFERRABLE)}), got {reduction.value}"
        )
    scale_t = _scale_tensor(scale, num_adapters, x.device)

    n = slices * rank
    cfg = config or shrink_config(reduction, m, hidden, n)
    _check_config(cfg, reduction)
    plan = _plan(cfg, hidden)
    if defer:
        shape = (plan.splits, m, n)
        if out is None:
            out = torch.empty(shape, dtype=torch.float32, device=x.device)
        else:
            check_tensor("out", out, ndim=3, dtypes=(torch.float32,))
            check_shape("out", out, shape)
            if not out.is_contiguous():
                raise ValueError("out (the deferred partials) must be contiguous")
    elif out is None:
        out = torch.empty(slices, m, rank, dtype=torch.float32, device=x.device)
    else:
        check_tensor("out", out, ndim=3, dtypes=(torch.float32,))
        check_shape("out", out, (slices, m, rank))
    check_same_device(x=x, lora_a=lora_a, out=out, scale=scale_t,
                      token_adapter=groups.token_adapter)
    m_tiles = cdiv(m, cfg.block_m)
    n_tiles = cdiv(n, cfg.block_n)

    if defer:
        mode = _PARTIALS
    elif reduction is LoRAReduction.ATOMIC:
        mode = _ATOMIC
        out.zero_()
    elif reduction is LoRAReduction.TREE:
        mode = _TREE
    else:
        mode = _STORE if plan.splits == 1 else _ORDERED

    splits = plan.splits
    # Deferred partials go straight to ``out``; ordered and tree stage them in scratch.
    scratch = workspace.scratch(splits * m * n) if mode in (_ORDERED, _TREE) else out
    counters = (
        workspace.counters(groups.num_groups * m_tiles * n_tiles) if mode == _ORDERED else out
    )
    programs, group_cap = group_programs(groups.num_groups, cfg.group_cap)
    grid = (m_tiles * n_tiles * splits, programs)
    _shrink_kernel[grid](
        x, lora_a, out, scale_t,
        groups.sorted_rows, groups.group_start, groups.group_size, groups.group_adapter,
        scratch, counters, groups.num_groups,
        hidden, rank, n, plan.blocks_per_chunk, plan.blocks_per_group, plan.blocks_per_cta,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        m * n,
        MODE=mode,
        SPLIT=splits,
        TAIL_GROUP=plan.tail_group,
        TREE_IN_CTA=plan.tree_in_cta,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=hidden % cfg.block_k == 0,
        GROUP_CAP=group_cap,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if mode == _PARTIALS:
        return ShrinkPartials(out, slices, rank, plan.tail_group, scale_t)
    if mode == _TREE:
        split_p2 = next_power_of_2(splits)
        block_m = 16
        block_n = max(16, min(64, next_power_of_2(n)))
        # Keep the [split, BLOCK_M, BLOCK_N] register tile bounded.
        while split_p2 * block_m * block_n > 16384 and block_n > 16:
            block_n //= 2
        while split_p2 * block_m * block_n > 16384 and block_m > 1:
            block_m //= 2
        _tree_reduce_kernel[(cdiv(m, block_m), cdiv(n, block_n))](
            scratch, out, scale_t, groups.token_adapter,
            m, n, rank, splits,
            m * n, out.stride(0), out.stride(1), out.stride(2),
            SPLIT_P2=split_p2, LOG2_SPLIT=split_p2.bit_length() - 1,
            BLOCK_M=block_m, BLOCK_N=block_n,
        )
    return out


def _check_config(cfg: ShrinkConfig, reduction: LoRAReduction) -> None:
    if not isinstance(cfg, ShrinkConfig):
        raise ValueError(f"config must be a ShrinkConfig, got {type(cfg).__name__}")
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(cfg, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"config.{name} must be a power of two >= 16, got {v}")
    if cfg.split_k < 1:
        raise ValueError(f"config.split_k must be >= 1, got {cfg.split_k}")
    if cfg.group_chunks < 1:
        raise ValueError(f"config.group_chunks must be >= 1, got {cfg.group_chunks}")
    group_programs(1, cfg.group_cap)  # checks the cap
    if cfg.cta_covers not in CTA_COVERS:
        raise ValueError(f"config.cta_covers must be one of {CTA_COVERS}, got {cfg.cta_covers!r}")
    plain = cfg.group_chunks == 1 and cfg.cta_covers == "chunk"
    if reduction in (LoRAReduction.ATOMIC, LoRAReduction.TREE) and not plain:
        raise ValueError(
            f"{reduction.value} sums one chunk per CTA: config.group_chunks must be 1 and "
            f"config.cta_covers 'chunk', got {cfg.group_chunks} and {cfg.cta_covers!r}"
        )


def _scale_tensor(
    scale: torch.Tensor | float, num_adapters: int, device: torch.device
) -> torch.Tensor:
    if isinstance(scale, (int, float)):
        return torch.full((num_adapters,), float(scale), dtype=torch.float32, device=device)
    check_tensor("scale", scale, ndim=1, dtypes=(torch.float32,))
    check_shape("scale", scale, (num_adapters,))
    return scale.contiguous()


__all__ = ["MAX_LORA_RANK", "lora_shrink", "lora_shrink_ref", "partials_shape"]
