"""CUDA graphs for decode steps: one graph per padded batch size, replayed with new inputs.

A decode step of B sequences runs the graph of the smallest bucket >= B. Its inputs live in
static buffers; rows B..bucket-1 are padding: token 0 at position 0, KV slot -1 (nothing is
written), a one-token context on page 0, and no adapter. Every op treats rows independently,
so padding changes no real row; under ``batch_invariant`` a row's bits also do not depend on
the row count, so a replay gives the bits of the eager step (tests/gpu proves it).

``max_seq_len`` is fixed at capture to the engine's ``max_model_len``: kernels may only use
it as an upper bound. Adapter groups are built outside the graph (grouping needs a host
sync) and copied into per-bucket static group tensors before each replay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from detlora.engine.step_inputs import StepInputs
from detlora.models.forward_batch import AttentionMetadata, ForwardBatch, LoRABatch
from detlora.ops.adapter_groups import AdapterGroups, group_tokens


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16 up to max_num_seqs."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        *,
        device: torch.device,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        num_adapters: int | None,  # adapter slots, None without LoRA
    ) -> None:
        self.forward = forward
        self.device = device
        self.buckets = graph_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.num_adapters = num_adapters
        n = self.buckets[-1]
        kw = dict(device=device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, **kw)
        self.positions = torch.zeros(n, dtype=torch.int64, **kw)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, **kw)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, **kw)
        self.seq_lens = torch.ones(n, dtype=torch.int32, **kw)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, **kw)
        self.logits_indices = torch.arange(n, dtype=torch.int64, **kw)
        self.token_adapter = torch.full((n,), -1, dtype=torch.int32, **kw)
        self.groups: dict[int, AdapterGroups] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _batch(self, b: int) -> ForwardBatch:
        attn = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )
        lora = None
        if self.num_adapters is not None:
            lora = LoRABatch(self.groups[b])
        return ForwardBatch(self.input_ids[:b], self.positions[:b], attn,
                            self.logits_indices[:b], lora)

    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for b in reversed(self.buckets):
            if self.num_adapters is not None:
                self.groups[b] = group_tokens(self.token_adapter[:b], self.num_adapters,
                                              validate=False)
            batch = self._batch(b)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.forward(batch)  # warm-up: compiles kernels, grows workspaces
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.forward(batch)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)

    def bucket_for(self, num_seqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def run(self, step: StepInputs) -> torch.Tensor:
        """Replay the decode graph for ``step`` (every sequence one token); logits [B, V]."""
        b = step.num_seqs
        bucket = self.bucket_for(b)
        if bucket is None or bucket not in self.graphs:
            raise ValueError(f"no decode graph for {b} sequences")
        pad = bucket - b
        dev = self.device
        width = self.block_tables.shape[1]

        def put(buf: torch.Tensor, values: list[int], fill: int, dtype: torch.dtype) -> None:
            host = torch.tensor(values + [fill] * pad, dtype=dtype)
            buf[:bucket].copy_(host, non_blocking=True)

        put(self.input_ids, step.input_ids, 0, torch.int64)
        put(self.positions, step.positions, 0, torch.int64)
        put(self.slot_mapping, step.slot_mapping, -1, torch.int64)
        put(self.seq_lens, step.seq_lens, 1, torch.int32)
        put(self.token_adapter, step.token_adapter, -1, torch.int32)
        tables = torch.zeros(bucket, width, dtype=torch.int32)
        for i, row in enumerate(step.block_tables):
            tables[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        self.block_tables[:bucket].copy_(tables.to(dev, non_blocking=True))
        if self.num_adapters is not None:
            fresh = group_tokens(self.token_adapter[:bucket], self.num_adapters, validate=False)
            static = self.groups[bucket]
            for name in ("token_adapter", "sorted_rows", "group_start", "group_size",
                         "group_adapter"):
                getattr(static, name).copy_(getattr(fresh, name))
        self.graphs[bucket].replay()
        return self.outputs[bucket][:b]
