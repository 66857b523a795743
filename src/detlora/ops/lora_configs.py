"""Kernel configurations for the LoRA shrink and expand, chosen per call shape.

The split count and BLOCK_K decide a shrink row's bits; BLOCK_M, BLOCK_N, warps and stages do
not (each output element is the same sequence of fp32 MMA accumulations, which the GPU tests
prove with ``torch.equal``). So:

* ``ordered`` may pick its split from the row count: repeatable for a fixed batch.
* ``ordered_bi`` fixes split count and BLOCK_K per hidden size, never from the row count, and
  only switches *where* the chunks are summed: in S CTAs reduced in order (few rows), or in one
  CTA chunk by chunk (many rows, no scratch traffic). Both compute
  ``((0 + p0) + p1) + ... + p(S-1)`` with every ``p`` summed in the same BLOCK_K order.
"""

from __future__ import annotations

from dataclasses import dataclass

from detlora.config import LoRAReduction
from detlora.ops._runtime import cdiv, next_power_of_2

# ordered_bi: every K chunk covers this many hidden elements, in BLOCK_K = 128 steps.
BI_CHUNK = 256
BI_BLOCK_K = 128


@dataclass(frozen=True)
class ShrinkConfig:
    """How one shrink call is tiled. ``split_k`` counts K chunks that hold work."""

    split_k: int
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    chunked: bool = False  # one CTA sums all split_k chunks in order (ordered_bi, many rows)

    def chunk_size(self, hidden: int) -> int:
        """Hidden elements per K chunk: a multiple of block_k."""
        return cdiv(cdiv(hidden, self.split_k), self.block_k) * self.block_k

    def num_chunks(self, hidden: int) -> int:
        """Chunks that hold work once the chunk size is rounded up to block_k."""
        return cdiv(hidden, self.chunk_size(hidden))


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int
    block_n: int
    block_r: int  # rank step; fixed per rank so rows never depend on the row count
    num_warps: int = 4
    num_stages: int = 2


def _block_n(n: int, cap: int = 128) -> int:
    return min(max(16, next_power_of_2(n)), cap)


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
        cfg = _unsplit_config(num_rows, n)
    elif reduction is LoRAReduction.ORDERED_BI:
        cfg = _ordered_bi_config(num_rows, hidden, n)
    else:  # ordered and tree share the split choice; they differ in how partials are summed
        cfg = _ordered_config(num_rows, hidden, n)
    return _trim_split(cfg, hidden)


def _trim_split(cfg: ShrinkConfig, hidden: int) -> ShrinkConfig:
    """Drop chunks that would hold no work (the ordered reduction counts real chunks)."""
    real = cfg.num_chunks(hidden)
    if real == cfg.split_k:
        return cfg
    return ShrinkConfig(
        split_k=real,
        block_m=cfg.block_m,
        block_n=cfg.block_n,
        block_k=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        chunked=cfg.chunked,
    )


def _block_m(num_rows: int) -> int:
    if num_rows <= 16:
        return 16
    if num_rows <= 32:
        return 32
    return 64


# Tilings measured best on the H200 (benchmarks/results/lora_sweep.json: H = 3072, r = 16,
# 1 and 3 slices; BLOCK_N = 16 won everywhere: the shrink is latency-bound, so more CTAs beat
# wider tiles). Rows: (largest M, hidden elements per K chunk, BLOCK_M, BLOCK_K, warps).
_ORDERED_TABLE: tuple[tuple[int, int, int, int, int], ...] = (
    (64, 256, 16, 128, 4),
    (256, 768, 32, 256, 2),
    (1024, 768, 32, 128, 2),
    (1 << 62, 1536, 64, 128, 4),
)


def _unsplit_config(num_rows: int, n: int) -> ShrinkConfig:
    bm = 16 if num_rows <= 256 else 32
    return ShrinkConfig(split_k=1, block_m=bm, block_n=16, block_k=256, num_warps=2,
                        num_stages=3)


def _ordered_config(num_rows: int, hidden: int, n: int) -> ShrinkConfig:
    _, chunk, bm, bk, warps = next(row for row in _ORDERED_TABLE if num_rows <= row[0])
    split = max(1, cdiv(hidden, chunk))
    return ShrinkConfig(split_k=split, block_m=bm, block_n=16, block_k=bk, num_warps=warps,
                        num_stages=3)


def ordered_bi_split(hidden: int) -> int:
    """The fixed split count of ordered_bi for a hidden size (never depends on rows)."""
    return cdiv(hidden, BI_CHUNK)


# ordered_bi walks the chunks inside one CTA from this many rows on (no scratch traffic);
# below it, the chunks are spread over CTAs and reduced in order.
BI_CHUNKED_FROM_ROWS = 1024


def _ordered_bi_config(num_rows: int, hidden: int, n: int) -> ShrinkConfig:
    split = ordered_bi_split(hidden)
    chunked = num_rows >= BI_CHUNKED_FROM_ROWS
    if chunked:
        bm, warps = 64, 4
    else:
        bm, warps = (16, 4) if num_rows <= 64 else (32, 4)
    return ShrinkConfig(split_k=split, block_m=bm, block_n=16, block_k=BI_BLOCK_K,
                        num_warps=warps, num_stages=3, chunked=chunked)


def expand_config(num_rows: int, rank: int, max_width: int) -> ExpandConfig:
    """Expand tiles; ``block_r`` depends on the rank alone."""
    block_r = min(max(16, next_power_of_2(rank)), 64)
    bm = _block_m(num_rows)
    bn = 128 if max_width >= 128 else _block_n(max_width)
    return ExpandConfig(block_m=bm, block_n=bn, block_r=block_r, num_warps=4, num_stages=2)
