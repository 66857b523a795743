"""CUDA graphs for prefill and mixed steps: one graph per (token bucket, sequence bucket).

An eager step launches a few hundred kernels, and each costs the host tens of microseconds of
Python (argument checks, Triton's launcher), far more than the GPU work of a short prefill
(see docs/decisions.md, "Step graphs"). A step of T tokens from S sequences replays instead
the graph of the smallest captured (Tb >= T, Sb >= S).

Layout of a bucket's inputs (static buffers, views of the largest bucket's):
    tokens 0..T-1        the step's rows, as the eager ForwardBatch has them;
    tokens T..Tb-1       padding: token 0 at position 0, KV slot -1 (nothing is written),
                         no adapter (position 0 because the kernels read cos/sin for padding
                         rows too, and the rotary table has max_model_len rows, possibly
                         fewer than a bucket holds);
    sequences 0..S-1     the step's; sequences S..Sb-1 are empty (no query rows, no context);
    sequence Sb          the padding tokens' own sequence (context = its Tb - T rows, on page
                         0), so every token row belongs to a sequence and query_start_loc
                         ends at Tb, as the attention kernels require.
``max_query_len`` is Tb and ``max_seq_len`` the engine's ``max_model_len`` (upper bounds
only). Every op treats rows independently, so padding changes no real row; under
``batch_invariant`` a row's bits do not depend on the row count either, so a replay gives
the eager step's bits (tests/gpu proves it). The logits rows are the step's
``logits_indices``, padded with row 0.

Rows fed from the previous step (input id ``-1 - r``: the token sampled for its row r, which
the engine leaves in ``feed``) are gathered inside the graph, as in the decode graphs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from detlora.engine.runner.adapter_group_layout import AdapterGroupLayout
from detlora.engine.runner.copy_fence import CopyFence
from detlora.engine.runner.graph_capture import Forward, capture_bucket
from detlora.engine.runner.step_inputs import StepInputs, mirror_groups
from detlora.layers.forward_batch import AttentionMetadata, ForwardBatch, LoRABatch
from detlora.ops.adapter_groups import HOST_NUMPY_ROWS, row_tile_room

TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
# Up to 256 sequences, so that an arrival beside many running sequences still replays a graph.
SEQ_BUCKETS = (1, 4, 16, 64, 128, 256)
# Larger steps: hundreds of short prompts admitted at once (a 256-sequence step of 15-token
# prompts holds 3,840 tokens), captured with the largest sequence bucket only (a step of few
# long prompts pads with empty sequences, which cost a program each and no work).
LARGE_TOKEN_BUCKETS = (4096, 8192)


def step_graph_buckets(max_num_batched_tokens: int, max_num_seqs: int) -> list[tuple[int, int]]:
    """(token bucket, sequence bucket) pairs to capture, smallest first: tokens up to
    ``max_num_batched_tokens`` (and 8192), sequences up to ``max_num_seqs`` (and 256); the
    token buckets above 2048 with the largest sequence bucket only."""
    tokens = [t for t in TOKEN_BUCKETS if t <= max_num_batched_tokens]
    seqs = [s for s in SEQ_BUCKETS if s <= max_num_seqs]
    buckets = [(t, s) for t in tokens for s in seqs if s <= t]
    if seqs:
        buckets += [(t, seqs[-1]) for t in LARGE_TOKEN_BUCKETS if t <= max_num_batched_tokens]
    return buckets


class StepGraphs:
    def __init__(
        self,
        forward: Forward,
        *,
        device: torch.device,
        feed: torch.Tensor,  # int64: the tokens the previous step sampled, one per row
        buckets: list[tuple[int, int]],
        block_size: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        num_adapters: int | None,  # adapter slots, None without LoRA
        kv_groups: int = 1,  # KV page groups of the model (models/layer_spec.py)
        hidden: torch.Tensor | None = None,  # [t_max, H]: where ``forward`` leaves the rows'
        # final hidden states (model_runner.step_forward), for prompt logprobs
    ) -> None:
        if not buckets:
            raise ValueError("StepGraphs needs at least one (tokens, sequences) bucket")
        self.forward = forward
        self.device = device
        self.feed = feed
        self.buckets = sorted(buckets)
        self.max_model_len = max_model_len
        self.num_adapters = num_adapters
        t = self.t_max = max(b[0] for b in self.buckets)
        s = self.s_max = max(b[1] for b in self.buckets)
        self.max_groups = min(t, num_adapters + 1) if num_adapters is not None else 0
        # The padding sequence may be as long as a whole bucket, whatever max_model_len.
        width = max(max_blocks_per_seq, -(-t // block_size))
        # int64 [4t + s]: input ids, positions, slot_mapping, fed source (-1: staged id),
        # then logits_indices. int32: token_adapter [t], sorted_rows [t], group_start,
        # group_size, group_adapter [max_groups each], seq_lens [s + 1],
        # query_start_loc [s + 2], then the expands' row tiles.
        g = self.max_groups
        tiles_at = 2 * t + 3 * g + (s + 1) + (s + 2)
        self._n32 = tiles_at + (0 if num_adapters is None else row_tile_room(t, num_adapters))
        self._i64 = torch.zeros(4 * t + s, dtype=torch.int64, device=device)
        self._i32 = torch.zeros(self._n32, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(s + 1, width, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._h64 = torch.zeros(4 * t + s, dtype=torch.int64, pin_memory=pin)
        self._h32 = torch.zeros(self._n32, dtype=torch.int32, pin_memory=pin)
        self._htables = torch.zeros(s + 1, width, dtype=torch.int32, pin_memory=pin)
        self._fence = CopyFence()  # the host twins are refilled only after their copies ran
        rows = self._i64[: 4 * t].view(4, t)
        self.input_ids, self.positions, self.slot_mapping, self.fed_src = rows.unbind(0)
        self.logits_indices = self._i64[4 * t:]
        self.token_adapter = self._i32[:t]
        self._groups_at = 2 * t
        self.group_layout = None if num_adapters is None else AdapterGroupLayout(
            token_adapter_at=0, sorted_rows_at=t, groups_at=2 * t, max_groups=g,
            num_adapters=num_adapters, row_tiles_at=tiles_at)
        self.seq_lens = self._i32[2 * t + 3 * g: 2 * t + 3 * g + s + 1]
        self.query_start_loc = self._i32[2 * t + 3 * g + s + 1:]
        # KV groups 1..: each row's slot and each sequence's pages (padding: slot -1, page 0).
        extra = kv_groups - 1
        self.group_slots = torch.full((extra, t), -1, dtype=torch.int64, device=device)
        self.group_tables = torch.zeros(extra, s + 1, width, dtype=torch.int32, device=device)
        self._hgslots = torch.full((extra, t), -1, dtype=torch.int64, pin_memory=pin)
        self._hgtables = torch.zeros(extra, s + 1, width, dtype=torch.int32, pin_memory=pin)
        self.hidden = hidden
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    # ---- buckets ----

    def bucket_for(self, step: StepInputs) -> tuple[int, int] | None:
        """The smallest captured bucket that holds ``step``, or None (run it eagerly)."""
        t, s = step.num_tokens, step.num_seqs
        for tb, sb in self.buckets:
            if tb >= t and sb >= s:
                return (tb, sb)
        return None

    # ---- the graph's view of the buffers ----

    def batch(self, tb: int, sb: int) -> ForwardBatch:
        """The ForwardBatch a (tb, sb) graph computes on: views of the static buffers."""
        fed_src = self.fed_src[:tb]
        fed = self.feed.index_select(0, fed_src.clamp(min=0))
        input_ids = torch.where(fed_src >= 0, fed, self.input_ids[:tb])
        attn = AttentionMetadata(
            slot_mapping=self.slot_mapping[:tb],
            block_tables=self.block_tables[: sb + 1],
            seq_lens=self.seq_lens[: sb + 1],
            query_start_loc=self.query_start_loc[: sb + 2],
            max_query_len=tb,
            max_seq_len=self.max_model_len,
            group_slot_mapping=self.group_slots[:, :tb] if len(self.group_slots) else None,
            group_block_tables=self.group_tables[:, : sb + 1] if len(self.group_tables)
            else None,
        )
        lora = None
        if self.group_layout is not None:
            lora = LoRABatch(self.group_layout.views(self._i32, tb))
        return ForwardBatch(input_ids, self.positions[:tb], attn, self.logits_indices[:sb],
                            lora)

    # ---- staging ----

    def stage(self, step: StepInputs, bucket: tuple[int, int]) -> None:
        """Copy ``step``'s inputs, padded to ``bucket`` (see the module docstring)."""
        tb, sb = bucket
        t, s, n = step.num_tokens, step.num_seqs, len(step.logits_indices)
        if t > tb or s > sb or n > sb:
            raise ValueError(f"a step of {t} tokens and {s} sequences does not fit bucket "
                             f"{bucket}")
        self._fence.wait()
        pad = tb - t
        tmax = self.t_max
        h64, h32, tables = self._h64.numpy(), self._h32.numpy(), self._htables.numpy()
        # Whole rows at a time (numpy converts the lists in C): a step of thousands of
        # prompt tokens costs no Python step per token.
        ids = np.asarray(step.input_ids, dtype=np.int64)
        np.maximum(ids, 0, out=h64[0:t])
        h64[t:tb] = 0
        h64[tmax: tmax + t] = step.positions
        h64[tmax + t: tmax + tb] = 0
        h64[2 * tmax: 2 * tmax + t] = step.slot_mapping
        h64[2 * tmax + t: 2 * tmax + tb] = -1
        fed = h64[3 * tmax: 3 * tmax + tb]
        fed[:t] = np.where(ids < 0, -1 - ids, -1)
        fed[t:] = -1
        h64[4 * tmax: 4 * tmax + n] = step.logits_indices
        h64[4 * tmax + n: 4 * tmax + sb] = 0
        lens_at = self._groups_at + 3 * self.max_groups
        qsl_at = lens_at + self.s_max + 1
        h32[lens_at: lens_at + s] = step.seq_lens
        h32[lens_at + s: lens_at + sb] = 0
        h32[lens_at + sb] = pad
        h32[qsl_at: qsl_at + s + 1] = step.query_start_loc
        h32[qsl_at + s + 1: qsl_at + sb + 1] = t
        h32[qsl_at + sb + 1] = tb
        width = max(len(row) for row in step.block_tables)
        for i, row in enumerate(step.block_tables):
            tables[i, : len(row)] = row
        tables[s: sb + 1, :width] = 0  # empty sequences and the padding one: page 0
        gslots, gtables = self._hgslots.numpy(), self._hgtables.numpy()
        for g, (slots, group) in enumerate(zip(step.group_slot_mapping,
                                               step.group_block_tables, strict=True)):
            gslots[g, :tb] = slots + [-1] * pad
            for i, row in enumerate(group):
                gtables[g, i, : len(row)] = row
            gtables[g, s: sb + 1, :width] = 0
        if self.group_layout is not None:
            if tb > HOST_NUMPY_ROWS:  # thousands of rows: numpy from the list on
                slots = np.full(tb, -1, dtype=np.int64)  # padding rows: no adapter
                slots[:t] = step.token_adapter
                self.group_layout.stage(h32, slots)
            else:
                self.group_layout.stage(h32, step.token_adapter + [-1] * pad)
        self._i64.copy_(self._h64, non_blocking=True)
        self._i32.copy_(self._h32, non_blocking=True)
        # Columns past ``width`` keep pages of earlier steps: real rows never read them, and
        # the padding sequence may (garbage in, garbage out, nothing written).
        self.block_tables[: sb + 1, :width].copy_(self._htables[: sb + 1, :width],
                                                  non_blocking=True)
        if len(self.group_slots):
            self.group_slots[:, :tb].copy_(self._hgslots[:, :tb], non_blocking=True)
            self.group_tables[:, : sb + 1, :width].copy_(self._hgtables[:, : sb + 1, :width],
                                                         non_blocking=True)
        if self.device.type == "cuda":
            self._fence.record()

    # ---- capture and replay ----

    def capture(self, pool: object, captured: Callable[[], object] | None = None) -> None:
        """Capture every bucket, largest first, in the memory pool ``pool``; ``captured`` is
        called after each (a progress bar's tick)."""
        stream = torch.cuda.Stream(self.device)
        for bucket in reversed(self.buckets):
            self._stage_empty(bucket)
            self.graphs[bucket], self.outputs[bucket] = capture_bucket(
                self.forward, lambda bucket=bucket: self.batch(*bucket), pool=pool,
                stream=stream, device=self.device)
            if captured is not None:
                captured()
        torch.cuda.synchronize(self.device)

    def _stage_empty(self, bucket: tuple[int, int]) -> None:
        """Inputs for capture: one token of sequence 0 (a one-token context), the rest
        padding."""
        step = mirror_groups(StepInputs(
            input_ids=[0], positions=[0], slot_mapping=[-1], token_adapter=[-1],
            block_tables=[[0]], seq_lens=[1], query_start_loc=[0, 1], logits_indices=[0]),
            len(self.group_slots) + 1)
        self.stage(step, bucket)
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Free every captured graph and its outputs now (their pool's memory goes back to
        the caching allocator once no graph of the pool is left)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()

    def hidden_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` of the last replay's final hidden states (a copy, so the next replay
        cannot overwrite them: it is queued after this)."""
        if self.hidden is None:
            raise ValueError("these step graphs keep no hidden states (no hidden buffer)")
        return self.hidden.index_select(0, rows)

    def run(self, step: StepInputs) -> tuple[torch.Tensor, ...]:
        """Replay the graph for ``step``; the forward's outputs cut to the step's logits
        rows."""
        bucket = self.bucket_for(step)
        if bucket is None or bucket not in self.graphs:
            raise ValueError(f"no step graph for {step.num_tokens} tokens of "
                             f"{step.num_seqs} sequences")
        self.stage(step, bucket)
        self.graphs[bucket].replay()
        n = len(step.logits_indices)
        return tuple(o[:n] for o in self.outputs[bucket])
