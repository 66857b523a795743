"""Batch-invariant matmul and linear: the K order is fixed per (N, K), never chosen by M.

Semantics:
    a: [M, K], b: [K, N] (bf16/fp16/fp32, same dtype); bias: [N] or None.
        matmul(a, b)            = (a.float() @ b.float()).to(a.dtype)
        linear(x, weight, bias) = (x.float() @ weight.float().T + bias.float()).to(x.dtype)
        bmm(a, b)               = (a.float() @ b.float()).to(a.dtype)   # [B, M, K] @ [B, K, N]
    fp32 accumulation. A row's bits depend on (N, K) and the row's values alone, never on M
    (nor, for bmm, on B). ``out`` may also be fp32 for bf16/fp16 inputs: it then receives the
    fp32 sum (plus bias) unrounded. fp32 inputs are multiplied in full fp32
    (``input_precision="ieee"``, no TF32), like ``torch.mm`` with its default
    ``allow_tf32=False``.

Reduction order (docs/design.md, "Split-invariant reductions"): ``k_split(N, K, dtype)`` fixes
BLOCK_K and cuts the K axis into S chunks of ``chunk_blocks`` BLOCK_K blocks. Each chunk is
summed block by block from zero (one MMA chain), and the chunk sums are added to a total that
starts at zero, in chunk order: ``y = ((0 + p0) + p1) + ... + p(S-1)``, then ``+ bias``, then
one rounding to the output dtype. Two kernels build exactly that sum:
    split        (up to a few hundred rows) S CTAs per output tile, one chunk each; every
                 CTA stores its fp32 partial to scratch and bumps the tile's counter (acq_rel,
                 GPU scope); the CTA that arrives last adds the S partials in chunk order,
                 writes the tile with a plain store and resets the counter to zero (no init
                 launch, no zeroing). With S = 1: one CTA per tile, storing directly.
    persistent   (many rows) one CTA per SM walks output tiles in grouped (L2-friendly) order
                 and sums every chunk of a tile itself, in one pipelined loop, with no scratch.
BLOCK_M, BLOCK_N (or two parts side by side, ``block_n2``), the K width of a load
(``load_k``), warps, stages, TMA or pointer loads and the path only move work around: each
output element is the same sequence of 16-deep fp32 MMA accumulations, so the GPU tests prove
rows equal with ``torch.equal`` across all of them.
S = 1 keeps one accumulator, which lets the persistent kernel use 128x256 tiles; S > 1 needs a
second (the running total) and so at most 128x128 tiles. Decode does not need the split once N
gives it enough 16-column tiles that load 128-256 K elements at a time, so S > 1 is kept to
narrow outputs (``k_split``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from detlora.ops._runtime import cdiv
from detlora.ops.checks import check_same_device, check_shape, check_tensor
from detlora.ops.matmul_workspace import MatmulWorkspace, default_workspace
from detlora.ops.slot_columns import SlotColumns
from detlora.ops.tuned_configs import tuned_config

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# The split count decides bits, so it is sized for a fixed reference GPU (H100/H200: 132 SMs),
# never for the device at hand: a row then has the same bits on every GPU that runs the kernel
# the same way. The real SM count only sizes grids.
_REF_SMS = 132
_DECODE_BLOCK_N = 16  # output columns per decode CTA that the split count is sized for
_UNSPLIT_TILES = 64  # that many decode tiles fill the GPU without a split (N >= 1024)
_FP32_DECODE_BLOCK_N = 64
_FP32_SPLIT_BELOW_N = 4096
_MIN_CHUNK_BLOCKS = 4  # a chunk is at least this many BLOCK_K blocks (amortises the merge)
_MAX_CHUNKS = 16

_BIAS_NONE, _BIAS_ROW, _BIAS_FULL = 0, 1, 2


# ----------------------------------------------------------------------------- reference


def matmul_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() @ b.float()).to(a.dtype)


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    *, slot_columns: SlotColumns | None = None,
) -> torch.Tensor:
    del slot_columns  # every column is computed
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def bmm_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a.float(), b.float()).to(a.dtype)


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class KSplit:
    """How the K axis of every output element is summed: the part of a config that sets bits.

    ``num_chunks`` (S) counts the chunks that hold work; the last may be shorter.
    """

    block_k: int
    chunk_blocks: int
    num_chunks: int

    @classmethod
    def for_chunks(cls, k: int, block_k: int, chunks: int) -> KSplit:
        """Cut ``k`` into at most ``chunks`` chunks of whole BLOCK_K blocks."""
        k_blocks = cdiv(k, block_k)
        chunk_blocks = cdiv(k_blocks, max(1, min(chunks, k_blocks)))
        return cls(block_k, chunk_blocks, cdiv(k_blocks, chunk_blocks))

    def fits(self, k: int) -> bool:
        """True when this split was made for a K of ``k`` (same chunk count)."""
        return self.num_chunks == cdiv(cdiv(k, self.block_k), self.chunk_blocks)

    @classmethod
    def one_chain(cls, k: int, dtype: torch.dtype = torch.bfloat16) -> KSplit:
        """All of K in one chunk: one MMA chain from zero, BLOCK_K after BLOCK_K."""
        block_k = _block_k(dtype)
        return cls(block_k, cdiv(k, block_k), 1)

    @classmethod
    def equal_groups(cls, k: int, groups: int, dtype: torch.dtype = torch.bfloat16
                     ) -> KSplit | None:
        """K cut into ``groups`` chunks of K / groups each, when those are whole BLOCK_K
        blocks (None otherwise): the sum of the groups' one-chain partials in group order."""
        block_k = _block_k(dtype)
        if k % groups or (k // groups) % block_k:
            return None
        return cls(block_k, k // groups // block_k, groups)


def k_split(n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> KSplit:
    """The reduction order for an [N, K] weight: a function of (N, K, dtype) alone.

    bf16/fp16: no split (S = 1) once N gives decode at least ``_UNSPLIT_TILES`` tiles of 16
    columns: such tiles loading 128-256 K elements at a time already keep decode at cuBLAS's
    speed, while every S > 1 slows many rows (a second accumulator, 128x128 tiles at most;
    see docs/decisions.md, "Matmul split counts"). Narrower outputs split K
    until about two CTAs per SM. fp32 dots run on FMA units in 64-wide tiles and keep the
    split for every N below 4096.
    """
    block_k = _block_k(dtype)
    tile_n = _FP32_DECODE_BLOCK_N if dtype == torch.float32 else _DECODE_BLOCK_N
    tiles = cdiv(n, tile_n)
    chunks = 1
    if (n < _FP32_SPLIT_BELOW_N if dtype == torch.float32 else tiles < _UNSPLIT_TILES):
        want = cdiv(2 * _REF_SMS, tiles)
        chunks = max(1, min(want, cdiv(k, block_k) // _MIN_CHUNK_BLOCKS, _MAX_CHUNKS))
    return KSplit.for_chunks(k, block_k, chunks)


def _block_k(dtype: torch.dtype) -> int:
    return 32 if dtype == torch.float32 else 64


@dataclass(frozen=True)
class MatmulConfig:
    """How one call is tiled. Only ``k_split`` decides bits; the rest is speed.

    ``split_ctas``: the S chunks of a tile run in S CTAs reduced in order through scratch
    (few rows); otherwise one persistent CTA walks all chunks of its tiles (many rows).
    ``tma``: load through TMA descriptors when the operands allow it (pointer loads otherwise).
    ``flatten``: persistent path only, one pipelined loop over tiles and K blocks.
    ``load_k``: K elements per load and per ``tl.dot`` (0: ``k_split.block_k``); a multiple of
    ``k_split.block_k`` that divides K and each chunk. It changes no bits: a dot of any width
    runs the same 16-deep MMA steps in the same order (GPU-proven, test_matmul_gpu.py).
    ``block_n2``: split path with one chunk only; a tile is ``block_n + block_n2`` columns,
    summed by two dots side by side (0: one part). Tile widths that are not powers of two let
    a few hundred rows fill every SM with one tile each.
    ``chunks_in_cta``: split path with S > 1 only, one CTA per tile walks all S chunks, each a
    chain from zero added to a running total in chunk order: the fp32 operations of the
    cross-CTA sum without its scratch (for splits that exist for bits, not for parallelism).
    """

    k_split: KSplit
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    split_ctas: bool = True
    group_m: int = 8
    tma: bool = True
    flatten: bool = True
    programs_per_sm: int = 1
    load_k: int = 0
    block_n2: int = 0
    chunks_in_cta: bool = False

    @property
    def block_k(self) -> int:
        return self.load_k or self.k_split.block_k


# Tile shapes, measured (configs/matmul.json). Persistent: (BLOCK_M, BLOCK_N, warps,
# stages, CTAs per SM, relative speed of one SM on that tile). Two-part, one CTA per tile when
# S = 1 and one wave fills at least ``_TWO_PART_MIN_FILL`` of the SMs: (BLOCK_M, BLOCK_N,
# BLOCK_N2, warps, stages, relative speed). Grid, one CTA per tile for an unsplit K at a few
# hundred rows, largest first: (BLOCK_M, BLOCK_N, warps, stages, widest load).
_TILES = tuned_config("matmul")
_PERSISTENT_TILES = tuple(
    (t["block_m"], t["block_n"], t["num_warps"], t["num_stages"], t["ctas_per_sm"],
     t["relative_speed"]) for t in _TILES["persistent"])
_TWO_PART_TILES = tuple(
    (t["block_m"], t["block_n"], t["block_n2"], t["num_warps"], t["num_stages"],
     t["relative_speed"]) for t in _TILES["two_part"])
_TWO_PART_MIN_FILL = _TILES["two_part_min_fill"]
_GRID_TILES = tuple(
    (t["block_m"], t["block_n"], t["num_warps"], t["num_stages"], t["widest_load"])
    for t in _TILES["grid"])


def matmul_config(
    m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, batch: int = 1,
    num_sms: int = _REF_SMS, *, split_n: int | None = None, split: KSplit | None = None,
) -> MatmulConfig:
    """The tiling for an [M, K] @ [K, N] call (``batch`` of them for bmm).

    ``k_split`` comes from (N, K, dtype) only (``split_n`` in place of N: tiles sized for the
    columns a call is expected to compute, the bits of the full width), unless ``split``
    gives it (a column shard of a wider layer keeps the layer's split; a row-parallel layer
    sums fixed K groups); M, batch and ``num_sms`` pick tiles and path:

        bf16/fp16, M <= 64     split path, BLOCK_M 16/32/64, BLOCK_N 64 (32, then 16, while
                               that gives too few CTAs), 128-256-wide K loads, 4 warps
        bf16/fp16, M > 64,     while 128x256 tiles would fill less than half the GPU: one CTA
          S = 1                per tile (split path, one chunk), the largest of
                               ``_GRID_TILES`` that fills half the GPU (64x32 at least)
        bf16/fp16, M > 64      persistent path, the tile of ``_PERSISTENT_TILES`` with the
                               least estimated time (128x256 only when S = 1), its tile loop
                               flattened only when S = 1; the split path (64x128) when S > 1,
                               M <= 512 and 128x128 tiles fill less than a quarter of the GPU;
                               with S = 1, a two-part tile of ``_TWO_PART_TILES`` (one CTA
                               each) when it fills one wave and is estimated faster
        fp32                   32x64 (4 warps) up to M = 32, else 64x64 (8 warps); split path
                               up to M = 64, persistent above
    """
    own = k_split(n if split_n is None else split_n, k, dtype)
    ks = split or own
    multi = ks.num_chunks > 1
    # A given split of several chunks where the layer's own is one chain (a row-parallel
    # layer's K groups): the chunks exist for bits, not to fill the GPU, so one CTA per tile
    # walks them (``chunks_in_cta``) and the tiles are the one-chain tiles.
    in_cta = multi and own.num_chunks == 1
    if dtype == torch.float32:
        # Full-fp32 dots run on FMA units: small tiles, and the same for every M.
        # (8 warps at 64x64: with 4, the FMA operands of TMA-loaded tiles spill on sm_90.)
        small = m <= 32
        return MatmulConfig(ks, 32 if small else 64, 64, num_warps=4 if small else 8,
                            num_stages=3, split_ctas=m <= 64)
    if m <= 64:
        # Decode: narrow tiles until they fill about half the GPU, loading wide K blocks so
        # that few CTAs still keep enough bytes in flight (4 stages of 256-wide loads in 16-32
        # column tiles, 6 of 128-wide loads in 64 column tiles; docs/decisions.md).
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        bn = 64
        ctas_per_tile = 1 if in_cta else ks.num_chunks
        while bn > 16 and batch * cdiv(m, bm) * cdiv(n, bn) * ctas_per_tile < num_sms // 2:
            bn //= 2
        load_k = _widest_load(ks, k, 128 if bn == 64 else 256)
        stages = 4 if ctas_per_tile > 1 or load_k >= 256 else 6
        return MatmulConfig(ks, bm, bn, num_warps=4, num_stages=stages, split_ctas=True,
                            load_k=load_k, chunks_in_cta=in_cta)
    half = num_sms // 2
    if (not multi or in_cta) and batch * cdiv(m, 128) * cdiv(n, 256) < half:
        # One chain per tile, a few hundred rows: big tiles would leave most SMs idle, and
        # every tiling has the same bits, so take the largest tile that still fills half the
        # GPU, one CTA each (faster than the persistent tiles there).
        tile = next((t for t in _GRID_TILES if batch * cdiv(m, t[0]) * cdiv(n, t[1]) >= half),
                    _GRID_TILES[-1])
        bm, bn, warps, stages, load_k = tile
        return MatmulConfig(ks, bm, bn, num_warps=warps, num_stages=stages, split_ctas=True,
                            load_k=_widest_load(ks, k, load_k), chunks_in_cta=in_cta)
    # Many rows: persistent CTAs over the tile shape with the least estimated time (waves of
    # tiles times the tile's cost). S > 1 keeps a running total beside the accumulator, which
    # leaves registers for 128x128 at most.
    best, best_cost = None, 0.0
    for bm, bn, warps, stages, per_sm, speed in _PERSISTENT_TILES:
        if multi and bm * bn > 128 * 128:
            continue
        tiles = batch * cdiv(m, bm) * cdiv(n, bn)
        slots = num_sms * per_sm
        sharing = min(per_sm, cdiv(min(tiles, slots), num_sms))  # CTAs on one SM at a time
        cost = cdiv(tiles, slots) * sharing * bm * bn / speed
        if best is None or cost < best_cost:
            best, best_cost = (bm, bn, warps, stages, per_sm), cost
    if not multi and batch == 1 and best[4] == 1:
        # Not against 64x128 at two CTAs per SM: where that was the pick, it beat the
        # two-part tile.
        for bm, bn, bn2, warps, stages, speed in _TWO_PART_TILES:
            tiles = cdiv(m, bm) * cdiv(n, bn + bn2)
            cost = bm * (bn + bn2) / speed
            if _TWO_PART_MIN_FILL * num_sms <= tiles <= num_sms and cost < best_cost:
                return MatmulConfig(ks, bm, bn, num_warps=warps, num_stages=stages,
                                    split_ctas=True, block_n2=bn2)
    bm, bn, warps, stages, per_sm = best
    if multi and m <= 512 and batch * cdiv(m, 128) * cdiv(n, 128) < num_sms // 4:
        # Too few tiles to fill a quarter of the GPU: spread each tile's chunks over CTAs
        # instead (their partials cost M x N x S x 8 bytes of scratch traffic, so only for few
        # rows). At M = 256, 16 tiles (qwen down) favoured the split, 48 tiles (llama o,
        # down) the persistent kernel.
        return MatmulConfig(ks, 64, 128, num_warps=4, num_stages=4, split_ctas=True)
    # S > 1 runs the nested loops: a flattened loop that also carries the chunk boundaries
    # ran slower; with S = 1 the flattened loop is as fast or faster.
    return MatmulConfig(ks, bm, bn, num_warps=warps, num_stages=stages, split_ctas=False,
                        flatten=not multi, programs_per_sm=per_sm)


def _widest_load(ks: KSplit, k: int, most: int) -> int:
    """The widest load (at most ``most`` K elements) that divides K and every chunk."""
    load_k = most
    while load_k > ks.block_k and not _load_fits(ks, k, load_k):
        load_k //= 2
    return max(load_k, ks.block_k)


def _load_fits(ks: KSplit, k: int, load_k: int) -> bool:
    # Whole loads only: a load past K would add MMA steps of zero products the narrow loads
    # never run, so wide loads need K and each chunk to be multiples of them.
    return k % load_k == 0 and (ks.num_chunks == 1
                                or (ks.chunk_blocks * ks.block_k) % load_k == 0)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _grouped_tile(t, m_tiles, n_tiles, GROUP_M: tl.constexpr):
    """Tile t -> (pid_m, pid_n), GROUP_M row tiles at a time so B tiles are reused from L2."""
    width = GROUP_M * n_tiles
    first_m = (t // width) * GROUP_M
    rows = tl.minimum(m_tiles - first_m, GROUP_M)
    pid_m = first_m + (t % width) % rows
    pid_n = (t % width) // rows
    return pid_m, pid_n


@triton.jit
def _operand_pointers(a, b, batch, off_m, off_n, M, N, stride_ab, stride_am, stride_bb,
                      stride_bn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      TMA: tl.constexpr):
    """Row pointers of A and column pointers of B for the pointer path (unused with TMA).

    Rows and columns past the edge wrap onto real ones, so loads need no M/N mask; their
    results are never stored.
    """
    if TMA:
        a_rows = 0
        b_cols = 0
    else:
        rows = ((off_m + tl.arange(0, BLOCK_M)) % M).to(tl.int64)
        cols = ((off_n + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
        a_rows = a + batch.to(tl.int64) * stride_ab + rows * stride_am
        b_cols = b + batch.to(tl.int64) * stride_bb + cols * stride_bn
    return a_rows, b_cols


@triton.jit
def _a_block(a, a_rows, off_m, kb, K, stride_ak, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
             EVEN_K: tl.constexpr):
    """A [BLOCK_M, BLOCK_K] for K block ``kb`` (zeros past K)."""
    k0 = kb * BLOCK_K
    if TMA:
        a_blk = a.load([off_m, k0])
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a_blk = tl.load(a_rows[:, None] + offs_k[None, :] * stride_ak)
        else:
            a_blk = tl.load(a_rows[:, None] + offs_k[None, :] * stride_ak,
                            mask=(offs_k < K)[None, :], other=0.0)
    return a_blk


@triton.jit
def _b_block(b, b_cols, off_n, kb, K, stride_bk, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
             B_KMAJOR: tl.constexpr, EVEN_K: tl.constexpr):
    """B [BLOCK_K, BLOCK_N] for K block ``kb`` (zeros past K)."""
    k0 = kb * BLOCK_K
    if TMA:
        if B_KMAJOR:  # noqa: SIM108 (constexpr branches, kept as statements for Triton)
            b_blk = b.load([off_n, k0]).T
        else:
            b_blk = b.load([k0, off_n])
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            b_blk = tl.load(b_cols[None, :] + offs_k[:, None] * stride_bk)
        else:
            b_blk = tl.load(b_cols[None, :] + offs_k[:, None] * stride_bk,
                            mask=(offs_k < K)[:, None], other=0.0)
    return b_blk


@triton.jit
def _k_block(a, b, a_rows, b_cols, off_m, off_n, kb, K, stride_ak, stride_bk,
             BLOCK_K: tl.constexpr, TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
             EVEN_K: tl.constexpr):
    """A [BLOCK_M, BLOCK_K] and B [BLOCK_K, BLOCK_N] for K block ``kb`` (zeros past K)."""
    a_blk = _a_block(a, a_rows, off_m, kb, K, stride_ak, BLOCK_K, TMA, EVEN_K)
    b_blk = _b_block(b, b_cols, off_n, kb, K, stride_bk, BLOCK_K, TMA, B_KMAJOR, EVEN_K)
    return a_blk, b_blk


@triton.jit
def _store_tile(c_ptr, bias_ptr, y, batch, off_m, off_n, M, N, stride_cb, stride_cm, stride_cn,
                stride_biasm, stride_biasn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BIAS: tl.constexpr):
    """Add the bias to the fp32 tile, round once to the output dtype, store the valid part."""
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    ok = m_ok[:, None] & n_ok[None, :]
    if BIAS == 1:  # one row [N], broadcast over M
        y = y + tl.load(bias_ptr + offs_n * stride_biasn, mask=n_ok, other=0.0).to(
            tl.float32)[None, :]
    elif BIAS == 2:  # a full [M, N] operand
        y = y + tl.load(bias_ptr + offs_m[:, None].to(tl.int64) * stride_biasm
                        + offs_n[None, :] * stride_biasn, mask=ok, other=0.0).to(tl.float32)
    c = (c_ptr + batch.to(tl.int64) * stride_cb + offs_m[:, None].to(tl.int64) * stride_cm
         + offs_n[None, :] * stride_cn)
    tl.store(c, y.to(c_ptr.dtype.element_ty), mask=ok)


# Row, chunk and program counts change from call to call: not specializing on them (== 1,
# divisible by 16) keeps one compiled kernel per tiling instead of several.
@triton.jit
def _slot_tile_unused(off_n, slot_first, slot_width, group_adapter_ptr, group_size_ptr,
                      num_groups, TILE_N: tl.constexpr, GROUPS_P2: tl.constexpr):
    """True when columns [off_n, off_n + TILE_N) are all slot columns and no group with rows
    has one of their slots (see ``SlotColumns``)."""
    first = (off_n - slot_first) // slot_width
    last = (off_n + TILE_N - 1 - slot_first) // slot_width
    g = tl.arange(0, GROUPS_P2)
    valid = g < num_groups
    adapter = tl.load(group_adapter_ptr + g, mask=valid, other=-1)
    rows = tl.load(group_size_ptr + g, mask=valid, other=0)
    hit = (rows > 0) & (adapter >= first) & (adapter <= last)
    return (off_n >= slot_first) & (tl.sum(hit.to(tl.int32), axis=0) == 0)


@triton.jit(do_not_specialize=["M", "num_chunks", "chunk_blocks", "slot_first", "slot_width",
                               "num_groups"],
            do_not_specialize_on_alignment=["group_adapter_ptr", "group_size_ptr"])
def _mm_split_kernel(
    a, b, b2, c_ptr, bias_ptr, scratch_ptr, counter_ptr, group_adapter_ptr, group_size_ptr,
    M, N, K, num_chunks, chunk_blocks, slot_first, slot_width, num_groups,
    stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn, stride_biasm, stride_biasn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N2: tl.constexpr,
    BLOCK_K: tl.constexpr, MULTI_CHUNK: tl.constexpr, TMA: tl.constexpr,
    B_KMAJOR: tl.constexpr, EVEN_K: tl.constexpr, BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, SLOT_SKIP: tl.constexpr, GROUPS_P2: tl.constexpr,
    CHUNKS_IN_CTA: tl.constexpr,
):
    # Grid: batch x M tiles x N tiles x chunks, chunk fastest, so the CTAs of one tile are
    # scheduled together and the last one finds its partners' partials in L2. CHUNKS_IN_CTA:
    # batch x M tiles x N tiles, each CTA walking its tile's chunks with a running total.
    # A tile is BLOCK_N + BLOCK_N2 columns wide (BLOCK_N2 = 0: one part; one chunk only): a
    # second accumulator over the next BLOCK_N2 columns (``b2``: b, or its TMA descriptor for
    # [BLOCK_N2, BLOCK_K] boxes), so that widths that are not powers of two (192 = 128 + 64)
    # can spread a few hundred rows over every SM.
    pid = tl.program_id(0)
    chunk = 0
    tile = pid
    if MULTI_CHUNK:  # noqa: SIM102 (constexpr tests)
        if not CHUNKS_IN_CTA:
            chunk = pid % num_chunks
            tile = pid // num_chunks
    m_tiles = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N + BLOCK_N2)
    batch = tile // (m_tiles * n_tiles)
    t = tile % (m_tiles * n_tiles)
    off_m = (t // n_tiles) * BLOCK_M
    off_n = (t % n_tiles) * (BLOCK_N + BLOCK_N2)
    if SLOT_SKIP:  # noqa: SIM102 (a constexpr test apart from the runtime ones)
        # Every CTA of the tile (each chunk) decides alike: an unused tile touches nothing,
        # not even its counter. A tile of base columns never skips, so only slot tiles read
        # the step's groups (their loads would hold every base CTA's first loads back).
        if off_n >= slot_first:  # noqa: SIM102 (nested: the loads only for slot tiles)
            if _slot_tile_unused(off_n, slot_first, slot_width, group_adapter_ptr,
                                 group_size_ptr, num_groups, BLOCK_N + BLOCK_N2, GROUPS_P2):
                return
    a_rows, b_cols = _operand_pointers(a, b, batch, off_m, off_n, M, N, stride_ab, stride_am,
                                       stride_bb, stride_bn, BLOCK_M, BLOCK_N, TMA)
    if BLOCK_N2 > 0:
        _, b_cols2 = _operand_pointers(a, b, batch, off_m, off_n + BLOCK_N, M, N, stride_ab,
                                       stride_am, stride_bb, stride_bn, BLOCK_M, BLOCK_N2, TMA)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N2), dtype=tl.float32)

    k_loads = tl.cdiv(K, BLOCK_K)
    if CHUNKS_IN_CTA:
        lo = 0
        hi = k_loads
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        lo = chunk * chunk_blocks
        hi = tl.minimum(lo + chunk_blocks, k_loads)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(lo, hi):
        a_blk, b_blk = _k_block(a, b, a_rows, b_cols, off_m, off_n, kb, K, stride_ak, stride_bk,
                                BLOCK_K, TMA, B_KMAJOR, EVEN_K)
        acc = tl.dot(a_blk, b_blk, acc, input_precision=INPUT_PRECISION)
        if BLOCK_N2 > 0:
            b2_blk = _b_block(b2, b_cols2, off_n + BLOCK_N, kb, K, stride_bk, BLOCK_K, TMA,
                              B_KMAJOR, EVEN_K)
            acc2 = tl.dot(a_blk, b2_blk, acc2, input_precision=INPUT_PRECISION)
        if CHUNKS_IN_CTA:  # noqa: SIM102 (a constexpr test apart from the runtime one)
            # A chunk's chain ends: it joins the running total, the next starts from zero.
            if ((kb + 1) % chunk_blocks == 0) | (kb == hi - 1):
                total += acc
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    if CHUNKS_IN_CTA:
        _store_tile(c_ptr, bias_ptr, total, batch, off_m, off_n, M, N, stride_cb, stride_cm,
                    stride_cn, stride_biasm, stride_biasn, BLOCK_M, BLOCK_N, BIAS)
    elif MULTI_CHUNK:
        # Scratch holds [tile, chunk, BLOCK_M, BLOCK_N] partials, tile-local and contiguous.
        local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        parts = scratch_ptr + tile.to(tl.int64) * (num_chunks * BLOCK_M * BLOCK_N) + local
        tl.store(parts + chunk * (BLOCK_M * BLOCK_N), acc)
        # Every thread's partial is written before the counter moves (CTA barrier, then a
        # release at GPU scope); the last CTA acquires and reads them from L2.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == num_chunks - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, num_chunks):
                total += tl.load(parts + s * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
            _store_tile(c_ptr, bias_ptr, total, batch, off_m, off_n, M, N, stride_cb, stride_cm,
                        stride_cn, stride_biasm, stride_biasn, BLOCK_M, BLOCK_N, BIAS)
            tl.store(counter_ptr + tile, 0)  # self-reset: no init launch next call
    else:
        _store_tile(c_ptr, bias_ptr, acc, batch, off_m, off_n, M, N, stride_cb, stride_cm,
                    stride_cn, stride_biasm, stride_biasn, BLOCK_M, BLOCK_N, BIAS)
        if BLOCK_N2 > 0:
            _store_tile(c_ptr, bias_ptr, acc2, batch, off_m, off_n + BLOCK_N, M, N, stride_cb,
                        stride_cm, stride_cn, stride_biasm, stride_biasn, BLOCK_M, BLOCK_N2,
                        BIAS)


@triton.jit(do_not_specialize=["M", "chunk_blocks", "num_programs"])
def _mm_persistent_kernel(
    a, b, c_ptr, bias_ptr,
    M, N, K, batch_count, chunk_blocks, num_programs,
    stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn, stride_biasm, stride_biasn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, MULTI_CHUNK: tl.constexpr, TMA: tl.constexpr,
    B_KMAJOR: tl.constexpr, EVEN_K: tl.constexpr, BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, FLATTEN: tl.constexpr,
):
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    k_blocks = tl.cdiv(K, BLOCK_K)
    tiles_per_batch = m_tiles * n_tiles
    for tile in tl.range(pid, batch_count * tiles_per_batch, num_programs, flatten=FLATTEN):
        batch = tile // tiles_per_batch
        pid_m, pid_n = _grouped_tile(tile % tiles_per_batch, m_tiles, n_tiles, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        a_rows, b_cols = _operand_pointers(a, b, batch, off_m, off_n, M, N, stride_ab,
                                           stride_am, stride_bb, stride_bn, BLOCK_M, BLOCK_N,
                                           TMA)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if MULTI_CHUNK:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # One loop over all K blocks (so the pipeline never drains between chunks); at each
        # chunk's end its sum joins the running total and the accumulator restarts at zero.
        for kb in range(0, k_blocks):
            a_blk, b_blk = _k_block(a, b, a_rows, b_cols, off_m, off_n, kb, K, stride_ak,
                                    stride_bk, BLOCK_K, TMA, B_KMAJOR, EVEN_K)
            acc = tl.dot(a_blk, b_blk, acc, input_precision=INPUT_PRECISION)
            if MULTI_CHUNK:  # noqa: SIM102 (a constexpr test apart from the runtime one)
                if ((kb + 1) % chunk_blocks == 0) | (kb == k_blocks - 1):
                    total += acc
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if MULTI_CHUNK:
            _store_tile(c_ptr, bias_ptr, total, batch, off_m, off_n, M, N, stride_cb, stride_cm,
                        stride_cn, stride_biasm, stride_biasn, BLOCK_M, BLOCK_N, BIAS)
        else:
            _store_tile(c_ptr, bias_ptr, acc, batch, off_m, off_n, M, N, stride_cb, stride_cm,
                        stride_cn, stride_biasm, stride_biasn, BLOCK_M, BLOCK_N, BIAS)


# ----------------------------------------------------------------------------- wrappers


def matmul(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, *,
    config: MatmulConfig | None = None, workspace: MatmulWorkspace | None = None,
) -> torch.Tensor:
    """``a @ b`` for a [M, K] and b [K, N]; see the module docstring.

    ``out`` ([M, N], a's dtype or fp32, any strides) is written in full. ``config`` overrides the
    tiling; its ``k_split`` then decides the bits, so pass one only to compare tilings.
    """
    a = check_tensor("a", a, ndim=2, dtypes=_DTYPES)
    b = check_tensor("b", b, ndim=2, dtypes=_DTYPES)
    _check_pair("a", a, "b", b, b.shape[0])
    out = _out_or_new(out, (a.shape[0], b.shape[1]), a)
    check_same_device(a=a, b=b, out=out)
    _launch(a.unsqueeze(0), b.unsqueeze(0), out.unsqueeze(0), None, config, workspace)
    return out


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None, *, config: MatmulConfig | None = None,
    workspace: MatmulWorkspace | None = None, slot_columns: SlotColumns | None = None,
    split: KSplit | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for x [M, K], weight [N, K] (as nn.Linear stores it), bias [N].

    Bit-identical to ``matmul(x, weight.T)`` plus the bias in fp32 before the one rounding.
    ``slot_columns``: columns of adapter slots no row uses may be left unwritten (split path;
    see ``SlotColumns``). ``split`` replaces ``k_split(N, K)`` (and the slot columns' split)
    as the reduction order (``config`` wins over it).
    """
    x = check_tensor("x", x, ndim=2, dtypes=_DTYPES)
    weight = check_tensor("weight", weight, ndim=2, dtypes=_DTYPES)
    _check_pair("x", x, "weight", weight, weight.shape[1])
    n = weight.shape[0]
    if bias is not None:
        bias = check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,))
        check_shape("bias", bias, (n,))
    out = _out_or_new(out, (x.shape[0], n), x)
    tensors = {"x": x, "weight": weight, "out": out} | ({"bias": bias} if bias is not None
                                                        else {})
    check_same_device(**tensors)
    if slot_columns is not None:
        _check_slot_columns(slot_columns, n, x)
    _launch(x.unsqueeze(0), weight.t().unsqueeze(0), out.unsqueeze(0), bias, config, workspace,
            slot_columns, split=split)
    return out


def bmm(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, *,
    config: MatmulConfig | None = None, workspace: MatmulWorkspace | None = None,
    split: KSplit | None = None,
) -> torch.Tensor:
    """``a @ b`` for a [B, M, K] and b [B, K, N]; every (batch, row) is batch-invariant.
    ``split`` replaces ``k_split(N, K)`` as the reduction order."""
    a = check_tensor("a", a, ndim=3, dtypes=_DTYPES)
    b = check_tensor("b", b, ndim=3, dtypes=_DTYPES)
    if b.shape[0] != a.shape[0]:
        raise ValueError(f"b has batch {b.shape[0]} but a has batch {a.shape[0]}")
    _check_pair("a", a, "b", b, b.shape[1])
    out = _out_or_new(out, (a.shape[0], a.shape[1], b.shape[2]), a)
    check_same_device(a=a, b=b, out=out)
    _launch(a, b, out, None, config, workspace, split=split)
    return out


def add_bias_mm(
    bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, *,
    config: MatmulConfig | None = None, workspace: MatmulWorkspace | None = None,
) -> torch.Tensor:
    """``bias + a @ b`` (torch.addmm with beta = alpha = 1) for a bias of shape [N], [1, N],
    [M, 1] or [M, N]; the bias is added in fp32 before the one rounding."""
    a = check_tensor("a", a, ndim=2, dtypes=_DTYPES)
    b = check_tensor("b", b, ndim=2, dtypes=_DTYPES)
    _check_pair("a", a, "b", b, b.shape[0])
    m, n = a.shape[0], b.shape[1]
    bias = check_tensor("bias", bias, dtypes=(a.dtype,))
    if bias.dim() > 2:
        raise ValueError(f"bias must have at most 2 dimensions, got shape {tuple(bias.shape)}")
    try:
        full = bias.expand(m, n)
    except RuntimeError:
        raise ValueError(
            f"bias of shape {tuple(bias.shape)} does not broadcast to ({m}, {n})") from None
    # A bias that is one row (the usual nn.Linear case) is read as a vector.
    row = bias.reshape(n) if bias.numel() == n and (bias.dim() < 2 or bias.shape[0] == 1) else None
    out = _out_or_new(out, (m, n), a)
    check_same_device(a=a, b=b, bias=bias, out=out)
    _launch(a.unsqueeze(0), b.unsqueeze(0), out.unsqueeze(0), row if row is not None else full,
            config, workspace)
    return out


def reserve_workspace(
    m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, batch: int = 1,
    workspace: MatmulWorkspace | None = None, device: torch.device | str = "cuda",
    config: MatmulConfig | None = None,
) -> None:
    """Grow the workspace for a call of this shape, ahead of a CUDA-graph capture."""
    workspace = workspace or default_workspace(device)
    cfg = config or matmul_config(m, n, k, dtype, batch, _num_sms(workspace.device))
    scratch, counters = _workspace_need(cfg, batch, m, n)
    workspace.reserve(scratch, counters)


def _check_slot_columns(sc: object, n: int, x: torch.Tensor) -> None:
    if not isinstance(sc, SlotColumns):
        raise ValueError(f"slot_columns must be SlotColumns, got {type(sc).__name__}")
    slots = sc.groups.num_adapters
    if sc.first < 0 or sc.width < 1 or sc.first + slots * sc.width != n:
        raise ValueError(f"slot_columns: {slots} slots of {sc.width} columns after column "
                         f"{sc.first} do not end at the weight's {n} rows")
    if sc.groups.num_rows != x.shape[0]:
        raise ValueError(f"slot_columns.groups has {sc.groups.num_rows} rows, x has "
                         f"{x.shape[0]}")
    check_same_device(x=x, group_adapter=sc.groups.group_adapter)


def _check_pair(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor, b_k: int) -> None:
    if b.dtype != a.dtype:
        raise ValueError(f"{b_name} dtype {b.dtype} must match {a_name} dtype {a.dtype}")
    if a.shape[-1] != b_k:
        raise ValueError(
            f"{b_name} shape {tuple(b.shape)} does not match {a_name} shape {tuple(a.shape)}: "
            f"K must agree ({a.shape[-1]} vs {b_k})")
    if min(a.shape) == 0 or min(b.shape) == 0:
        raise ValueError(
            f"{a_name} {tuple(a.shape)} and {b_name} {tuple(b.shape)} must have no empty "
            "dimension")


def _out_or_new(
    out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor
) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    check_tensor("out", out, ndim=len(shape), dtypes=(like.dtype, torch.float32))
    check_shape("out", out, shape)
    return out


def _check_config(cfg: object, k: int, dtype: torch.dtype) -> MatmulConfig:
    if not isinstance(cfg, MatmulConfig):
        raise ValueError(f"config must be a MatmulConfig, got {type(cfg).__name__}")
    for name, v in (("block_m", cfg.block_m), ("block_n", cfg.block_n),
                    ("k_split.block_k", cfg.k_split.block_k)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"config.{name} must be a power of two >= 16, got {v}")
    if not cfg.k_split.fits(k):
        raise ValueError(f"config.k_split {cfg.k_split} was not made for K = {k}; "
                         "build it with KSplit.for_chunks(K, ...)")
    if cfg.block_n2 and (cfg.block_n2 < 16 or cfg.block_n2 & (cfg.block_n2 - 1)):
        raise ValueError(f"config.block_n2 must be 0 or a power of two >= 16, got {cfg.block_n2}")
    if cfg.block_n2 and (not cfg.split_ctas or cfg.k_split.num_chunks > 1):
        raise ValueError("config.block_n2 needs split_ctas=True and a k_split of one chunk")
    if cfg.chunks_in_cta and not cfg.split_ctas:
        raise ValueError("config.chunks_in_cta needs split_ctas=True (the persistent path "
                         "always walks a tile's chunks in one CTA)")
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1 or cfg.group_m < 1:
        raise ValueError(f"config has invalid warps/stages/group_m: {cfg}")
    if dtype == torch.float32 and cfg.block_k > 64:
        raise ValueError("config.k_split.block_k and load_k must be <= 64 for fp32 inputs")
    if cfg.load_k:
        ks = cfg.k_split
        if cfg.load_k < ks.block_k or cfg.load_k & (cfg.load_k - 1):
            raise ValueError(f"config.load_k must be 0 or a power of two >= k_split.block_k "
                             f"({ks.block_k}), got {cfg.load_k}")
        if cfg.load_k != ks.block_k and not _load_fits(ks, k, cfg.load_k):
            raise ValueError(f"config.load_k {cfg.load_k} must divide K = {k} and each chunk "
                             f"of {ks.chunk_blocks * ks.block_k} elements")
    return cfg


def _workspace_need(cfg: MatmulConfig, batch: int, m: int, n: int) -> tuple[int, int]:
    if not cfg.split_ctas or cfg.k_split.num_chunks == 1 or cfg.chunks_in_cta:
        return 0, 0
    tiles = batch * cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    return tiles * cfg.k_split.num_chunks * cfg.block_m * cfg.block_n, tiles


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so each walks several tiles
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _tma_desc(t: torch.Tensor, block: list[int], transpose: bool) -> TensorDescriptor | None:
    """A TMA descriptor over ``t`` (or ``t.T``) when TMA can address it, else None."""
    if transpose:
        t = t.t()
    size = t.element_size()
    if (t.stride(1) != 1 or (t.stride(0) * size) % 16 or t.data_ptr() % 16
            or t.shape[1] * size < 16):
        return None
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], block)


def _launch(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
    config: MatmulConfig | None, workspace: MatmulWorkspace | None,
    slot_columns: SlotColumns | None = None, split: KSplit | None = None,
) -> None:
    """a [B, M, K] @ b [B, K, N] (+ bias [N] or a bias expanded to [M, N]) into out."""
    batch, m, k = a.shape
    n = b.shape[2]
    sms = _num_sms(a.device)
    if config is None and slot_columns is None:
        config = matmul_config(m, n, k, a.dtype, batch, sms, split=split)
    elif config is None:
        # The K split of the base columns alone, so no column's bits depend on how many slots
        # ride along; on the split path, tiles sized for the base and one slot's columns
        # (what decode with one adapter computes).
        first = slot_columns.first
        config = matmul_config(m, n, k, a.dtype, batch, sms, split_n=first, split=split)
        narrow = matmul_config(m, first + slot_columns.width, k, a.dtype, batch, sms,
                               split_n=first, split=split)
        if config.split_ctas and narrow.split_ctas:
            config = narrow
    cfg = _check_config(config, k, a.dtype)
    ks = cfg.k_split
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k

    if bias is None:
        bias_mode, bias_arg, sbm, sbn = _BIAS_NONE, out, 0, 0
    elif bias.dim() == 1:
        bias_mode, bias_arg, sbm, sbn = _BIAS_ROW, bias, 0, bias.stride(0)
    else:
        bias_mode, bias_arg, sbm, sbn = _BIAS_FULL, bias, bias.stride(0), bias.stride(1)

    # TMA descriptors for single matrices; batches (bmm) and odd strides use pointer loads.
    # B_KMAJOR: b is a weight [N, K] seen through .T (K contiguous), read as [BN, BK] boxes.
    a_arg, b_arg, b2_arg, use_tma, b_kmajor = a, b, b, False, False
    if cfg.tma and batch == 1:
        kmajor = b.stride(1) == 1 and b.stride(2) != 1

        def b_box(width: int) -> TensorDescriptor | None:
            return (_tma_desc(b[0], [width, bk], transpose=True) if kmajor
                    else _tma_desc(b[0], [bk, width], transpose=False))

        a_desc = _tma_desc(a[0], [bm, bk], transpose=False)
        b_desc = b_box(bn)
        b2_desc = b_box(cfg.block_n2) if cfg.block_n2 else b_desc
        if a_desc is not None and b_desc is not None and b2_desc is not None:
            a_arg, b_arg, b2_arg, use_tma, b_kmajor = a_desc, b_desc, b2_desc, True, kmajor

    # One matrix: batch strides 0, so every call compiles the same (divisible-by-16) variant;
    # without that hint the 128x256 epilogue spills on sm_90.
    sab, sbb, scb = (a.stride(0), b.stride(0), out.stride(0)) if batch > 1 else (0, 0, 0)
    common = dict(
        stride_ab=sab, stride_am=a.stride(1), stride_ak=a.stride(2),
        stride_bb=sbb, stride_bk=b.stride(1), stride_bn=b.stride(2),
        stride_cb=scb, stride_cm=out.stride(1), stride_cn=out.stride(2),
        stride_biasm=sbm, stride_biasn=sbn,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, MULTI_CHUNK=ks.num_chunks > 1, TMA=use_tma,
        B_KMAJOR=b_kmajor, EVEN_K=k % bk == 0, BIAS=bias_mode,
        INPUT_PRECISION="ieee" if a.dtype == torch.float32 else None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # Pipelining depth changes no bits; where a tile's stages do not fit in shared memory
    # (e.g. 128x256 with an fp32 epilogue) run it with fewer, and remember that.
    stages = _STAGE_CAP.get(_stage_key(cfg, out.dtype), cfg.num_stages)
    while True:
        common["num_stages"] = stages
        try:
            _launch_kernel(cfg, a_arg, b_arg, b2_arg, out, bias_arg, a, batch, m, n, k, common,
                           workspace, slot_columns)
            return
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            _STAGE_CAP[_stage_key(cfg, out.dtype)] = stages


_STAGE_CAP: dict[tuple, int] = {}


def _stage_key(cfg: MatmulConfig, out_dtype: torch.dtype) -> tuple:
    return (cfg.block_m, cfg.block_n, cfg.block_n2, cfg.block_k, cfg.num_warps, cfg.num_stages,
            cfg.split_ctas, cfg.chunks_in_cta, cfg.tma, out_dtype)


def _launch_kernel(cfg, a_arg, b_arg, b2_arg, out, bias_arg, a, batch, m, n, k, common,
                   workspace, slot_columns=None):
    ks = cfg.k_split
    bm, bn = cfg.block_m, cfg.block_n
    # Chunk length in loads (a load may span several of k_split's blocks).
    chunk_loads = (ks.chunk_blocks * ks.block_k // cfg.block_k if ks.num_chunks > 1
                   else cdiv(k, cfg.block_k))
    tiles = batch * cdiv(m, bm) * cdiv(n, bn + cfg.block_n2)
    if cfg.split_ctas:
        scratch_numel, counter_numel = _workspace_need(cfg, batch, m, n)
        if scratch_numel:
            workspace = workspace or default_workspace(a.device)
            scratch = workspace.scratch(scratch_numel)
            counters = workspace.counters(counter_numel)
        else:
            scratch = counters = out  # never touched: one chunk stores directly
        if slot_columns is None:
            groups_args = (out, out, 0, 1, 0)
            skip, groups_p2 = False, 2
        else:
            g = slot_columns.groups
            groups_args = (g.group_adapter, g.group_size, slot_columns.first, slot_columns.width,
                           g.num_groups)
            # Sized for the most groups the slots allow, not this call's count: one compiled
            # kernel per engine, whatever the batch.
            skip, groups_p2 = True, max(2, triton.next_power_of_2(g.num_adapters + 1))
        ctas_per_tile = 1 if cfg.chunks_in_cta else ks.num_chunks
        _mm_split_kernel[(tiles * ctas_per_tile,)](
            a_arg, b_arg, b2_arg, out, bias_arg, scratch, counters, *groups_args[:2],
            m, n, k, ks.num_chunks, chunk_loads, *groups_args[2:], BLOCK_N2=cfg.block_n2,
            SLOT_SKIP=skip, GROUPS_P2=groups_p2, CHUNKS_IN_CTA=cfg.chunks_in_cta, **common,
        )
    else:
        programs = min(tiles, _num_sms(a.device) * cfg.programs_per_sm)
        _mm_persistent_kernel[(programs,)](
            a_arg, b_arg, out, bias_arg,
            m, n, k, batch, chunk_loads, programs, **common,
            # Triton pipelines a flattened tile loop only with TMA loads.
            GROUP_M=cfg.group_m, FLATTEN=cfg.flatten and common["TMA"],
        )


__all__ = [
    "KSplit", "MatmulConfig", "SlotColumns", "add_bias_mm", "bmm", "bmm_ref", "k_split",
    "linear", "linear_ref", "matmul", "matmul_config", "matmul_ref", "reserve_workspace",
]
