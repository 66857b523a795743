"""Token embedding over the whole vocabulary (a vocab-parallel one later shards the rows)."""

from __future__ import annotations

import torch
from torch import nn

from detlora.layers.backend import OpBackend


class VocabEmbedding(nn.Module):
    """ids [T] -> weight[ids] [T, H]. The weight can be shared with a tied LM head."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        backend: OpBackend,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def load_weight(self, tensor: torch.Tensor) -> None:
        expected = (self.vocab_size, self.hidden_size)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"embedding must have shape {expected}, got {tuple(tensor.shape)}")
        with torch.no_grad():
            self.weight.copy_(tensor)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.backend.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, hidden={self.hidden_size}"
