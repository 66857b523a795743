"""What one engine step hands to a model: the contract between engine/ and models/.

The engine's model runner builds a ForwardBatch per step (and keeps static copies for CUDA
graphs); the model reads it and knows nothing of sequences or scheduling.

How engine/, models/, layers/ and lora/ fit together: docs/design.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from detlora.ops.adapter_groups import AdapterGroups
from detlora.ops.chunk_plan import ChunkPlan


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token's K/V goes and which pages each sequence reads.

    Same meaning as the arguments of ``detlora.ops.paged_attention``.
    """

    slot_mapping: torch.Tensor  # int64 [T]: page * block_size + offset; -1 = padding token
    block_tables: torch.Tensor  # int32 [B, max_blocks]: pages of each sequence, in order
    seq_lens: torch.Tensor  # int32 [B]: context length including this step's tokens
    query_start_loc: torch.Tensor  # int32 [B + 1]: sequence b owns token rows [qsl[b], qsl[b+1])
    max_query_len: int  # host-side: longest q_len in the batch (1 for a pure decode step)
    max_seq_len: int  # host-side: longest seq_len in the batch
    # Models whose layers keep their KV pages in several groups (models/layer_spec.py:
    # sliding windows, see docs/design.md): the slots and pages of groups 1.. (group 0's are
    # the fields above); None with one group.
    group_slot_mapping: torch.Tensor | None = None  # int64 [G - 1, T]
    group_block_tables: torch.Tensor | None = None  # int32 [G - 1, B, max_blocks]

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV group ``group``: this one for group 0."""
        if group == 0:
            return self
        if self.group_slot_mapping is None or self.group_block_tables is None:
            raise ValueError(f"KV group {group} has no slots or block tables in this batch")
        return replace(self, slot_mapping=self.group_slot_mapping[group - 1],
                       block_tables=self.group_block_tables[group - 1],
                       group_slot_mapping=None, group_block_tables=None)


@dataclass(frozen=True)
class LoRABatch:
    """Which adapter slot each token uses (-1 = none), grouped once per step for all layers."""

    groups: AdapterGroups


@dataclass(frozen=True)
class MambaMetadata:
    """What state-space (Mamba-2) layers read besides the tokens: each sequence's state slot
    and the step's chunks on the fixed chunk grid (``layers/mamba_metadata.py`` builds it)."""

    state_slots: torch.Tensor  # int32 [B]: each sequence's slot in the state cache
    seq_start: torch.Tensor  # int32 [B]: position of each sequence's first row in this step
    query_start_loc: torch.Tensor  # int32 [B + 1]: as AttentionMetadata's
    token_seq: torch.Tensor  # int32 [T]: each row's sequence index
    plan: ChunkPlan  # the (sequence, chunk) items of the step


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [N]: rows of T whose next-token logits are wanted
    lora: LoRABatch | None = None
    mamba: MambaMetadata | None = None  # hybrid models only
