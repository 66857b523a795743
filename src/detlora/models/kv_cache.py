"""The paged KV cache: per layer, K and V pages of [num_blocks, block_size, Hk, D].

One allocation for every layer of a uniform model, so the engine can size it from free memory
in one step and CUDA graphs see fixed addresses. A model whose layers keep their pages in
several groups (models/layer_spec.py: sliding-window layers, full layers) gets one
allocation per group and page shape, each with its group's page count; a layer that reads
another's K/V (Gemma 4's KV sharing) gets no pages of its own: its entry is the producer's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from detlora.models.spec import ModelSpec


@dataclass(frozen=True)
class LayerPages:
    """Where one layer's K/V live: KV group ``group`` with pages of [Hk, D], or (``source``
    set) the pages of an earlier layer."""

    group: int
    num_kv_heads: int
    head_dim: int
    source: int | None = None


@dataclass(frozen=True)
class KVCache:
    k: tuple[torch.Tensor, ...]  # one [num_blocks, block_size, Hk, D] per layer
    v: tuple[torch.Tensor, ...]
    group_blocks: tuple[int, ...] = ()  # pages of each KV group (empty: one group)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (k_cache, v_cache) pairs: the form ``model.forward`` takes."""
        return zip(self.k, self.v, strict=True)

    def __len__(self) -> int:
        return len(self.k)

    @property
    def num_blocks(self) -> int:
        """Pages of group 0 (of the one group of a uniform model)."""
        return self.group_blocks[0] if self.group_blocks else self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]

    @classmethod
    def allocate(
        cls,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        num_kv_heads: int | None = None,
    ) -> KVCache:
        """A uniform model's cache. ``num_kv_heads``: the heads held here (a tensor-parallel
        shard; default: all)."""
        _check_sizes([num_blocks], block_size)
        # Zeros, not empty: pages are only read where written, but zeros keep stale NaNs out
        # of masked lanes of any kernel.
        pages = torch.zeros(
            2, spec.num_layers, num_blocks, block_size, num_kv_heads or spec.num_kv_heads,
            spec.head_dim,
            dtype=dtype, device=device,
        )
        return cls(k=tuple(pages[0].unbind(0)), v=tuple(pages[1].unbind(0)))

    @classmethod
    def allocate_layers(
        cls,
        layers: Sequence[LayerPages],
        group_blocks: Sequence[int],
        block_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        """The cache of layers in KV groups: ``group_blocks[g]`` pages for group g, one
        zeroed allocation per (group, page shape) shared by its layers; layers with a
        ``source`` alias their producer's pages."""
        _check_sizes(group_blocks, block_size)
        shapes: dict[tuple[int, int, int], list[int]] = {}
        for i, lp in enumerate(layers):
            if lp.source is None:
                shapes.setdefault((lp.group, lp.num_kv_heads, lp.head_dim), []).append(i)
        k: list[torch.Tensor | None] = [None] * len(layers)
        v: list[torch.Tensor | None] = [None] * len(layers)
        for (group, hk, d), members in shapes.items():
            pages = torch.zeros(2, len(members), group_blocks[group], block_size, hk, d,
                                dtype=dtype, device=device)
            for j, i in enumerate(members):
                k[i], v[i] = pages[0, j], pages[1, j]
        for i, lp in enumerate(layers):
            if lp.source is not None:
                k[i], v[i] = k[lp.source], v[lp.source]
                if k[i] is None:
                    raise ValueError(f"layer {i} reads the pages of layer {lp.source}, "
                                     "which has none")
        return cls(k=tuple(k), v=tuple(v), group_blocks=tuple(int(n) for n in group_blocks))


def _check_sizes(group_blocks: Sequence[int], block_size: int) -> None:
    if not group_blocks or min(group_blocks) < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be positive, got "
                         f"{list(group_blocks)}, {block_size}")
