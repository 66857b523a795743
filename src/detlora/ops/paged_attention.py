"""Causal attention over a paged KV cache with grouped-query heads (prefill, chunked
prefill, cached prefix and decode in one op), and the KV write into pages.

Semantics:
    KV cache pages: k_cache, v_cache: [num_blocks, block_size, Hk, D].
    A batch of B sequences flattened into T query tokens: sequence b owns query rows
    query_start_loc[b]:query_start_loc[b+1] (q_len_b of them), which are its *last* q_len_b
    positions: context length seq_lens[b] counts cached tokens plus the new ones, whose K/V
    were already written with ``write_kv``. Token at position p of sequence b lives in page
    block_tables[b, p // block_size], slot p % block_size.

        write_kv(k, v, k_cache, v_cache, slot_mapping):   # slot = page * block_size + offset
            for t, slot in enumerate(slot_mapping):        # slot < 0: padding, skipped
                k_cache.view(-1, Hk, D)[slot] = k[t]; v_cache.view(-1, Hk, D)[slot] = v[t]

        paged_attention(q [T, Hq, D], k_cache, v_cache, block_tables [B, max_blocks],
                        seq_lens [B], query_start_loc [B + 1], scale, window=None)
                        -> out [T, Hq, D]:
            query j of sequence b sits at position p = seq_lens[b] - q_len_b + j and attends
            to positions 0..p (causal), or with a sliding ``window`` W to positions
            max(0, p - W + 1)..p (W keys, its own included: HF's ``kv_idx > q_idx - W``);
            head h reads KV head h // (Hq // Hk);
            out = softmax(scale * q . K^T) @ V, fp32 accumulation, cast to q.dtype.
        With a window, block-table entries of pages before the first query's window are
        never read (the engine releases those pages and leaves -1 there).
    D is a multiple of 16 in [16, 512]; the kernels hold a head in BLOCK_D = the next power of
    two lanes, the padding lanes loaded as zeros in q, K and V and never stored (96 runs as
    128 lanes, 32 of them zero), so they add exact zeros to every dot product.

    Batch invariance: a query row's bits depend only on its own KV, visited in blocks of a
    fixed size in position order (any split of the KV axis falls at fixed positions and is
    merged in order). So the same query gives the same bits in a prefill, in a chunk of a
    chunked prefill, after a cached prefix, or in a decode step. A window starts the visit
    at the key block (on the same absolute grid) holding the earliest window start of the
    launch's rows; the blocks a row visits before its own window are fully masked for it
    and leave its running (max, sum, acc) unchanged exactly, so where the visit starts never
    changes a row's bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv, next_power_of_2
from detlora.ops.checks import check_same_device, check_shape, check_tensor
from detlora.ops.pdl import pdl_kwargs, pdl_start
from detlora.ops.split_workspace import SplitWorkspace


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    slots = slot_mapping.long()
    keep = slots >= 0
    hk, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, hk, d)[slots[keep]] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, hk, d)[slots[keep]] = v[keep].to(v_cache.dtype)


def sequence_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq: int, ctx: int,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``seq``'s keys and values at positions [start, ctx) gathered from its pages,
    fp32 ``[ctx - start, Hk, D]`` each (shared by the torch references); pages before
    ``start``'s are not read."""
    block_size, hk, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    first = start // block_size
    pages = block_tables[seq, first: -(-ctx // block_size)].long()
    skip = start - first * block_size
    keys = k_cache[pages].reshape(-1, hk, d)[skip:ctx - first * block_size].float()
    vals = v_cache[pages].reshape(-1, hk, d)[skip:ctx - first * block_size].float()
    return keys, vals


def window_start(first_query: int, window: int | None) -> int:
    """The first key position a query at ``first_query`` may see (0 without a window)."""
    return 0 if window is None else max(0, first_query - window + 1)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,  # a grid hint of the kernels; no meaning here
    window: int | None = None,
) -> torch.Tensor:
    hq, hk = q.shape[1], k_cache.shape[2]
    group = hq // hk
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for b, ctx in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        q_len = hi - lo
        if q_len == 0:
            continue
        first = window_start(ctx - q_len, window)
        keys, vals = sequence_kv(k_cache, v_cache, block_tables, b, ctx, first)
        keys = keys.repeat_interleave(group, dim=1)  # [ctx - first, Hq, D]
        vals = vals.repeat_interleave(group, dim=1)
        qb = q[lo:hi].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qb, keys) * scale
        pos_q = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        pos_k = torch.arange(first, ctx, device=q.device)[None, :]
        hidden = pos_k > pos_q
        if window is not None:
            hidden |= pos_k <= pos_q - window
        scores = scores.masked_fill(hidden[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, vals).to(q.dtype)
    return out


# ----------------------------------------------------------------------------- design
#
# One Triton kernel serves every mode. A CTA owns one *query tile* of one sequence and one KV
# head: BLOCK_Q consecutive query positions times the GROUP query heads that share the KV head
# (row r = (query r // GROUP, head r % GROUP)), so a decode step packs its GROUP heads into the
# M dimension of the dots. The tile shape (BLOCK_M, warps) depends on head_dim and GROUP only,
# except that a call whose queries all fit a 16-row tile (decode steps) may run on that tile,
# which gives the same bits (``decode_tile_config``).
#
# What fixes a row's bits:
# * keys are visited in blocks of BLOCK_N = 64 positions aligned to absolute position 0, in
#   position order, with one online-softmax update per block (fp32, fixed order, exp2);
# * the KV axis is cut into segments of KV_SEGMENT positions (fixed). Each segment starts a fresh
#   (max, sum, acc) and segments are folded into a running total in segment order with the same
#   helper (``_merge``) whether they were computed in one CTA or in several (split-KV, reduced
#   by the last CTA to finish). The fold of a segment that holds no key of the row is exact;
# * keys the row may not see (future, or past the context) get score -inf, so p = 0 exactly,
#   and V rows past the context are loaded as zeros, so they add exact zeros to the MMA sum.
#   A row's result therefore does not depend on its tile-mates, on how many blocks the tile
#   walks past the row's position, or on the row's place in the tile.
# How many CTAs share a tile's segments (``kv_ctas``) is picked from the work size; it never
# changes bits.

BLOCK_N = 64  # keys per softmax update; fixed, part of the numerics
MAX_HEAD_DIM = 512  # Gemma 4's full-attention layers
# Head sizes are multiples of 16 (64, 80, 96, 128, 256, ...): the kernels pad a head to
# BLOCK_D = the next power of two lanes (``head_lanes_width``), and a multiple of 16 keeps the
# masked loads 16-byte vectors.
HEAD_DIM_MULTIPLE = 16
KV_SEGMENT = 512  # positions per KV segment; fixed, part of the numerics
_TARGET_CTAS = 264  # 132 SMs (H100/H200), two CTAs each. Sizes grids only, never decides bits.
# Split the KV axis only below this many (query tile, KV head) pairs: with more, one flattened
# loop per tile beats the split (see docs/decisions.md, "Attention split"). Never decides bits.
_SPLIT_BELOW = 192
_MAX_SCRATCH_FLOATS = 1 << 25  # 128 MB of split-KV partials at most, unless forced
_MERGE_ROWS = 16  # rows per step of the last CTA's fold (elementwise: any value is exact)
# Kernel arguments that change with the step's batch (paged attention and split-KV): ints
# whose ``== 1`` / ``% 16`` specialization would compile a variant per new value, and index
# pointers read a few words at a time, which graphs pass as views of their static buffers
# (not 16-byte aligned) and eager steps as fresh tensors (aligned).
STEP_INTS = ("num_seqs", "num_tokens", "max_blocks", "tiles_per_seq", "stride_bt")
INDEX_POINTERS = ("seq_lens_ptr", "query_start_loc_ptr")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
LOG2E = 1.4426950408889634


def head_lanes_width(head_dim: int) -> int:
    """BLOCK_D: the lanes the kernels hold a head in, the next power of two >= head_dim (96
    -> 128). A function of head_dim alone, so it is part of the numerics like the tile."""
    return next_power_of_2(head_dim)


@dataclass(frozen=True)
class TileConfig:
    """How a query tile is laid out; a function of (head_dim, group) alone."""

    block_m: int  # rows = BLOCK_Q query positions x GROUP heads (+ padding)
    num_warps: int
    num_stages: int

    def block_q(self, group: int) -> int:
        return self.block_m // group


def tile_config(head_dim: int, group: int) -> TileConfig:
    """The one tiling every call with this head_dim and GQA group uses (bits depend on it),
    sized by the padded head (``head_lanes_width``: 96 tiles as 128 does). head_dim 512
    (Gemma 4's full layers) takes the smallest tile that holds a query's GROUP heads, one
    stage deep, eight warps: a 64-key block of K and of V is 64 KB each there, so
    a taller tile would not fit an SM's shared memory, and with four warps the [16, 512]
    accumulator and query spill registers (12.7 KB of spill stores in the sm_90 build, 0.8 KB
    with eight; docs/decisions.md, "Head dim 512")."""
    head_dim = head_lanes_width(head_dim)
    if head_dim > 256:
        return TileConfig(block_m=max(16, next_power_of_2(group)), num_warps=8, num_stages=1)
    block_m = 64 if group <= 64 else 128
    big = head_dim * block_m > 64 * 128
    return TileConfig(block_m=block_m, num_warps=8 if big else 4, num_stages=2 if big else 3)


def decode_tile_config(head_dim: int, group: int) -> TileConfig | None:
    """A 16-row, 4-warp tile for calls whose queries all fit it (decode steps), or None.

    It gives the bits of ``tile_config``'s tile: the dots' sums over the head dimension and
    the keys come out of the MMA unit in the same order on either tile, and the one row
    reduction that follows the register layout, the softmax denominator, is a fixed tree
    (``row_sum_64``); tests/gpu/test_paged_attention_gpu.py checks it bit for bit on the GPU.
    A 64-row tile wastes 61 of its rows on a decode step of 3 heads per KV head (see
    docs/decisions.md, "Attention decode tile")."""
    if group > 16 or head_lanes_width(head_dim) > 128:
        return None
    return TileConfig(block_m=16, num_warps=4, num_stages=3)


def call_tile_config(head_dim: int, group: int, max_query_len: int | None,
                     dtype: torch.dtype) -> TileConfig:
    """The tile of one call: the decode tile when the host knows every query fits it, for the
    16-bit dtypes whose equality the GPU tests prove (fp32 is a test path here)."""
    small = decode_tile_config(head_dim, group) if dtype != torch.float32 else None
    if small is not None and max_query_len is not None \
            and max_query_len <= small.block_q(group):
        return small
    return tile_config(head_dim, group)


def numerics_config(head_dim: int, group: int) -> dict[str, int]:
    """Everything that decides a row's bits, for the engine's fingerprint."""
    cfg = tile_config(head_dim, group)
    return {"block_n": BLOCK_N, "kv_segment": KV_SEGMENT, "block_m": cfg.block_m,
            "num_warps": cfg.num_warps}


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    PAGE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)  # ops/pdl.py: before any read or store
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # Negative slots are padding; slots past the cache are skipped rather than written out of
    # bounds (the host cannot check them without a device sync).
    if slot < 0 or slot >= num_slots:
        return
    page = slot // PAGE
    off = slot % PAGE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (h < NUM_KV_HEADS) & (d < HEAD_DIM)  # constexpr: no mask when both are powers of 2
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=ok)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=ok)
    kc = k_cache_ptr + page * stride_kcb + off * stride_kcs + h * stride_kch + d
    vc = v_cache_ptr + page * stride_vcb + off * stride_vcs + h * stride_vch + d
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def find_tile(
    pid,
    query_start_loc_ptr,
    num_seqs,
    tiles_per_seq,
    BLOCK_Q: tl.constexpr,
    SEARCH: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """(sequence, query tile) of grid slot ``pid``.

    Direct: ``tiles_per_seq`` slots per sequence. Search: sequence b owns the slots from
    ``query_start_loc[b] // BLOCK_Q + b`` on, which leaves at least ceil(q_len / BLOCK_Q) slots
    for each sequence in ``num_tokens // BLOCK_Q + num_seqs`` slots in all (vLLM's numbering).
    """
    if SEARCH:
        count = tl.zeros((), dtype=tl.int32)
        for b0 in range(0, num_seqs, BLOCK_B):
            offs = b0 + tl.arange(0, BLOCK_B)
            ok = offs < num_seqs
            starts = tl.load(query_start_loc_ptr + offs, mask=ok, other=0).to(tl.int32)
            count += tl.sum(((starts // BLOCK_Q + offs <= pid) & ok).to(tl.int32), axis=0)
        seq = count - 1
        q_tile = pid - (tl.load(query_start_loc_ptr + seq).to(tl.int32) // BLOCK_Q + seq)
    else:
        seq = pid // tiles_per_seq
        q_tile = pid % tiles_per_seq
    return seq, q_tile


@triton.jit
def _block_pages(table_ptr, kpos, ctx, max_blocks, PAGE: tl.constexpr):
    """The page of each key position (0 past the context or the block table)."""
    page_idx = kpos // PAGE
    return tl.load(table_ptr + page_idx, mask=(kpos < ctx) & (page_idx < max_blocks), other=0)


@triton.jit
def _table_pages(table_ptr, kpos, max_blocks, PAGE: tl.constexpr):
    """The block-table entries of key positions ``kpos`` (0 past the table), whatever the
    context: it needs no load before it, so it can go out with the kernel's first loads. Past
    the context an entry is unchecked and must only feed loads masked by the context."""
    page_idx = kpos // PAGE
    return tl.load(table_ptr + page_idx, mask=page_idx < max_blocks, other=0)


@triton.jit
def head_lanes(ok, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The mask of a [R, BLOCK_D] tile of head rows: rows where ``ok`` [R], and of a padded
    head (BLOCK_D > HEAD_DIM) its HEAD_DIM real lanes only. A padding lane loads 0 in q, K
    and V alike, so it adds exact zeros to q . k and gives zero columns of P @ V, which are
    never stored: a row's bits are those of its real lanes, whatever BLOCK_D. [R, 1] when
    no lane pads, so a power-of-two head compiles as before."""
    mask = ok[:, None]
    if BLOCK_D != HEAD_DIM:
        mask = mask & (offs_d < HEAD_DIM)[None, :]
    return mask


@triton.jit
def attend_blocks(
    m,
    den,
    acc,
    q,
    k_head_ptr,  # k_cache + kv_head * stride_kh
    v_head_ptr,
    table_ptr,  # block_tables row of the sequence
    blk_lo,
    blk_hi,
    ctx,
    pos,  # [BLOCK_M] absolute position of each row's query
    max_blocks,
    num_pages,
    qk_scale,  # scale * log2(e)
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    window,  # keys per query, its own included (read only with HAS_WINDOW)
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # lanes of a head: next power of two >= HEAD_DIM
    DOT_PRECISION: tl.constexpr,
    PREFETCH_PAGES: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Online softmax over key blocks [blk_lo, blk_hi), in order, one update per block.

    PREFETCH_PAGES reads each block's pages one iteration ahead and carries them into the
    loop: a K/V load whose address comes from a load of the same iteration is pipelined one
    block deep only (Triton 3.6 then waits for every copy at each block). It deepens the
    pipeline (one more K/V buffer, so fewer CTAs fit on an SM) and never changes the
    arithmetic. Both kernels use it only when the KV axis is split over CTAs, i.e. when query
    tiles are few and each CTA's latency is what counts; without a split the extra buffer
    costs more than it hides (see docs/decisions.md, "Attention page prefetch").
    """
    offs_n = tl.arange(0, BLOCK_N)
    if PREFETCH_PAGES:
        first = _block_pages(table_ptr, blk_lo * BLOCK_N + offs_n, ctx, max_blocks, PAGE)
        return attend_prefetched(m, den, acc, q, k_head_ptr, v_head_ptr, table_ptr, first,
                                 blk_lo, blk_hi, ctx, pos, max_blocks, num_pages, qk_scale,
                                 stride_kb, stride_ks, stride_vb, stride_vs, window, PAGE,
                                 BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, HAS_WINDOW)
    for blk in range(blk_lo, blk_hi):
        kpos = blk * BLOCK_N + offs_n
        page = _block_pages(table_ptr, kpos, ctx, max_blocks, PAGE).to(tl.int64)
        m, den, acc = attend_block(m, den, acc, q, k_head_ptr, v_head_ptr, page, blk, ctx, pos,
                                   num_pages, qk_scale, stride_kb, stride_ks, stride_vb,
                                   stride_vs, window, PAGE, BLOCK_N, HEAD_DIM, BLOCK_D,
                                   DOT_PRECISION, HAS_WINDOW)
    return m, den, acc


@triton.jit
def attend_prefetched(m, den, acc, q, k_head_ptr, v_head_ptr, table_ptr, first_pages, blk_lo,
                      blk_hi, ctx, pos, max_blocks, num_pages, qk_scale, stride_kb, stride_ks,
                      stride_vb, stride_vs, window, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """attend_blocks with PREFETCH_PAGES, given block blk_lo's pages (``first_pages``: from
    ``_block_pages`` or ``_table_pages``; past the context they only feed masked loads)."""
    offs_n = tl.arange(0, BLOCK_N)
    next_page = first_pages
    for blk in range(blk_lo, blk_hi):
        kpos = blk * BLOCK_N + offs_n
        page = next_page.to(tl.int64)
        next_page = _block_pages(table_ptr, kpos + BLOCK_N, ctx, max_blocks, PAGE)
        m, den, acc = attend_block(m, den, acc, q, k_head_ptr, v_head_ptr, page, blk, ctx, pos,
                                   num_pages, qk_scale, stride_kb, stride_ks, stride_vb,
                                   stride_vs, window, PAGE, BLOCK_N, HEAD_DIM, BLOCK_D,
                                   DOT_PRECISION, HAS_WINDOW)
    return m, den, acc


ROW_SUM_BITS = (0, 3, 1, 2, 4, 5)  # the column-index bits row_sum_64 adds over, in order


def row_sum_64_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of ``row_sum_64``: x [M, 64] -> [M], adding columns c and c + 2^b for
    the bits b of ROW_SUM_BITS in turn (each level one exact add of two values)."""
    m = x.shape[0]
    cube = x.reshape(m, *([2] * 6))  # axis 1 + (5 - b) holds column bit b
    remaining = [5, 4, 3, 2, 1, 0]
    for b in ROW_SUM_BITS:
        axis = 1 + remaining.index(b)
        cube = cube.select(axis, 0) + cube.select(axis, 1)
        remaining.remove(b)
    return cube


@triton.jit
def _sum_pairs(x, M: tl.constexpr, OUTER: tl.constexpr, INNER: tl.constexpr):
    """[M, OUTER * 2 * INNER] -> [M, OUTER * INNER]: column o*2I + i plus column o*2I + I + i
    (one add of two values: exact whatever the layout)."""
    return tl.sum(tl.reshape(x, (M, OUTER, 2, INNER)), axis=2).reshape(M, OUTER * INNER)


@triton.jit
def row_sum_64(x):
    """Each row's sum of x [M, 64] as one fixed pairwise tree over the column index bits, in
    the order 0, 3, 1, 2, 4, 5. Every level adds exactly two values, so the bits do not depend
    on which threads or warps hold which columns (``tl.sum``'s tree does: it follows the
    register layout, and a 16-row tile with 4 warps splits the columns over warps where the
    64-row tile keeps them in one warp). That lets a decode step run on the smaller tile and
    give the prefill tile's bits. The bit order puts the adds a thread can do alone (bits 0
    and 3 of an MMA accumulator's columns) first."""
    M: tl.constexpr = x.shape[0]
    x = _sum_pairs(x, M, 32, 1)   # bit 0 -> columns are bits 5..1
    x = _sum_pairs(x, M, 4, 4)    # bit 3 -> bits 5, 4, 2, 1
    x = _sum_pairs(x, M, 8, 1)    # bit 1 -> bits 5, 4, 2
    x = _sum_pairs(x, M, 4, 1)    # bit 2 -> bits 5, 4
    x = _sum_pairs(x, M, 2, 1)    # bit 4 -> bit 5
    return tl.sum(x, axis=1)      # bit 5: two values


@triton.jit
def attend_block(m, den, acc, q, k_head_ptr, v_head_ptr, page, blk, ctx, pos, num_pages,
                 qk_scale, stride_kb, stride_ks, stride_vb, stride_vs, window,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 HAS_WINDOW: tl.constexpr):
    """One online-softmax update of (m, den, acc) with key block ``blk``, whose keys live in
    ``page`` ([BLOCK_N] int64, from ``_block_pages``); the other arguments as attend_blocks'.
    A page entry < 0 (released, before every row's window) reads zeros, and so do the padding
    lanes of a head (``head_lanes``)."""
    offs_d = tl.arange(0, BLOCK_D)
    kpos = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    # A page outside the cache (a caller's bug) reads zeros, never out of bounds.
    kv_ok = (kpos < ctx) & (page >= 0) & (page < num_pages)
    slot = kpos % PAGE
    kv_mask = head_lanes(kv_ok, offs_d, HEAD_DIM, BLOCK_D)
    k = tl.load(k_head_ptr + (page * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :],
                mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    # Causal: a row sees keys up to its own position (and so never past the context); with
    # a window, only the last ``window`` of them.
    visible = kpos[None, :] <= pos[:, None]
    if HAS_WINDOW:
        visible = visible & (kpos[None, :] > pos[:, None] - window)
    s = tl.where(visible, qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    # A block that holds no visible key leaves m unchanged: alpha is exactly 1, not exp2(0).
    alpha = tl.where(m == m_new, 1.0, tl.exp2(m - m_use))
    p = tl.exp2(s - m_use[:, None])
    den = tl.fma(den, alpha, row_sum_64(p))
    # Rows past the context are zeros, so p = 0 there multiplies finite values only.
    v = tl.load(v_head_ptr + (page * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :],
                mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return m_new, den, acc


@triton.jit
def _empty_segment(ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """(max, sum, acc) of rows that saw no key yet: -inf, 0, 0 (``_merge``'s exact no-op)."""
    return (tl.full((ROWS,), float("-inf"), dtype=tl.float32), tl.zeros((ROWS,), dtype=tl.float32),
            tl.zeros((ROWS, BLOCK_D), dtype=tl.float32))


@triton.jit
def _merge(big_m, big_den, big_a, m, den, acc):
    """Fold one segment's (max, sum, acc) into the running total; exact when the segment is
    empty (m = -inf, den = 0, acc = 0). Explicit fma: no contraction left to the compiler."""
    m_new = tl.maximum(big_m, m)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.where(big_m == m_new, 1.0, tl.exp2(big_m - m_use))
    b = tl.where(m == m_new, 1.0, tl.exp2(m - m_use))
    big_den = tl.fma(den, b, big_den * a)
    big_a = tl.fma(acc, b[:, None], big_a * a[:, None])
    return m_new, big_den, big_a


@triton.jit
def _finish(big_a, big_den):
    """Normalize; rows that saw no key (padding rows only) divide by 1, not 0."""
    return big_a / tl.where(big_den > 0, big_den, 1.0)[:, None]


@triton.jit
def _load_partial(acc_ptr, ml_ptr, seg, n_segs, row_base, offs_d, ok, part_stride,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Segment ``seg``'s partial for the rows at ``row_base`` (an empty one past n_segs)."""
    ok = ok & (seg < n_segs)
    idx = (tl.full((), 0, tl.int64) + seg) * part_stride + row_base
    m = tl.load(ml_ptr + 2 * idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
    den = tl.load(ml_ptr + 2 * idx + 1, mask=ok, other=0.0, cache_modifier=".cg")
    a = tl.load(acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :],
                mask=head_lanes(ok, offs_d, HEAD_DIM, BLOCK_D), other=0.0, cache_modifier=".cg")
    return m, den, a


@triton.jit
def _store_partial(acc_ptr, ml_ptr, seg, part_stride, part_row, m, den, acc, row_ok, offs_d,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Segment ``seg``'s (max, sum, acc) of the tile's live rows, for the split-KV fold."""
    idx = (tl.full((), 0, tl.int64) + seg) * part_stride + part_row
    tl.store(ml_ptr + 2 * idx, m, mask=row_ok)
    tl.store(ml_ptr + 2 * idx + 1, den, mask=row_ok)
    tl.store(acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc,
             mask=head_lanes(row_ok, offs_d, HEAD_DIM, BLOCK_D))


@triton.jit
def _load_partials(acc_ptr, ml_ptr, s0, n_segs, row_base, offs_d, ok, part_stride,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Segments s0..s0+7's partials, a tuple of eight (m, den, acc): their loads go out
    together, before any fold waits on them."""
    parts = ()
    for j in tl.static_range(8):  # tuple concatenation: Triton's frontend has no *unpacking
        parts = parts + (_load_partial(acc_ptr, ml_ptr, s0 + j, n_segs,  # noqa: RUF005
                                       row_base, offs_d, ok, part_stride, HEAD_DIM,
                                       BLOCK_D),)
    return parts


@triton.jit
def _fold_partials(tot_m, tot_den, tot_a, parts):
    """Fold the eight partials of ``_load_partials`` into the running total, in order."""
    for j in tl.static_range(8):
        tot_m, tot_den, tot_a = _merge(tot_m, tot_den, tot_a, parts[j][0], parts[j][1],
                                       parts[j][2])
    return tot_m, tot_den, tot_a


# The batch-dependent arguments (STEP_INTS, INDEX_POINTERS) are not specialized: each new
# ``x == 1``, ``x % 16`` or alignment would compile another variant (about a second, in the
# middle of serving) for loop bounds, masks and scalar loads that gain nothing from it.
@triton.jit(do_not_specialize=[*STEP_INTS, "seg_blocks", "window"],
            do_not_specialize_on_alignment=[*INDEX_POINTERS, "counter_ptr"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_acc_ptr,  # fp32 [segments, T, Hq, D] (split-KV only)
    part_ml_ptr,  # fp32 [segments, T, Hq, 2]: (max, sum)
    counter_ptr,  # int32 per (tile slot, kv head); zero between launches
    qk_scale,
    num_seqs,
    num_tokens,
    num_q_heads,
    max_blocks,
    num_pages,
    tiles_per_seq,
    seg_blocks,  # key blocks per KV segment
    window,  # keys per query with HAS_WINDOW (its own included)
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
    MERGE_ROWS: tl.constexpr,
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
    # The index loads and (split) the first block's pages go out together: none waits on
    # another, so a decode CTA pays one round trip before its first K/V load, not three.
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_end = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32)
    ctx = tl.load(seq_lens_ptr + seq).to(tl.int32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if SPLIT and not HAS_WINDOW:
        first_pages = _table_pages(table_ptr, tl.program_id(2) * seg_blocks * BLOCK_N
                                   + tl.arange(0, BLOCK_N), max_blocks, PAGE)
    q_len = q_end - q_start
    q_lo = q_tile * BLOCK_Q
    if q_lo >= q_len:
        return
    # Keys past the block table do not exist (a bad seq_len must not read out of bounds).
    kv_end = tl.minimum(ctx - q_len + tl.minimum(q_lo + BLOCK_Q, q_len), max_blocks * PAGE)
    n_blocks = tl.cdiv(kv_end, BLOCK_N)
    n_segs = tl.cdiv(n_blocks, seg_blocks)
    # The first key block and segment the tile visits: 0, or with a window the block (on
    # the absolute grid) of its first row's window start. Blocks and segments before it are
    # exact no-ops for every row of the tile, so skipping them changes no bits.
    blk_start = 0
    seg_lo = 0
    if HAS_WINDOW:
        blk_start = tl.maximum(ctx - q_len + q_lo - window + 1, 0) // BLOCK_N
        seg_lo = blk_start // seg_blocks
        if SPLIT:
            first_blk = tl.maximum((seg_lo + tl.program_id(2)) * seg_blocks, blk_start)
            first_pages = _table_pages(table_ptr, first_blk * BLOCK_N + tl.arange(0, BLOCK_N),
                                       max_blocks, PAGE)

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

    k_head_ptr = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head_ptr = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    part_row = tok * num_q_heads + head  # partial index within a segment
    part_stride = num_tokens * num_q_heads

    if SPLIT:
        # A CTA takes every num_programs(2)-th segment, each in its own block loop, and stores
        # each segment's partial for the fold below. (One flattened loop over a run of
        # consecutive segments, storing at each segment end, ran slower here.)
        seg_first = seg_lo + tl.program_id(2)
        seg_step = tl.num_programs(2)
        n_live = n_segs - seg_lo  # segments from the tile's first
        mine = tl.maximum(tl.cdiv(n_segs - seg_first, seg_step), 0)
        if n_live == 1:
            # One segment (a short context): its CTA holds the whole row and writes it as the
            # unsplit path does (the fold of one partial is _merge into an empty total plus
            # exact no-ops), without the round trip through scratch; the others have no work.
            mine = 0
            if seg_first == seg_lo:
                m, den, acc = _empty_segment(BLOCK_M, BLOCK_D)
                m, den, acc = attend_prefetched(m, den, acc, q, k_head_ptr, v_head_ptr,
                                                table_ptr, first_pages, blk_start,
                                                n_blocks, ctx, pos, max_blocks, num_pages,
                                                qk_scale, stride_kb, stride_ks, stride_vb,
                                                stride_vs, window, PAGE, BLOCK_N, HEAD_DIM,
                                                BLOCK_D, DOT_PRECISION, HAS_WINDOW)
                big_m, big_den, big_a = _empty_segment(BLOCK_M, BLOCK_D)
                big_m, big_den, big_a = _merge(big_m, big_den, big_a, m, den, acc)
                out_ptrs = out_ptr + (tok * stride_ot + head * stride_oh)[:, None] \
                    + offs_d[None, :]
                tl.store(out_ptrs, _finish(big_a, big_den).to(out_ptr.dtype.element_ty),
                         mask=row_lanes)
        for seg in range(seg_first, n_segs, seg_step):
            if n_live > 1:
                m, den, acc = _empty_segment(BLOCK_M, BLOCK_D)
                blk_lo = tl.maximum(seg * seg_blocks, blk_start)
                blk_hi = tl.minimum((seg + 1) * seg_blocks, n_blocks)
                m, den, acc = attend_prefetched(m, den, acc, q, k_head_ptr, v_head_ptr,
                                                table_ptr, first_pages, blk_lo, blk_hi, ctx,
                                                pos, max_blocks, num_pages, qk_scale,
                                                stride_kb, stride_ks, stride_vb, stride_vs,
                                                window, PAGE, BLOCK_N, HEAD_DIM, BLOCK_D,
                                                DOT_PRECISION, HAS_WINDOW)
                _store_partial(part_acc_ptr, part_ml_ptr, seg, part_stride, part_row, m, den,
                               acc, row_ok, offs_d, HEAD_DIM, BLOCK_D)
                # the next segment of this CTA starts seg_step segments on
                first_pages = _block_pages(table_ptr, (seg + seg_step) * seg_blocks
                                           * BLOCK_N + tl.arange(0, BLOCK_N), ctx, max_blocks,
                                           PAGE)
    else:
        # One pipelined loop over all key blocks: at each segment end the segment's
        # (m, den, acc) joins the running total and restarts, so the K/V pipeline never drains
        # between segments (the arithmetic of a block loop per segment, and faster).
        big_m, big_den, big_a = _empty_segment(BLOCK_M, BLOCK_D)
        m, den, acc = _empty_segment(BLOCK_M, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        for blk in range(blk_start, n_blocks):
            page = _block_pages(table_ptr, blk * BLOCK_N + offs_n, ctx, max_blocks,
                                PAGE).to(tl.int64)
            m, den, acc = attend_block(m, den, acc, q, k_head_ptr, v_head_ptr, page, blk, ctx,
                                       pos, num_pages, qk_scale, stride_kb, stride_ks,
                                       stride_vb, stride_vs, window, PAGE, BLOCK_N, HEAD_DIM,
                                       BLOCK_D, DOT_PRECISION, HAS_WINDOW)
            if ((blk + 1) % seg_blocks == 0) | (blk + 1 == n_blocks):
                big_m, big_den, big_a = _merge(big_m, big_den, big_a, m, den, acc)
                m, den, acc = _empty_segment(BLOCK_M, BLOCK_D)

    if not SPLIT:
        out_ptrs = out_ptr + (tok * stride_ot + head * stride_oh)[:, None] + offs_d[None, :]
        tl.store(out_ptrs, _finish(big_a, big_den).to(out_ptr.dtype.element_ty),
                 mask=row_lanes)
    else:
        if mine > 0:
            # Every partial of this CTA is written before the counter moves (CTA barrier, then
            # a release at GPU scope); the CTA that completes the count acquires and folds.
            tl.debug_barrier()
            tile_id = pid * tl.num_programs(1) + kv_head
            done = tl.atomic_add(counter_ptr + tile_id, mine, sem="acq_rel", scope="gpu")
            if done + mine == n_live:
                n_rows = tl.minimum(BLOCK_Q, q_len - q_lo) * GROUP
                for r0 in range(0, n_rows, MERGE_ROWS):
                    r = r0 + tl.arange(0, MERGE_ROWS)
                    ok = r < n_rows
                    t = (q_start + q_lo + r // GROUP).to(tl.int64)
                    ok = ok & (t >= 0) & (t < num_tokens)
                    t = tl.where(ok, t, 0)
                    h = kv_head * GROUP + r % GROUP
                    base = t * num_q_heads + h
                    tot_m, tot_den, tot_a = _empty_segment(MERGE_ROWS, BLOCK_D)
                    # Eight segments' loads in flight, then eight folds in order (a fold past
                    # n_segs is an exact no-op): the fold waits on L2 once per eight segments.
                    # (Sixteen in flight measured no faster.)
                    for s0 in range(seg_lo, n_segs, 8):
                        parts = _load_partials(part_acc_ptr, part_ml_ptr, s0, n_segs, base,
                                               offs_d, ok, part_stride, HEAD_DIM, BLOCK_D)
                        tot_m, tot_den, tot_a = _fold_partials(tot_m, tot_den, tot_a, parts)
                    out_ptrs = out_ptr + (t * stride_ot + h * stride_oh)[:, None] + offs_d[None, :]
                    tl.store(out_ptrs, _finish(tot_a, tot_den).to(out_ptr.dtype.element_ty),
                             mask=head_lanes(ok, offs_d, HEAD_DIM, BLOCK_D))
                tl.store(counter_ptr + tile_id, 0)  # self-reset: no init launch next call


# ----------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class AttentionProblem:
    """Shapes of one paged-attention call, validated."""

    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_seqs: int
    page_size: int
    max_blocks: int
    max_query_len: int | None  # None: unknown on the host

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def capacity(self) -> int:
        """Positions a block-table row can address."""
        return self.max_blocks * self.page_size


def check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
    max_query_len: int | None,
    window: int | None = None,
) -> AttentionProblem:
    """Validate a paged-attention call; every failure is a ValueError naming the argument.

    Always checked (no device sync): types, ranks, dtypes, shapes, head counts, devices.
    Checked only when the index tensors are on the CPU (a read there is free; on CUDA it would
    sync the stream and break graph capture): query_start_loc starts at 0, never decreases and
    ends at T; every q_len <= seq_len; every seq_len fits its block-table row; the used pages
    exist (with a window: the pages from the first query's window start on); max_query_len
    covers every q_len. On CUDA these are the caller's contract; the kernel
    never reads or writes out of bounds on a violation, but its results are then undefined.
    """
    q = check_tensor("q", q, ndim=3, dtypes=_DTYPES, unit_last_stride=True)
    k_cache = check_tensor("k_cache", k_cache, ndim=4, dtypes=_DTYPES, unit_last_stride=True)
    v_cache = check_tensor("v_cache", v_cache, ndim=4, dtypes=_DTYPES, unit_last_stride=True)
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        check_tensor(name, t, ndim=2 if name == "block_tables" else 1, dtypes=_INDEX_DTYPES,
                     unit_last_stride=True)
    num_tokens, hq, d = q.shape
    num_blocks, page, hk, dk = k_cache.shape
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"k_cache and v_cache dtypes ({k_cache.dtype}, {v_cache.dtype}) must "
                         f"match q dtype {q.dtype}")
    check_shape("v_cache", v_cache, k_cache.shape)
    if dk != d:
        raise ValueError(f"k_cache head_dim {dk} must match q head_dim {d}")
    if d < 16 or d > MAX_HEAD_DIM or d % HEAD_DIM_MULTIPLE:
        raise ValueError(f"q head_dim must be a multiple of {HEAD_DIM_MULTIPLE} in [16, "
                         f"{MAX_HEAD_DIM}], got {d}")
    if hk < 1 or hq % hk:
        raise ValueError(f"q has {hq} heads, not a multiple of k_cache's {hk} KV heads")
    if hq // hk > 128:
        raise ValueError(f"q heads per KV head must be <= 128, got {hq // hk}")
    num_seqs = seq_lens.shape[0]
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must have one row per sequence ({num_seqs}), "
                         f"got shape {tuple(block_tables.shape)}")
    if out is not None:
        check_tensor("out", out, ndim=3, dtypes=(q.dtype,), unit_last_stride=True)
        check_shape("out", out, q.shape)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    if max_query_len is not None and (isinstance(max_query_len, bool)
                                      or not isinstance(max_query_len, int) or max_query_len < 0):
        raise ValueError(f"max_query_len must be a non-negative int or None, got {max_query_len!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or not 1 <= window < 2**31):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
               "seq_lens": seq_lens, "query_start_loc": query_start_loc}
    if out is not None:
        tensors["out"] = out
    check_same_device(**tensors)
    if query_start_loc.device.type == "cpu":
        max_query_len = _check_contents(block_tables, seq_lens, query_start_loc, num_tokens,
                                        page, num_blocks, max_query_len, window)
    return AttentionProblem(num_tokens, hq, hk, d, num_seqs, page, block_tables.shape[1],
                            max_query_len)


def _check_contents(block_tables, seq_lens, query_start_loc, num_tokens, page, num_blocks,
                    max_query_len, window=None):
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    if int(qsl[0]) != 0 or bool((q_lens < 0).any()) or int(qsl[-1]) != num_tokens:
        raise ValueError(f"query_start_loc must start at 0, never decrease and end at "
                         f"q.shape[0] = {num_tokens}, got {qsl.tolist()}")
    lens = seq_lens.long()
    if bool((q_lens > lens).any()):
        raise ValueError("seq_lens must be >= each sequence's query length "
                         f"(seq_lens {lens.tolist()}, query lengths {q_lens.tolist()})")
    capacity = block_tables.shape[1] * page
    if bool((lens > capacity).any()):
        raise ValueError(f"block_tables too short: {block_tables.shape[1]} pages of {page} hold "
                         f"{capacity} positions, but seq_lens reach {int(lens.max())}")
    cols = torch.arange(block_tables.shape[1])[None, :]
    used = cols < -(-lens[:, None] // page)
    if window is not None:  # pages wholly before the first query's window are not read
        used &= cols >= ((lens - q_lens - window + 1).clamp(min=0) // page)[:, None]
    pages = block_tables.long()[used]
    if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_blocks):
        raise ValueError(f"block_tables must index pages in [0, {num_blocks}) for every used "
                         "position")
    actual = int(q_lens.max()) if q_lens.numel() else 0
    if max_query_len is not None and max_query_len < actual:
        raise ValueError(f"max_query_len {max_query_len} is below the longest query ({actual})")
    return actual if max_query_len is None else max_query_len


def tile_slots(problem: AttentionProblem, block_q: int) -> tuple[int, int, bool]:
    """(grid slots, tiles per sequence, search): direct slots when max_query_len is known and
    that is not more slots than the searched numbering needs."""
    searched = problem.num_tokens // block_q + problem.num_seqs
    if problem.max_query_len is not None:
        per_seq = max(1, cdiv(problem.max_query_len, block_q))
        if problem.num_seqs * per_seq <= searched:
            return problem.num_seqs * per_seq, per_seq, False
    return searched, 0, True


SEARCH_BLOCK_SMALL = 128  # up to this many sequences the search loads 128 at a time


def search_block(num_seqs: int) -> int:
    """Sequences per load of the slot search: two sizes, so batch sizes share compilations."""
    return SEARCH_BLOCK_SMALL if num_seqs <= SEARCH_BLOCK_SMALL else 1024


class _Counters:
    """Self-resetting int32 arrival counters for the split-KV fold: the counters of one
    ``SplitWorkspace`` per device (zeroed once at allocation, the last CTA of a tile puts its
    counter back to zero; an outgrown buffer stays alive for graphs captured before)."""

    def __init__(self) -> None:
        self._workspaces: dict[torch.device, SplitWorkspace] = {}

    def get(self, device: torch.device, numel: int) -> torch.Tensor | None:
        """At least ``numel`` zeros, or None when growing is impossible (graph capture)."""
        ws = self._workspaces.setdefault(device, SplitWorkspace(device))
        if ws.counter_capacity < numel and device.type == "cuda" \
                and torch.cuda.is_current_stream_capturing():
            return None
        return ws.counters(numel)

    def buffer(self, device: torch.device) -> torch.Tensor | None:
        """The whole buffer of ``device`` (None before first use), e.g. to check it is zero."""
        ws = self._workspaces.get(device)
        return None if ws is None or not ws.counter_capacity else ws.counters(
            ws.counter_capacity)

    def reserve(self, device: torch.device | str, numel: int) -> None:
        """Grow ahead of a CUDA-graph capture (otherwise a capture falls back to one CTA)."""
        self.get(_device_key(torch.device(device)), numel)

    @property
    def retired(self) -> list[torch.Tensor]:
        return [b for ws in self._workspaces.values() for b in ws.retired]


COUNTERS = _Counters()


def _device_key(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _merge_rows(block_m: int, group: int, max_query_len: int | None) -> int:
    """Rows per fold step: a tile's live rows when the host knows them (a decode step's GROUP
    heads), so the eight partials in flight hold no dead rows; never changes bits."""
    rows = min(_MERGE_ROWS, block_m)
    if max_query_len is not None:
        rows = min(rows, next_power_of_2(max(1, max_query_len) * group))
    return rows


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs (test path) must not silently drop to tf32 on the GPU.
    return "ieee" if dtype == torch.float32 else "tf32"


def check_write_kv_args(
    k: object, v: object, k_cache: object, v_cache: object, slot_mapping: object
) -> tuple[torch.Tensor, ...]:
    """Validated (k, v, k_cache, v_cache, slot_mapping) of a KV write (ValueError naming the
    problem). Slots past the cache are checked on the host only for CPU tensors."""
    k = check_tensor("k", k, ndim=3, dtypes=_DTYPES, unit_last_stride=True)
    v = check_tensor("v", v, ndim=3, dtypes=_DTYPES, unit_last_stride=True)
    k_cache = check_tensor("k_cache", k_cache, ndim=4, dtypes=_DTYPES, unit_last_stride=True)
    v_cache = check_tensor("v_cache", v_cache, ndim=4, dtypes=_DTYPES, unit_last_stride=True)
    slot_mapping = check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=_INDEX_DTYPES,
                                unit_last_stride=True)
    num_blocks, page, hk, d = k_cache.shape
    check_shape("v_cache", v_cache, k_cache.shape)
    check_shape("k", k, (k.shape[0], hk, d))
    check_shape("v", v, k.shape)
    check_shape("slot_mapping", slot_mapping, (k.shape[0],))
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    num_slots = num_blocks * page
    if slot_mapping.device.type == "cpu" and slot_mapping.numel() \
            and int(slot_mapping.max()) >= num_slots:
        raise ValueError(f"slot_mapping holds slot {int(slot_mapping.max())} but the cache "
                         f"has {num_slots} slots")
    return k, v, k_cache, v_cache, slot_mapping


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V row into its page slot (see the module docstring).

    ``slot_mapping`` entries < 0 are padding and skipped; entries past the cache are skipped too
    (checked on the host only for CPU tensors).
    """
    k, v, k_cache, v_cache, slot_mapping = check_write_kv_args(k, v, k_cache, v_cache,
                                                               slot_mapping)
    num_blocks, page, hk, d = k_cache.shape
    num_slots = num_blocks * page
    if k.shape[0] == 0:
        return
    _write_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, num_slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        PAGE=page, NUM_KV_HEADS=hk, HEAD_DIM=d, BLOCK_H=next_power_of_2(hk),
        BLOCK_D=next_power_of_2(d),
        num_warps=4, **pdl_kwargs(k),
    )


def default_kv_ctas(tiles: int, scratch_floats: int) -> int:
    """CTAs per query tile when the caller does not say: split the KV axis only when there
    are fewer than ``_SPLIT_BELOW`` (query tile, KV head) pairs and the partials fit, into
    enough CTAs to give the GPU about ``_TARGET_CTAS``, rounded down to a power of two so that
    they share a context's (power-of-two many) segments evenly (see docs/decisions.md,
    "Attention split"). Never decides bits."""
    if tiles < _SPLIT_BELOW and scratch_floats <= _MAX_SCRATCH_FLOATS:
        return 1 << (cdiv(_TARGET_CTAS, tiles).bit_length() - 1)
    return 1


def paged_attention(
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
    kv_split: int | None = None,
    kv_ctas: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Batch-invariant causal attention over the paged cache; see the module docstring.

    ``max_query_len`` (host int, optional) lets the grid give every sequence the same number of
    query tiles, which skips a search per CTA; it must be >= every q_len.
    ``kv_split``: positions per KV segment (a multiple of 64; default ``KV_SEGMENT``). It is part
    of the numerics: keep it fixed (tests pass small values to exercise the fold).
    ``kv_ctas``: CTAs sharing one query tile's segments (1 = unsplit). None picks it from the
    work size; it never changes the bits.
    ``window``: a sliding window of that many keys per query (its own included), or None.
    """
    problem = check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                   scale, out, max_query_len, window)
    segment = KV_SEGMENT if kv_split is None else kv_split
    if isinstance(segment, bool) or not isinstance(segment, int) or segment < BLOCK_N \
            or segment % BLOCK_N:
        raise ValueError(f"kv_split must be a positive multiple of {BLOCK_N}, got {kv_split!r}")
    if kv_ctas is not None and (isinstance(kv_ctas, bool) or not isinstance(kv_ctas, int)
                                or kv_ctas < 1):
        raise ValueError(f"kv_ctas must be a positive int or None, got {kv_ctas!r}")
    if out is None:
        out = torch.empty_like(q)
    if problem.num_tokens == 0 or problem.num_seqs == 0:
        return out

    cfg = call_tile_config(problem.head_dim, problem.group, problem.max_query_len, q.dtype)
    block_q = cfg.block_q(problem.group)
    slots, per_seq, search = tile_slots(problem, block_q)
    hk = problem.num_kv_heads
    max_segs = cdiv(problem.capacity, segment)
    scratch_floats = max_segs * problem.num_tokens * problem.num_q_heads * (problem.head_dim + 2)
    ctas = default_kv_ctas(slots * hk, scratch_floats) if kv_ctas is None else kv_ctas
    # A tile of a windowed call reads at most the segments its rows' windows touch.
    live_segs = max_segs if window is None else min(
        max_segs, cdiv(window + block_q - 1, segment) + 1)
    ctas = max(1, min(ctas, live_segs))
    counters = None
    if ctas > 1:
        counters = COUNTERS.get(_device_key(q.device), slots * hk)
        if counters is None:  # capturing a graph with too few counters: one CTA, same bits
            if kv_ctas is not None:
                raise ValueError("kv_ctas > 1 needs counters grown before graph capture "
                                 "(call COUNTERS.reserve or run once uncaptured)")
            ctas = 1
    if ctas > 1:
        part_acc = torch.empty(max_segs * problem.num_tokens * problem.num_q_heads
                               * problem.head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(max_segs * problem.num_tokens * problem.num_q_heads * 2,
                              dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
        counters = seq_lens  # unused: any valid pointer

    _paged_attention_kernel[(slots, hk, ctas)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        part_acc, part_ml, counters,
        float(scale) * LOG2E,
        problem.num_seqs, problem.num_tokens, problem.num_q_heads, problem.max_blocks,
        k_cache.shape[0], per_seq, segment // BLOCK_N, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        PAGE=problem.page_size, GROUP=problem.group, HEAD_DIM=problem.head_dim,
        BLOCK_D=head_lanes_width(problem.head_dim), BLOCK_M=cfg.block_m, BLOCK_Q=block_q,
        BLOCK_N=BLOCK_N,
        # Constexprs a path does not read are pinned, so they make no extra variants.
        SEARCH=search, BLOCK_B=search_block(problem.num_seqs) if search else 128,
        SPLIT=ctas > 1,
        MERGE_ROWS=_merge_rows(cfg.block_m, problem.group, problem.max_query_len)
        if ctas > 1 else _MERGE_ROWS,
        DOT_PRECISION=_dot_precision(q.dtype), HAS_WINDOW=window is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(q),
    )
    return out


__all__ = [
    "BLOCK_N",
    "COUNTERS",
    "HEAD_DIM_MULTIPLE",
    "INDEX_POINTERS",
    "KV_SEGMENT",
    "STEP_INTS",
    "call_tile_config",
    "check_write_kv_args",
    "decode_tile_config",
    "default_kv_ctas",
    "head_lanes",
    "head_lanes_width",
    "numerics_config",
    "paged_attention",
    "paged_attention_ref",
    "row_sum_64",
    "row_sum_64_ref",
    "tile_config",
    "write_kv",
    "write_kv_ref",
]
