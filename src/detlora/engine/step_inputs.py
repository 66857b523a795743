"""Host-side inputs of one step, flattened from the scheduler's choice.

Built once per step in plain Python lists, then turned into a ``ForwardBatch`` (eager) or
copied into the static buffers of a captured decode graph.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from detlora.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepInputs:
    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]
    token_adapter: list[int]  # [T], -1 = no adapter
    block_tables: list[list[int]]  # [B][pages]
    seq_lens: list[int]  # [B]
    query_start_loc: list[int]  # [B + 1]
    logits_indices: list[int]  # [N]: the last row of every sequence that samples

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def max_query_len(self) -> int:
        qsl = self.query_start_loc
        return max(b - a for a, b in itertools.pairwise(qsl))

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)


def build_step_inputs(
    sched: SchedulerOutput, adapter_slots: list[int], block_size: int
) -> StepInputs:
    """Flatten ``sched``; ``adapter_slots[i]`` is the slot of scheduled sequence i (-1: none)."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    adapters: list[int] = []
    tables: list[list[int]] = []
    seq_lens: list[int] = []
    qsl = [0]
    logits_idx: list[int] = []
    for item, slot in zip(sched.scheduled, adapter_slots, strict=True):
        seq, n = item.seq, item.num_tokens
        start = seq.num_computed
        table = seq.block_table
        ids.extend(seq.token_ids[start : start + n])
        for p in range(start, start + n):
            pos.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        adapters.extend([slot] * n)
        tables.append(list(table))
        seq_lens.append(start + n)
        qsl.append(qsl[-1] + n)
        if item.samples:
            logits_idx.append(qsl[-1] - 1)
    return StepInputs(ids, pos, slots, adapters, tables, seq_lens, qsl, logits_idx)
