"""Build a step's ``MambaMetadata`` on the host from its sequences (the model runner and tests).

Everything is a function of each sequence's own rows, positions and state slot, so what a
Mamba layer computes for a sequence never depends on the others in the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from detlora.layers.forward_batch import MambaMetadata
from detlora.ops.chunk_plan import ChunkPlan


def build_mamba_metadata(
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    state_slots: Sequence[int],
    chunk_size: int,
    device: torch.device | str = "cpu",
    *,
    query_start_loc_tensor: torch.Tensor | None = None,
) -> MambaMetadata:
    """Sequence b computes rows [query_start_loc[b], query_start_loc[b + 1]) ending at position
    ``seq_lens[b]`` (exclusive) with state slot ``state_slots[b]``; the chunk grid is
    ``chunk_size``. ``query_start_loc_tensor``: the attention metadata's copy, reused."""
    num_seqs = len(state_slots)
    if len(seq_lens) != num_seqs or len(query_start_loc) != num_seqs + 1:
        raise ValueError(f"{num_seqs} state slots, {len(seq_lens)} sequence lengths and "
                         f"{len(query_start_loc)} query starts do not describe one batch")
    if any(s < 0 for s in state_slots):
        raise ValueError(f"every sequence of a hybrid model needs a state slot, got "
                         f"{list(state_slots)}")
    starts = [seq_lens[b] - (query_start_loc[b + 1] - query_start_loc[b])
              for b in range(num_seqs)]
    token_seq = [b for b in range(num_seqs)
                 for _ in range(query_start_loc[b + 1] - query_start_loc[b])]

    def t(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int32).to(device, non_blocking=True)

    qsl = query_start_loc_tensor if query_start_loc_tensor is not None else t(query_start_loc)
    return MambaMetadata(
        state_slots=t(state_slots), seq_start=t(starts), query_start_loc=qsl,
        token_seq=t(token_seq),
        plan=ChunkPlan.build(query_start_loc, seq_lens, state_slots, chunk_size, device))
