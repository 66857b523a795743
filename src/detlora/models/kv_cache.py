"""The paged KV cache: per layer, K and V pages of [num_blocks, block_size, Hk, D].

One allocation for every layer, so the engine can size it from free memory in one step and
CUDA graphs see fixed addresses.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from detlora.models.spec import ModelSpec


@dataclass(frozen=True)
class KVCache:
    k: tuple[torch.Tensor, ...]  # one [num_blocks, block_size, Hk, D] per layer
    v: tuple[torch.Tensor, ...]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (k_cache, v_cache) pairs: the form ``model.forward`` takes."""
        return zip(self.k, self.v, strict=True)

    def __len__(self) -> int:
        return len(self.k)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

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
        """``num_kv_heads``: the heads held here (a tensor-parallel shard; default: all)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}"
            )
        # Zeros, not empty: pages are only read where written, but zeros keep stale NaNs out
        # of masked lanes of any kernel.
        pages = torch.zeros(
            2, spec.num_layers, num_blocks, block_size, num_kv_heads or spec.num_kv_heads,
            spec.head_dim,
            dtype=dtype, device=device,
        )
        return cls(k=tuple(pages[0].unbind(0)), v=tuple(pages[1].unbind(0)))
