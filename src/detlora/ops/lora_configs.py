"""Kernel configurations for the LoRA shrink and expand, chosen per call shape.

A shrink row's bits are decided by its *reduction tree* alone: the hidden axis is cut into
chunks (each summed from zero in BLOCK_K steps), chunks into groups (each group sum starts from
zero and adds its chunk sums in order), and the total starts from zero and adds the group sums
in order. BLOCK_M, BLOCK_N, warps and stages do not change a row's bits (the GPU tests prove it
with ``torch.equal``), and neither does *where* each level is summed: one CTA per chunk with the
rest summed by the last CTA, one CTA per group, or one CTA for everything. So:

* ``ordered`` may pick its tree from the row count: repeatable for a fixed batch.
* ``ordered_bi`` fixes the tree per hidden size (chunk 256, 3 chunks a group) and lets the row
  count choose only where the levels are summed: many CTAs for decode, few or one (no scratch
  traffic) for prefill. A row is then the same at M = 1 and at M = 8192.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from detlora.config import LoRAReduction
from detlora.ops._runtime import cdiv, next_power_of_2
from detlora.ops.tuned_configs import tuned_config

# ordered_bi's tree: chunks of this many hidden elements in BLOCK_K = 128 steps, 3 per group.
BI_CHUNK = 256
BI_BLOCK_K = 128
BI_GROUP_CHUNKS = 3

CTA_COVERS = ("chunk", "group", "all")


@dataclass(frozen=True)
class ShrinkConfig:
    """How one shrink call is tiled and which reduction tree it computes.

    ``split_k`` counts K chunks; ``group_chunks`` chunks make a group; ``cta_covers`` says
    what one CTA along K reduces: a chunk, a group, or all of K. ``group_cap``: see
    ``ExpandConfig``.
    """

    split_k: int
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    group_chunks: int = 1
    cta_covers: str = "chunk"
    group_cap: int | None = None

    def chunk_size(self, hidden: int) -> int:
        """Hidden elements per K chunk: a multiple of block_k."""
        return cdiv(cdiv(hidden, self.split_k), self.block_k) * self.block_k

    def num_chunks(self, hidden: int) -> int:
        """Chunks that hold work once the chunk size is rounded up to block_k."""
        return cdiv(hidden, self.chunk_size(hidden))

    def ctas_along_k(self, hidden: int) -> int:
        chunks = self.num_chunks(hidden)
        if self.cta_covers == "chunk":
            return chunks
        if self.cta_covers == "group":
            return cdiv(chunks, self.group_chunks)
        return 1


@dataclass(frozen=True)
class ExpandConfig:
    """How one expand call (or a fused expand) is tiled.

    ``group_cap``: the grid's last axis runs over the batch's row tiles, numbered group by
    group. None launches one program per row tile the batch can have (``ceil(M / block_m) +
    min(M, slots + 1) - 1``; the extra ones idle when few adapters are in use); an int at most
    ``ceil(M / block_m) + cap``, each looping over tiles t, t + programs, ...
    (``adapter_groups.row_tile_programs``). The cap changes which program computes a tile,
    never its bits. ``expand_config`` caps at ``EXPAND_GROUP_CAP``.
    """

    block_m: int
    block_n: int
    block_r: int  # rank step; fixed per rank so rows never depend on the row count
    num_warps: int = 4
    num_stages: int = 2
    group_cap: int | None = None


def _block_n(n: int, cap: int = 128) -> int:
    return min(max(16, next_power_of_2(n)), cap)


def _block_m(num_rows: int) -> int:
    if num_rows <= 16:
        return 16
    if num_rows <= 32:
        return 32
    return 64


def vllm_default_shrink_config(num_rows: int) -> ShrinkConfig:
    """vLLM's default (untuned) shrink config: Split-K 64 below 128 rows, 8 from 128 on."""
    small = num_rows < 128
    return ShrinkConfig(
        split_k=64 if small else 8,
        block_m=32,
        block_n=16,
        block_k=256 if small else 32,
        num_warps=4,
        num_stages=2,
    )


def shrink_config(
    reduction: LoRAReduction | str, num_rows: int, hidden: int, n: int
) -> ShrinkConfig:
    """The configuration the engine uses for a shrink of ``num_rows`` x ``hidden`` -> ``n``.

    ``n`` is slices x rank: one launch covers every slice.
    """
    reduction = LoRAReduction.parse(reduction)
    if reduction is LoRAReduction.ATOMIC:
        cfg = vllm_default_shrink_config(num_rows)
    elif reduction is LoRAReduction.UNSPLIT:
        cfg = _unsplit_config(num_rows)
    elif reduction is LoRAReduction.ORDERED_BI:
        cfg = _ordered_bi_config(num_rows, hidden, n)
    else:  # ordered and tree share the split choice; they differ in how partials are summed
        cfg = _ordered_config(num_rows, hidden)
    return _trim_split(cfg, hidden)


