"""Host-side inputs of one step, flattened from the scheduler's choice.

Built once per step in plain Python lists, then turned into a ``ForwardBatch`` (eager) or
copied into the static buffers of a captured decode graph.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from detlora.engine.sched.scheduler import SchedulerOutput


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
    # Rows whose logits score the next prompt token (SamplingParams.prompt_logprobs): the
    # row, the index of its sequence among the scheduled ones, and its position.
    prompt_rows: list[int] = field(default_factory=list)
    prompt_row_seqs: list[int] = field(default_factory=list)
    prompt_row_positions: list[int] = field(default_factory=list)
    # KV groups 1.. of a model with several (engine/sched/grouped_block_manager.py): per
    # group, the slot of every row and the block table of every sequence (-1: a page behind
    # a sliding window, never read); empty with one group.
    group_slot_mapping: list[list[int]] = field(default_factory=list)  # [G - 1][T]
    group_block_tables: list[list[list[int]]] = field(default_factory=list)  # [G - 1][B][pages]
    state_slots: list[int] = field(default_factory=list)  # [B]: hybrid models' state slots

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


def mirror_groups(step: StepInputs, groups: int) -> StepInputs:
    """``step`` with group 0's slots and block tables given to KV groups 1..``groups - 1``
    too, for synthetic steps written for one group (profiling, warm-up) that read and write
    pages every group has; a step that has its groups' fields is returned as it is."""
    if groups <= 1 or step.group_slot_mapping:
        return step
    return replace(step, group_slot_mapping=[list(step.slot_mapping)] * (groups - 1),
                   group_block_tables=[[list(t) for t in step.block_tables]] * (groups - 1))


def build_step_inputs(
    sched: SchedulerOutput, adapter_slots: list[int], block_size: int,
    fed_rows: list[int | None] | None = None,
) -> StepInputs:
    """Flatten ``sched``; ``adapter_slots[i]`` is the slot of scheduled sequence i (-1: none).
    ``fed_rows[i]`` (a step launched ahead): the previous step's row whose sampled token is
    sequence i's first input, which only the device has yet; its input id is ``-1 - row``
    (None: the host has the sequence's tokens)."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    adapters: list[int] = []
    tables: list[list[int]] = []
    seq_lens: list[int] = []
    qsl = [0]
    logits_idx: list[int] = []
    prompt_rows: list[int] = []
    prompt_row_seqs: list[int] = []
    prompt_row_positions: list[int] = []
    groups = len(sched.scheduled[0].seq.group_tables) if sched.scheduled else 0
    group_slots: list[list[int]] = [[] for _ in range(groups)]
    group_tables: list[list[list[int]]] = [[] for _ in range(groups)]
    rows = 0  # tokens so far: qsl[-1]
    for k, (item, slot) in enumerate(zip(sched.scheduled, adapter_slots, strict=True)):
        seq, n = item.seq, item.num_tokens
        start = seq.num_computed
        table = seq.block_table
        fed = fed_rows[k] if fed_rows is not None else None
        off = seq.position_offset  # rotary rows (LongRoPE); pages use the true positions
        if n == 1:  # a decode: one token, the common case
            ids.append(seq.token_ids[start] if fed is None else -1 - fed)
            pos.append(start + off)
            slots.append(table[start // block_size] * block_size + start % block_size)
            adapters.append(slot)
        else:
            ids.extend(seq.token_ids[start : start + n])
            if fed is not None:
                ids[rows] = -1 - fed
            end = start + n
            pos.extend(range(start + off, end + off))
            # Slots page by page (C-level ranges, not a Python step per token).
            for page in range(start // block_size, (end - 1) // block_size + 1):
                base = table[page] * block_size - page * block_size
                slots.extend(range(base + max(start, page * block_size),
                                   base + min(end, (page + 1) * block_size)))
            adapters.extend([slot] * n)
        tables.append(list(table))
        for g in range(groups):
            gt = seq.group_tables[g]
            group_slots[g].extend(gt[p // block_size] * block_size + p % block_size
                                  for p in range(start, start + n))
            group_tables[g].append(list(gt))
        seq_lens.append(start + n)
        if seq.params.prompt_logprobs is not None:
            # Position p scores prompt token p + 1; positions scored before (a recompute
            # after preemption) are not scored again.
            for p in range(max(start, len(seq.prompt_logprobs)),
                           min(start + n, seq.num_prompt_tokens - 1)):
                prompt_rows.append(rows + p - start)
                prompt_row_seqs.append(k)
                prompt_row_positions.append(p)
        rows += n
        qsl.append(rows)
        if item.samples:
            logits_idx.append(rows - 1)
    return StepInputs(ids, pos, slots, adapters, tables, seq_lens, qsl, logits_idx,
                      prompt_rows, prompt_row_seqs, prompt_row_positions, group_slots,
                      group_tables, [item.seq.state_slot for item in sched.scheduled])
