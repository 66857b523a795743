"""Tensor-parallel linear layers: output columns split over the ranks, or the input axis.

``ColumnParallelLinear`` (q|k|v, gate|up): each rank holds a row range of every slice of W
(and of B of LoRA; A whole), computes its columns over the whole K and keeps them: the next
op (attention of its heads, the activation of its MLP columns) reads only those. Each column
is reduced as the whole layer reduces it (``OpBackend.column_linear`` with the full width),
so a shard's columns carry one device's bits.

``RowParallelLinear`` (o, down): each rank holds a K range of W (and of A; B whole) and its
partial sums are combined over the ranks. At batch_invariant the K axis is summed as
``k_groups(K)`` ordered group partials on every group size, one device included
(``OpBackend.row_linear``); a rank computes the partials of its groups, the ranks gather
them, and each adds all of them in group order (``sum_partials``): one device's bits.
Below batch_invariant the ranks all-reduce their rounded outputs. With ``in_gemm`` the
shrink's columns ride in the same output, so they are reduced with it; a separate shrink
output is all-reduced (not at batch_invariant, where the engine takes ``in_gemm``).

With a group of one rank both are the plain layer (column: the same bits as ``Linear``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from detlora.distributed.group import TensorParallelGroup
from detlora.distributed.sharding import even_shard
from detlora.layers.linear import LinearBase
from detlora.layers.lora_slots import PendingLoRA
from detlora.ops.adapter_groups import AdapterGroups
from detlora.ops.grouped_linear import k_groups
from detlora.ops.lora_partials import ShrinkPartials, reduce_partials_ref
from detlora.ops.slot_columns import SlotColumns


class ColumnParallelLinear(LinearBase):
    """Slices of ``output_sizes`` fused along the output axis, each cut to ``shards[s]``
    ([lo, hi) rows of slice s held here; default: an even split over ``tp``)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        tp: TensorParallelGroup | None = None,
        shards: Sequence[tuple[int, int]] | None = None,
        **kwargs,
    ) -> None:
        self.tp = tp or TensorParallelGroup.single()
        sizes = tuple(int(n) for n in output_sizes)
        if shards is None:
            shards = [even_shard(n, self.tp.rank, self.tp.size) for n in sizes]
        if len(shards) != len(sizes) or any(
                not 0 <= lo < hi <= n for (lo, hi), n in zip(shards, sizes, strict=True)):
            raise ValueError(f"shards {list(shards)} do not fit the slices {list(sizes)}")
        self.shards = tuple((int(lo), int(hi)) for lo, hi in shards)
        super().__init__(input_size, sizes, **kwargs)

    def local_sizes(self) -> tuple[int, tuple[int, ...]]:
        return self.input_size, tuple(hi - lo for lo, hi in self.shards)

    def shard(self, tensor: torch.Tensor, slice_index: int, dim: int) -> torch.Tensor:
        if dim != 0:
            return tensor
        lo, hi = self.shards[slice_index]
        return tensor[lo:hi]

    def gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             slot_columns: SlotColumns | None = None) -> torch.Tensor:
        # Every column (an in_gemm slot's too) reduces as the whole layer's base columns do.
        return self.backend.column_linear(x, weight, bias, sum(self.output_sizes),
                                          slot_columns=slot_columns)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, shards={list(self.shards)}"


class RowParallelLinear(LinearBase):
    """One projection whose input axis is split evenly over ``tp``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp: TensorParallelGroup | None = None,
        **kwargs,
    ) -> None:
        self.tp = tp or TensorParallelGroup.single()
        self.k_range = even_shard(int(input_size), self.tp.rank, self.tp.size)
        super().__init__(input_size, (output_size,), **kwargs)
        self.groups = k_groups(self.input_size)
        if self.groups % self.tp.size:
            raise ValueError(f"K = {self.input_size} sums as {self.groups} groups, which do not "
                             f"split over {self.tp.size} ranks")
        if (self.lora is not None and not self.tp.is_single and self.backend.exact_reductions
                and not self.backend.lora_in_gemm):
            raise ValueError("tensor parallelism at batch_invariant reduces the LoRA shrink "
                             "of row-parallel layers inside the base GEMM: use "
                             "lora_reduction='in_gemm'")

    def local_sizes(self) -> tuple[int, tuple[int, ...]]:
        lo, hi = self.k_range
        return hi - lo, self.output_sizes

    def shard(self, tensor: torch.Tensor, slice_index: int, dim: int) -> torch.Tensor:
        if dim != 1:
            return tensor
        lo, hi = self.k_range
        return tensor[:, lo:hi]

    def gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             slot_columns: SlotColumns | None = None) -> torch.Tensor:
        """x W^T (+ b) over the whole K: this rank's part combined with the others'. Split
        over ranks, every column is computed (unused slots' too)."""
        tp, backend = self.tp, self.backend
        if tp.is_single:
            return backend.row_linear(x, weight, bias, self.groups, slot_columns=slot_columns)
        if backend.exact_reductions:
            local = backend.linear_partials(x, weight, self.groups // tp.size)
            every = tp.all_gather(local)  # [ranks, groups per rank, M, N], group order
            return backend.sum_partials(every.flatten(0, 1), bias, x.dtype)
        y = backend.linear(x, weight, bias if tp.rank == 0 else None)
        return tp.all_reduce(y)

    def forward_unexpanded(
        self, x: torch.Tensor, lora: AdapterGroups | None = None
    ) -> tuple[torch.Tensor, PendingLoRA | None]:
        y, pending = super().forward_unexpanded(x, lora)
        if pending is None or self.tp.is_single or self.gemm_weight is not None:
            return y, pending
        # A shrink beside the GEMM summed this rank's K range only.
        h = pending.shrink_out
        if isinstance(h, ShrinkPartials):
            assert lora is not None
            h = reduce_partials_ref(h, lora.token_adapter)
        return y, PendingLoRA(self.tp.all_reduce(h), pending.lora_b, pending.slice_offsets,
                              pending.slot_ranks)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, k_range={self.k_range}, groups={self.groups}"
