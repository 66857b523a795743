"""How a layer's dimensions are cut over the ranks of a tensor-parallel group.

Sizes 1, 2, 4 and 8 only: a row-parallel layer sums its K axis as ``k_groups(K)`` (8 for the
models we run) ordered group partials, and those sizes put every shard boundary on a group
boundary, so every size gives one device's bits (``detlora.ops.grouped_linear``).

Attention heads split evenly; KV heads too while there are at least as many as ranks, and
are replicated beyond that (rank r holds KV head r // (size / num_kv_heads), the one its
query heads read). The vocabulary splits into equal shards of ``SHARD_ALIGN``-multiple rows,
the last one padded with zero rows, so that every shard starts on a column tile of the CPU
kernels (``detlora.ops.cpu_invariant.COL_TILE``).
"""

from __future__ import annotations

from detlora.distributed.tp_sizes import SUPPORTED_SIZES, TensorParallelDims, check_tensor_parallel
from detlora.ops.cpu_invariant import COL_TILE

SHARD_ALIGN = COL_TILE


def check_size(size: object) -> int:
    """``size`` as a tensor-parallel size, or a ValueError naming the supported ones."""
    if isinstance(size, bool) or not isinstance(size, int) or size not in SUPPORTED_SIZES:
        raise ValueError(f"tensor_parallel_size must be one of {list(SUPPORTED_SIZES)} (the "
                         f"sizes whose bits equal one device's), got {size!r}")
    return size


def even_shard(total: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of rank ``rank`` when ``total`` splits into ``size`` equal parts."""
    if total % size:
        raise ValueError(f"{total} does not split evenly over {size} ranks")
    part = total // size
    return rank * part, (rank + 1) * part


def kv_head_shard(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of the KV heads rank ``rank`` holds (one replicated head beyond
    ``num_kv_heads`` ranks)."""
    if size <= num_kv_heads:
        return even_shard(num_kv_heads, rank, size)
    if size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {size} ranks")
    head = rank // (size // num_kv_heads)
    return head, head + 1


def vocab_shard_rows(vocab_size: int, size: int) -> int:
    """Rows of the embedding (and LM head) every rank holds: the vocabulary itself on one
    rank, else an equal ``SHARD_ALIGN``-multiple share (the last rank's padded)."""
    if size == 1:
        return vocab_size
    per = -(-vocab_size // size)
    return -(-per // SHARD_ALIGN) * SHARD_ALIGN


def check_shardable(*, num_heads: int, num_kv_heads: int, intermediate_size: int,
                    size: int, head_dim: int = 1) -> None:
    """Refuse a model whose heads or MLP width do not split over ``size`` ranks with one
    device's bits (``detlora.distributed.tp_sizes``: the error names the sizes that do)."""
    check_size(size)
    check_tensor_parallel(TensorParallelDims.of(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        intermediate_sizes=(intermediate_size,)), size)
