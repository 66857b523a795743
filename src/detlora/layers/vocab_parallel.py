"""The vocabulary split over tensor-parallel ranks: token embedding and LM head.

Rank r holds rows [r * V_r, (r + 1) * V_r) of the embedding (and of an untied LM head),
``V_r = vocab_shard_rows(V, ranks)``; rows past the vocabulary are zeros.

Embedding: each rank looks its ids up in its rows (ids it does not hold read row 0), the
ranks gather their [T, H] lookups, and every token takes the row of the rank that holds its
id: a gather, with no arithmetic, so the bits are one device's.

LM head: each rank computes the logits of its vocabulary shard, each column reduced as the
whole head reduces it (``OpBackend.column_linear``), and the ranks gather them into the full
[N, V] logits, which the one sampler reads as it reads one device's.
"""

from __future__ import annotations

import torch
from torch import nn

from detlora.distributed.group import TensorParallelGroup
from detlora.distributed.sharding import vocab_shard_rows
from detlora.layers.backend import OpBackend


class _VocabShard(nn.Module):
    """A [V_r, H] weight holding this rank's rows of a [V, H] one."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        backend: OpBackend,
        tp: TensorParallelGroup | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.tp = tp or TensorParallelGroup.single()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.shard_rows = vocab_shard_rows(vocab_size, self.tp.size)
        self.row_start = self.tp.rank * self.shard_rows
        self.weight = nn.Parameter(
            torch.zeros(self.shard_rows, hidden_size, dtype=dtype, device=device),
            requires_grad=False)

    def load_weight(self, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of the full [V, H] checkpoint tensor."""
        expected = (self.vocab_size, self.hidden_size)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{self._what} must have shape {expected}, got "
                             f"{tuple(tensor.shape)}")
        rows = tensor[self.row_start: self.row_start + self.shard_rows]
        with torch.no_grad():
            self.weight[: rows.shape[0]].copy_(rows)

    _what = "weight"

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size}, hidden={self.hidden_size}, "
                f"rows=[{self.row_start}, {self.row_start + self.shard_rows})")


class VocabParallelEmbedding(_VocabShard):
    """ids [T] -> weight[ids] [T, H]; its weight may serve as a tied LM head's."""

    _what = "embedding"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.is_single:
            return self.backend.embedding(ids, self.weight)
        local = ids - self.row_start
        held = (local >= 0) & (local < self.shard_rows)
        rows = self.backend.embedding(torch.where(held, local, 0), self.weight)
        every = self.tp.all_gather(rows)  # [ranks, T, H]
        owner = torch.div(ids, self.shard_rows, rounding_mode="floor")
        return every[owner, torch.arange(ids.shape[0], device=ids.device)]


class ParallelLMHead(_VocabShard):
    """hidden [N, H] -> logits [N, V] in the model dtype (untied head)."""

    _what = "lm_head"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(self.backend, self.tp, hidden, self.weight,
                                     self.vocab_size)


def vocab_parallel_logits(
    backend: OpBackend, tp: TensorParallelGroup, hidden: torch.Tensor, weight: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """Full-vocabulary logits [N, V] from this rank's head rows ``weight`` [V_r, H]."""
    local = backend.column_linear(hidden, weight, None, vocab_size)
    if tp.is_single:
        return local
    every = tp.all_gather(local)  # [ranks, N, V_r]
    full = every.permute(1, 0, 2).reshape(hidden.shape[0], -1)
    return full if full.shape[1] == vocab_size else full[:, :vocab_size].contiguous()
