"""Embedding lookup.

Semantics:
    ids: [T] ints in [0, V), weight: [V, H]  ->  weight[ids]  ([T, H], weight's dtype).
    A gather: batch-invariant by construction. Out-of-range ids are an error, never a read
    out of bounds.
"""

from __future__ import annotations

import torch


def embedding_ref(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight[ids.long()]