def _trim_split(cfg: ShrinkConfig, hidden: int) -> ShrinkConfig:
    """Drop chunks that would hold no work (the ordered reduction counts real chunks)."""
    real = cfg.num_chunks(hidden)
    if real == cfg.split_k:
        return cfg
    return replace(cfg, split_k=real)


# The ordered shrink's tilings (configs/lora_shrink.json), by the largest row count each serves:
# (largest M, hidden elements per chunk, BLOCK_M, BLOCK_K, warps).
_ORDERED_TABLE: tuple[tuple[int, int, int, int, int], ...] = tuple(
    (1 << 62 if t["max_rows"] is None else t["max_rows"], t["chunk_elements"], t["block_m"],
     t["block_k"], t["num_warps"]) for t in tuned_config("lora_shrink")["ordered"])


def _unsplit_config(num_rows: int) -> ShrinkConfig:
    bm = 16 if num_rows <= 256 else 32
    return ShrinkConfig(split_k=1, block_m=bm, block_n=16, block_k=256, num_warps=2,
                        num_stages=3)


def _ordered_config(num_rows: int, hidden: int) -> ShrinkConfig:
    _, chunk, bm, bk, warps = next(row for row in _ORDERED_TABLE if num_rows <= row[0])
    return ShrinkConfig(split_k=max(1, cdiv(hidden, chunk)), block_m=bm, block_n=16,
                        block_k=bk, num_warps=warps, num_stages=3)


def ordered_bi_split(hidden: int) -> int:
    """The fixed chunk count of ordered_bi for a hidden size (never depends on rows)."""
    return cdiv(hidden, BI_CHUNK)


# ordered_bi: one CTA per chunk up to this many rows (decode), one CTA per group above.
BI_CHUNK_CTAS_UP_TO_ROWS = 64
# One CTA for all of K once the (M, N) tiles alone fill the GPU twice (132 SMs on an H100/H200).
BI_WHOLE_K_FROM_TILES = 264


def _ordered_bi_config(num_rows: int, hidden: int, n: int) -> ShrinkConfig:
    _, _, bm, _, warps = next(row for row in _ORDERED_TABLE if num_rows <= row[0])
    if num_rows <= BI_CHUNK_CTAS_UP_TO_ROWS:
        covers = "chunk"
    elif cdiv(num_rows, bm) * cdiv(n, 16) >= BI_WHOLE_K_FROM_TILES:
        covers = "all"
    else:
        covers = "group"
    return ShrinkConfig(split_k=ordered_bi_split(hidden), block_m=bm, block_n=16,
                        block_k=BI_BLOCK_K, num_warps=max(warps, 4), num_stages=3,
                        group_chunks=BI_GROUP_CHUNKS, cta_covers=covers)


# Up to this many rows the expands take 16-row tiles (16 x 64 up to 16 rows, else 16 x 128): a
# batch spread over many adapters leaves each group a few rows, which larger tiles would compute
# mostly empty, and the SwiGLU expand is faster in 16-row tiles on one adapter too (the rows
# measured: docs/decisions.md, "Expand tiles for spread batches").
EXPAND_SMALL_TILE_ROWS = 2048


# Programs along the expand's row-tile axis beyond the batch's own row tiles, at most: where
# adapter groups could add more partial tiles than that, the programs loop, so idle slots stop
# adding empty programs.
EXPAND_GROUP_CAP = 16


def expand_block_m(num_rows: int) -> int:
    """The expands' row tile for M rows: 16 up to ``EXPAND_SMALL_TILE_ROWS`` (a batch spread
    over many adapters leaves each group a few rows), else the shrink's. ``AdapterGroups``
    numbers its row tiles for it."""
    return 16 if num_rows <= EXPAND_SMALL_TILE_ROWS else _block_m(num_rows)


def expand_config(num_rows: int, rank: int, max_width: int) -> ExpandConfig:
    """Expand tiles; ``block_r`` depends on the rank alone, so the tiles never change a row's
    bits (tests/gpu proves rows equal at every M); the group cap never changes them either."""
    block_r = min(max(16, next_power_of_2(rank)), 64)
    bm = expand_block_m(num_rows)
    # 64 columns up to 16 rows (more programs for a short batch), else 128 (fewer, fuller
    # programs: docs/decisions.md, "Expand tiles for spread batches").
    cap = 64 if num_rows <= 16 else 128
    bn = cap if max_width >= cap else _block_n(max_width, cap)
    return ExpandConfig(block_m=bm, block_n=bn, block_r=block_r, num_warps=4, num_stages=2,
                        group_cap=EXPAND_GROUP_CAP)
