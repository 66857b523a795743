"""CUDA graphs for decode steps: one graph per padded batch size, replayed with new inputs.

A decode step of B sequences runs the graph of the smallest bucket >= B. Its inputs live in
static buffers; rows B..bucket-1 are padding: token 0 at position 0, KV slot -1 (nothing is
written), a one-token context on page 0, and no adapter. Every op treats rows independently,
so padding changes no real row; under ``batch_invariant`` a row's bits also do not depend on
the row count, so a replay gives the bits of the eager step (tests/gpu proves it).

``max_seq_len`` is fixed at capture to the engine's ``max_model_len``: kernels may only use
it as an upper bound. Adapter groups are built outside the graph (grouping needs a host
sync on the device), so they are computed on the host from the step's adapter slots and
copied with the other inputs: one int64, one int32 and one block-table copy per step, from
pinned host buffers.

The LoRA kernels launch programs for every adapter group a step could have (one per slot, and
the rows without an adapter): with many slots and few of them in a step, most programs find
no work, and they still cost time. With more than ``NARROW_FROM_SLOTS`` slots each bucket gets
a second graph launched for ``NARROW_GROUPS`` groups (its views take the first groups only;
the groups with rows come first), which a step replays when its rows use no more; where a
program computes a group never changes its bits.

Hybrid models (``mamba_chunk_size``): each row's state slot, position and chunk item are
staged too (one more int32 copy); a decode plan lists every row in every launch, whose
kernels skip what a row does not need. Padding rows use ``junk_state_slot``, a slot no
sequence holds, at position 0 (which reads nothing from it).

A step launched before the previous one was read (the engine runs one step ahead) does not
know its input tokens yet: a negative input id ``-1 - r`` means "the token sampled for row r
of the previous step", which the engine leaves in ``feed`` on the device. The graph gathers
every row's input id from ``[feed | staged ids]`` (one index per row), so it needs no host
round trip.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from detlora.engine.runner.adapter_group_layout import AdapterGroupLayout
from detlora.engine.runner.copy_fence import CopyFence
from detlora.engine.runner.graph_capture import Forward, capture_bucket
from detlora.engine.runner.step_inputs import StepInputs
from detlora.layers.forward_batch import (
    AttentionMetadata,
    ForwardBatch,
    LoRABatch,
    MambaMetadata,
)
from detlora.ops.adapter_groups import row_tile_room
from detlora.ops.chunk_plan import ITEM_FIELDS, ChunkPlan, decode_rows

# With more adapter slots than this, every bucket also gets a graph launched for
# ``NARROW_GROUPS`` adapter groups: one adapter, with or without rows that use none.
NARROW_FROM_SLOTS = 8
NARROW_GROUPS = 2


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16 up to max_num_seqs."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        *,
        device: torch.device,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        num_adapters: int | None,  # adapter slots, None without LoRA
        kv_groups: int = 1,  # KV page groups of the model (models/layer_spec.py)
        mamba_chunk_size: int | None = None,  # hybrid models: their chunk grid
        junk_state_slot: int = 0,  # hybrid models: the state slot of padding rows
    ) -> None:
        self.forward = forward
        self.device = device
        self.buckets = graph_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.num_adapters = num_adapters
        n = self.buckets[-1]
        self.max_groups = min(n, num_adapters + 1) if num_adapters is not None else 0
        # Every per-row input lives in one int64 and one int32 buffer (plus the block table),
        # staged in pinned host twins: a step costs three host-to-device copies.
        # int64 [5n]: feed (written on the device), then the staged rows input_ids,
        # positions, slot_mapping, id_index (where each row's input id sits in feed + ids).
        # int32: seq_lens [n], token_adapter [n], sorted_rows [n], then group_start,
        # group_size, group_adapter [max_groups each], then the expands' row tiles.
        tiles = 0 if num_adapters is None else row_tile_room(n, num_adapters)
        n32 = 3 * n + 3 * self.max_groups + tiles
        self._i64 = torch.zeros(5 * n, dtype=torch.int64, device=device)
        self._i32 = torch.zeros(n32, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        pin = device.type == "cuda"
        self._h64 = torch.zeros(4, n, dtype=torch.int64, pin_memory=pin)
        self._h32 = torch.zeros(n32, dtype=torch.int32, pin_memory=pin)
        self._htables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
        self._fence = CopyFence()  # the host twins are refilled only after their copies ran
        self._h64[2] = -1  # slot_mapping: padding rows write no KV
        self._h64[3] = torch.arange(n, 2 * n)  # id_index: every row its staged id
        self._h32[:n] = 1  # seq_lens: a one-token context
        self._h32[n: 2 * n] = -1  # token_adapter: no adapter
        self._staged64 = self._i64[n:].view(4, n)
        self._staged64.copy_(self._h64)
        self._i32.copy_(self._h32)
        # KV groups 1..: each row's slot and each sequence's pages (padding: slot -1, page 0).
        extra = kv_groups - 1
        self.group_slots = torch.full((extra, n), -1, dtype=torch.int64, device=device)
        self.group_tables = torch.zeros(extra, n, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        self._hgslots = torch.full((extra, n), -1, dtype=torch.int64, pin_memory=pin)
        self._hgtables = torch.zeros(extra, n, max_blocks_per_seq, dtype=torch.int32,
                                     pin_memory=pin)
        self.feed = self._i64[:n]
        self._id_pool = self._i64[: 2 * n]
        self.input_ids, self.positions, self.slot_mapping, self.id_index = \
            self._staged64.unbind(0)
        self.seq_lens = self._i32[:n]
        self.token_adapter = self._i32[n: 2 * n]
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        self.group_layout = None if num_adapters is None else AdapterGroupLayout(
            token_adapter_at=n, sorted_rows_at=2 * n, groups_at=3 * n,
            max_groups=self.max_groups, num_adapters=num_adapters,
            row_tiles_at=3 * n + 3 * self.max_groups)
        self.mamba_chunk_size = mamba_chunk_size
        self.junk_state_slot = junk_state_slot
        if mamba_chunk_size is not None:
            # int32 [11n]: state_slots [n], seq_start [n], items [n, 7], first tiles [n, 2].
            self._m32 = torch.zeros(11 * n, dtype=torch.int32, device=device)
            self._hm32 = torch.zeros(11 * n, dtype=torch.int32, pin_memory=pin)
            self._stage_mamba([], [], 0, n)
            self._m32.copy_(self._hm32)
            self._m_index = torch.arange(n + 1, dtype=torch.int32, device=device)
            self._m_none = torch.zeros(0, 2, dtype=torch.int32, device=device)
        # Graphs and outputs by (bucket, groups launched: None = every group the bucket can
        # have).
        self.graphs: dict[tuple[int, int | None], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int | None], tuple[torch.Tensor, ...]] = {}
        self.pool: object | None = None  # the graphs' memory pool, once captured
        self.last_replayed: tuple[int, int | None] | None = None  # the last run's graph

    def graph_keys(self) -> list[tuple[int, int | None]]:
        """(bucket, groups) of every graph to capture: each bucket's, and its narrow one
        where the bucket can hold more than ``NARROW_GROUPS`` groups of many slots."""
        keys: list[tuple[int, int | None]] = [(b, None) for b in self.buckets]
        if self.num_adapters is not None and self.num_adapters > NARROW_FROM_SLOTS:
            keys += [(b, NARROW_GROUPS) for b in self.buckets
                     if min(b, self.num_adapters + 1) > NARROW_GROUPS]
        return keys

    def _batch(self, b: int, groups: int | None = None) -> ForwardBatch:
        # Inside the graph: each row's input id, staged or fed by the previous step.
        input_ids = self._id_pool.index_select(0, self.id_index[:b])
        attn = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            group_slot_mapping=self.group_slots[:, :b] if len(self.group_slots) else None,
            group_block_tables=self.group_tables[:, :b] if len(self.group_tables) else None,
        )
        lora = None
        if self.group_layout is not None:
            lora = LoRABatch(self.group_layout.views(self._i32, b, groups))
        mamba = None
        if self.mamba_chunk_size is not None:
            n, index = self.buckets[-1], self._m_index
            items = self._m32[2 * n: 2 * n + ITEM_FIELDS * n].view(n, ITEM_FIELDS)
            tiles = self._m32[9 * n: 11 * n].view(n, 2)
            plan = ChunkPlan(self.mamba_chunk_size, items[:b], index[: b + 1], tiles[:b],
                             self._m_none, index[:b], index[:b], 0)
            mamba = MambaMetadata(self._m32[:b], self._m32[n: n + b],
                                  self.query_start_loc[: b + 1], index[:b], plan)
        return ForwardBatch(input_ids, self.positions[:b], attn,
                            self.logits_indices[:b], lora, mamba)

    def _stage_mamba(self, positions: list[int], slots: list[int], b: int,
                     bucket: int) -> None:
        """Rows [0, b) of a decode step and padding rows [b, bucket) into the host twin."""
        n = self.buckets[-1]
        pad = bucket - b
        positions = list(positions) + [0] * pad
        slots = list(slots) + [self.junk_state_slot] * pad
        items, tiles = decode_rows(positions, slots, self.mamba_chunk_size)
        h = self._hm32.numpy()
        h[:bucket] = slots
        h[n: n + bucket] = positions
        h[2 * n: 2 * n + ITEM_FIELDS * bucket] = items
        h[9 * n: 9 * n + 2 * bucket] = tiles

    def capture(self, captured: Callable[[], object] | None = None) -> None:
        """Capture every graph of ``graph_keys``, largest bucket first, sharing one memory
        pool; ``captured`` is called after each (a progress bar's tick)."""
        pool = self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for key in sorted(self.graph_keys(), key=lambda k: (-k[0], k[1] or 0)):
            b, groups = key
            if self.group_layout is not None:  # every row without an adapter
                self.group_layout.stage(self._h32.numpy(), [-1] * b)
                self._i32.copy_(self._h32)
            self.graphs[key], self.outputs[key] = capture_bucket(
                self.forward, lambda b=b, groups=groups: self._batch(b, groups), pool=pool,
                stream=stream, device=self.device)
            if captured is not None:
                captured()
        torch.cuda.synchronize(self.device)

    def bucket_for(self, num_seqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def set_feed(self, tokens: torch.Tensor) -> None:
        """Leave the tokens just sampled (row r: the token of the step's row r) on the device
        for the next step's fed rows."""
        self.feed[: tokens.numel()].copy_(tokens.reshape(-1), non_blocking=True)

    def close(self) -> None:
        """Free every captured graph and its outputs now (their pool's memory goes back to
        the caching allocator once no graph of the pool is left)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    def run(self, step: StepInputs) -> tuple[torch.Tensor, ...]:
        """Replay the decode graph for ``step`` (every sequence one token); the forward's
        outputs (row-major: one row per sequence), cut to the step's rows."""
        bucket = self.bucket_for(step.num_seqs)
        if bucket is None or (bucket, None) not in self.graphs:
            raise ValueError(f"no decode graph for {step.num_seqs} sequences")
        key = self.last_replayed = self.key_for(bucket, self.stage(step, bucket))
        self.graphs[key].replay()
        return tuple(t[: step.num_seqs] for t in self.outputs[key])

    def key_for(self, bucket: int, used_groups: int) -> tuple[int, int | None]:
        """The graph a step of ``bucket`` whose rows use ``used_groups`` adapter groups
        replays: the bucket's narrow one where it has one and they fit, else its own."""
        narrow = (bucket, NARROW_GROUPS)
        if used_groups <= NARROW_GROUPS and narrow in self.graphs:
            return narrow
        return (bucket, None)

    def stage(self, step: StepInputs, bucket: int) -> int:
        """Copy ``step``'s inputs, padded to ``bucket`` rows, into the static buffers; returns
        how many adapter groups have rows (0 without LoRA)."""
        b = step.num_seqs
        self._fence.wait()
        pad = bucket - b
        h64, h32, tables = self._h64.numpy(), self._h32.numpy(), self._htables.numpy()
        n = self.buckets[-1]
        ids = step.input_ids
        h64[0, :bucket] = [max(t, 0) for t in ids] + [0] * pad
        h64[1, :bucket] = step.positions + [0] * pad
        h64[2, :bucket] = step.slot_mapping + [-1] * pad
        # A fed row (-1 - r) reads feed[r]; the others their staged id at n + row.
        h64[3, :bucket] = [n + i if t >= 0 else -1 - t for i, t in enumerate(ids)] + \
            list(range(n + b, n + bucket))
        h32[:bucket] = step.seq_lens + [1] * pad
        width = max(len(row) for row in step.block_tables)
        for i, row in enumerate(step.block_tables):
            tables[i, : len(row)] = row
        tables[b:bucket, 0] = 0  # padding rows: a one-token context on page 0
        gslots, gtables = self._hgslots.numpy(), self._hgtables.numpy()
        for g, (slots, group) in enumerate(zip(step.group_slot_mapping,
                                               step.group_block_tables, strict=True)):
            gslots[g, :bucket] = slots + [-1] * pad
            for i, row in enumerate(group):
                gtables[g, i, : len(row)] = row
            gtables[g, b:bucket, 0] = 0
        used = 0
        if self.group_layout is not None:
            used = self.group_layout.stage(h32, step.token_adapter + [-1] * pad)
        self._staged64[:, :bucket].copy_(self._h64[:, :bucket], non_blocking=True)
        self._i32.copy_(self._h32, non_blocking=True)
        self.block_tables[:bucket, :width].copy_(self._htables[:bucket, :width],
                                                 non_blocking=True)
        if len(self.group_slots):
            self.group_slots[:, :bucket].copy_(self._hgslots[:, :bucket], non_blocking=True)
            self.group_tables[:, :bucket, :width].copy_(self._hgtables[:, :bucket, :width],
                                                        non_blocking=True)
        if self.mamba_chunk_size is not None:
            self._stage_mamba(step.positions, step.state_slots, b, bucket)
            self._m32.copy_(self._hm32, non_blocking=True)
        if self.device.type == "cuda":
            self._fence.record()
        return used
