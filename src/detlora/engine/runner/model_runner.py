"""Runs the model for one scheduled step: KV pages, ForwardBatch, eager or CUDA-graph forward.

The runner owns the paged KV cache (allocated through the model, which binds the per-layer
pages to its attention layers) and, on CUDA unless ``enforce_eager``, the CUDA graphs: a step
where every sequence decodes one token replays the decode graph of its padded batch size
(decode_graphs.py); another step replays the step graph of its padded token and sequence
counts (step_graphs.py) when one holds it, else runs eagerly. It returns the logits of the
rows that sample in the model dtype (the LM head's output, not upcast: the sampler reads it
as it is).

Nothing the runner owns refers back to it (the graphs hold a forward function of the model,
not a bound method of the runner), so dropping the last reference frees the KV cache and the
graphs at once, with no wait for Python's cyclic GC; ``close`` frees them explicitly.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from detlora.engine.runner.decode_graphs import DecodeGraphs
from detlora.engine.runner.eager_warmup import eager_warmup_steps
from detlora.engine.runner.graph_capture import (
    capture_progress,
    describe_capture_failure,
    gc_paused,
)
from detlora.engine.runner.step_graphs import (
    LARGE_TOKEN_BUCKETS,
    StepGraphs,
    step_graph_buckets,
)
from detlora.engine.runner.step_inputs import StepInputs, mirror_groups
from detlora.layers.forward_batch import AttentionMetadata, ForwardBatch, LoRABatch
from detlora.layers.mamba_metadata import build_mamba_metadata
from detlora.ops.adapter_groups import group_tokens


def decode_forward(
    model: torch.nn.Module, greedy_head: Callable[[torch.Tensor], torch.Tensor] | None,
) -> Callable[[ForwardBatch], tuple[torch.Tensor, ...]]:
    """What a decode or step graph computes: the logits, and the greedy head's [B, 3] when
    set (row-wise, so a padded bucket gives every real row its own bits)."""

    def forward(batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        logits = model(batch, upcast=False)
        if greedy_head is None:
            return (logits,)
        return logits, greedy_head(logits)

    return forward


def step_forward(
    model: torch.nn.Module, greedy_head: Callable[[torch.Tensor], torch.Tensor] | None,
    hidden_out: torch.Tensor,
) -> Callable[[ForwardBatch], tuple[torch.Tensor, ...]]:
    """What a step graph computes: ``decode_forward``'s outputs (the same ops: final hidden
    states, then the LM head on the logits rows), and every row's final hidden state copied
    to ``hidden_out[:T]``, where a step whose rows score prompt tokens reads them after the
    replay (prompt logprobs then cost a replay, not an eager step's launches)."""

    def forward(batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        hidden = model.hidden_states(batch)
        hidden_out[: hidden.shape[0]].copy_(hidden)
        logits = model.compute_logits(hidden.index_select(0, batch.logits_indices),
                                      upcast=False)
        if greedy_head is None:
            return (logits,)
        return logits, greedy_head(logits)

    return forward


def step_graph_forward(
    model: torch.nn.Module, greedy_head: Callable[[torch.Tensor], torch.Tensor] | None,
    device: torch.device,
) -> Callable[[int], tuple[Callable[[ForwardBatch], tuple[torch.Tensor, ...]], torch.Tensor]]:
    """For step graphs of up to ``rows`` token rows: their forward (``step_forward``) and the
    [rows, H] buffer it leaves the hidden states in."""

    def make(rows: int) -> tuple[Callable[[ForwardBatch], tuple[torch.Tensor, ...]],
                                 torch.Tensor]:
        hidden = torch.empty(rows, model.spec.hidden_size, dtype=model.dtype, device=device)
        return step_forward(model, greedy_head, hidden), hidden

    return make


class ModelRunner:
    chunk_size: int | None = None  # a hybrid model's chunk grid (None: no Mamba layers)
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        greedy_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        device: torch.device,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        num_adapters: int | None,
        use_cuda_graphs: bool,
        max_num_batched_tokens: int | None = None,  # prefill graphs up to this many tokens
        progress: bool = False,  # a bar over the graph capture (on a terminal)
    ) -> None:
        self.model = model
        self.greedy_head = greedy_head
        # A function of the model and head only: the graphs keep it, and a bound method would
        # make runner -> graphs -> runner a cycle that holds the KV cache until a collection.
        self._decode_forward = decode_forward(model, greedy_head)
        self._step_graph_forward = step_graph_forward(model, greedy_head, device)
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_adapters = num_adapters
        self.kv_cache = model.allocate_kv_cache(num_blocks, block_size)
        # Hybrid models: one state slot per sequence that may run (BlockManager hands them).
        # Slot max_num_seqs: the decode graphs' padding rows (no sequence holds it).
        self.chunk_size = getattr(model, "mamba_chunk_size", None)
        self.state_cache = (model.allocate_state_cache(max_num_seqs + 1)
                            if self.chunk_size is not None else None)
        self.graphs: DecodeGraphs | None = None
        self.step_graphs: StepGraphs | None = None
        self._feed = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.graph_error: str | None = None
        if use_cuda_graphs and device.type == "cuda":
            self._capture(max_num_seqs, max_num_batched_tokens or 0, progress=progress)
            if self.step_graphs is not None:
                self.warm_eager_steps(max_num_seqs, max_num_batched_tokens or 0)

    @property
    def kv_groups(self) -> int:
        """KV page groups of the model (models/layer_spec.py; 1 for a uniform model)."""
        return len(getattr(getattr(self, "model", None), "kv_groups", ())) or 1

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.graphs is not None

    def build_graphs(self, max_num_seqs: int,
                     max_num_batched_tokens: int) -> tuple[DecodeGraphs, StepGraphs | None]:
        """The decode and step graphs' buffers, not captured yet (any device)."""
        graphs = DecodeGraphs(
            self._decode_forward,
            device=self.device,
            max_num_seqs=max_num_seqs,
            max_blocks_per_seq=-(-self.max_model_len // self.block_size),
            max_model_len=self.max_model_len,
            num_adapters=self.num_adapters,
            kv_groups=self.kv_groups,
            mamba_chunk_size=self.chunk_size,
            junk_state_slot=max_num_seqs,
        )
        # Hybrid models' prefill steps run eagerly: their chunk plans vary in length.
        buckets = (step_graph_buckets(max_num_batched_tokens, max_num_seqs)
                   if self.chunk_size is None else [])
        return graphs, self._step_graphs(graphs, buckets)

    def _step_graphs(self, graphs: DecodeGraphs,
                     buckets: list[tuple[int, int]]) -> StepGraphs | None:
        if not buckets:
            return None
        forward, hidden = self._step_graph_forward(max(b[0] for b in buckets))
        return StepGraphs(
            forward, device=self.device,
            feed=graphs.feed, buckets=buckets, hidden=hidden,
            block_size=self.block_size,
            max_blocks_per_seq=-(-self.max_model_len // self.block_size),
            max_model_len=self.max_model_len, num_adapters=self.num_adapters,
            kv_groups=self.kv_groups,
        )

    def _capture(self, max_num_seqs: int, max_num_batched_tokens: int, *,
                 progress: bool = False) -> None:
        graphs, step_graphs = self.build_graphs(max_num_seqs, max_num_batched_tokens)
        steps = len(step_graphs.buckets) if step_graphs is not None else 0
        total = len(graphs.graph_keys()) + steps
        try:
            with torch.inference_mode(), gc_paused(), \
                    capture_progress(total, enabled=progress) as bar:
                graphs.capture(bar.update)
                if step_graphs is not None:
                    step_graphs.capture(graphs.pool, bar.update)
        except Exception as e:  # a kernel that syncs the host cannot be captured
            self.graph_error = describe_capture_failure(e)
            if step_graphs is not None and graphs.graphs.keys() >= set(graphs.graph_keys()):
                # The decode graphs stand; the step graphs' largest buckets may not fit the
                # memory left (their activations): the buckets up to 2048 tokens instead.
                step_graphs.close()
                small = [b for b in step_graphs.buckets if b[0] not in LARGE_TOKEN_BUCKETS]
                self.graphs = graphs
                self.step_graphs = self._retry_step_graphs(graphs, small, progress)
                return
            warnings.warn(
                f"CUDA-graph capture failed, steps run eagerly ({self.graph_error})",
                RuntimeWarning, stacklevel=3,
            )
            torch.cuda.synchronize(self.device)
            return
        self.graphs = graphs
        self.step_graphs = step_graphs

    def _retry_step_graphs(self, graphs: DecodeGraphs, buckets: list[tuple[int, int]],
                           progress: bool) -> StepGraphs | None:
        """Step graphs of ``buckets`` after a failed capture of more; None (those steps run
        eagerly) when none are left or these fail too."""
        torch.cuda.synchronize(self.device)
        step_graphs = self._step_graphs(graphs, buckets)
        if step_graphs is not None:
            try:
                with torch.inference_mode(), gc_paused(), \
                        capture_progress(len(buckets), enabled=progress) as bar:
                    step_graphs.capture(graphs.pool, bar.update)
            except Exception as e:
                self.graph_error = describe_capture_failure(e)
                step_graphs.close()
                step_graphs = None
        warnings.warn(
            f"CUDA-graph capture of the step graphs failed ({self.graph_error}); "
            + (f"steps up to {step_graphs.t_max} tokens replay graphs, larger ones run "
               "eagerly" if step_graphs is not None else "prefill and mixed steps run eagerly"),
            RuntimeWarning, stacklevel=4)
        torch.cuda.synchronize(self.device)
        return step_graphs

    def warm_eager_steps(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Run the steps of ``eager_warmup_steps`` once, so that the eager path's kernel
        variants compile now rather than in the middle of serving; nothing is written."""
        sg = self.step_graphs
        steps = eager_warmup_steps(
            graph_tokens=sg.t_max if sg is not None else 0,
            graph_seqs=sg.s_max if sg is not None else 0,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len, block_size=self.block_size,
            num_adapters=self.num_adapters)
        with torch.inference_mode():
            for step in steps:
                self.model(self.forward_batch(step), upcast=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Free the CUDA graphs (and their memory pool), the KV cache and the device buffers
        now; the runner cannot run steps afterwards."""
        for graphs in (self.step_graphs, self.graphs):
            if graphs is not None:
                graphs.close()
        self.graphs = self.step_graphs = None
        self.model.release_kv_cache()
        self.kv_cache = None
        self.state_cache = None
        self._feed = None

    def forward_batch(self, step: StepInputs) -> ForwardBatch:
        dev = self.device
        step = mirror_groups(step, self.kv_groups)

        def t(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        width = max(len(row) for row in step.block_tables)
        tables = torch.zeros(1 + len(step.group_block_tables), step.num_seqs, width,
                             dtype=torch.int32)
        rows = tables.numpy()
        for g, group in enumerate([step.block_tables, *step.group_block_tables]):
            for i, row in enumerate(group):
                rows[g, i, : len(row)] = row
        tables = tables.to(dev, non_blocking=True)
        attn = AttentionMetadata(
            slot_mapping=t(step.slot_mapping, torch.int64),
            block_tables=tables[0],
            seq_lens=t(step.seq_lens, torch.int32),
            query_start_loc=t(step.query_start_loc, torch.int32),
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            group_slot_mapping=t(step.group_slot_mapping, torch.int64)
            if step.group_slot_mapping else None,
            group_block_tables=tables[1:] if step.group_block_tables else None,
        )
        lora = None
        if self.num_adapters is not None:
            token_adapter = t(step.token_adapter, torch.int32)
            lora = LoRABatch(group_tokens(token_adapter, self.num_adapters, validate=False))
        input_ids = t(step.input_ids, torch.int64)
        if step.input_ids and min(step.input_ids) < 0:  # fed rows (see ``feed``)
            fed = self.fed_tokens.index_select(0, (-1 - input_ids).clamp(min=0))
            input_ids = torch.where(input_ids >= 0, input_ids, fed)
        mamba = None
        if self.chunk_size is not None:
            mamba = build_mamba_metadata(step.query_start_loc, step.seq_lens, step.state_slots,
                                         self.chunk_size, dev,
                                         query_start_loc_tensor=attn.query_start_loc)
        return ForwardBatch(
            input_ids=input_ids,
            positions=t(step.positions, torch.int64),
            attn=attn,
            logits_indices=t(step.logits_indices, torch.int64),
            lora=lora,
            mamba=mamba,
        )

    def feed(self, tokens: torch.Tensor) -> None:
        """The tokens just sampled, kept on the device for a step launched before they are
        read (its input id ``-1 - r`` is ``tokens[r]``)."""
        if self.graphs is not None:
            self.graphs.set_feed(tokens)
        else:
            self._feed[: tokens.numel()].copy_(tokens.reshape(-1))

    @property
    def fed_tokens(self) -> torch.Tensor:
        """What ``feed`` left on the device (int64; row r: the previous step's row r). A step
        launched ahead reads it in its forward and, for penalties, in its sampler: both are
        queued before the next ``feed`` overwrites it."""
        return self.graphs.feed if self.graphs is not None else self._feed

    @torch.inference_mode()
    def prompt_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on rows of ``StepLogits.prompt_hidden``: [rows, V], the model's dtype."""
        return self.model.compute_logits(hidden, upcast=False)

    @torch.inference_mode()
    def execute(self, step: StepInputs, decode_only: bool) -> StepLogits | None:
        """Run one step: logits [len(step.logits_indices), V] in the model's dtype (and, from
        a decode graph, the greedy head's [B, 2]), or None if no row samples and no row scores
        a prompt token. A step with prompt rows replays its step graph, which leaves every row's
        hidden state in a buffer, or runs eagerly past the largest bucket; those rows' hidden
        states come back as ``prompt_hidden``, for
        ``prompt_logits`` a block of rows at a time ([rows, V] logits of a whole prefill chunk
        could take gigabytes)."""
        sg = self.step_graphs
        if step.prompt_rows and sg is not None and sg.bucket_for(step) is not None:
            out = sg.run(step)
            rows = torch.tensor(step.prompt_rows, dtype=torch.int64).to(self.device)
            prompt_hidden = sg.hidden_rows(rows)
            if not step.logits_indices:
                return StepLogits(None, None, prompt_hidden)
            return StepLogits(out[0], out[1] if len(out) > 1 else None, prompt_hidden)
        if step.prompt_rows:
            batch = self.forward_batch(step)
            hidden = self.model.hidden_states(batch)
            logits = None
            if step.logits_indices:
                logits = self.model.compute_logits(
                    hidden.index_select(0, batch.logits_indices), upcast=False)
            rows = torch.tensor(step.prompt_rows, dtype=torch.int64).to(self.device)
            return StepLogits(logits, None, hidden.index_select(0, rows))
        if decode_only and self.graphs is not None and self.graphs.bucket_for(step.num_seqs):
            out = self.graphs.run(step)
            return StepLogits(out[0], out[1] if len(out) > 1 else None)
        if self.step_graphs is not None and self.step_graphs.bucket_for(step) is not None:
            out = self.step_graphs.run(step)
            if not step.logits_indices:
                return None
            return StepLogits(out[0], out[1] if len(out) > 1 else None)
        batch = self.forward_batch(step)
        if not step.logits_indices:
            self.model.hidden_states(batch)  # a prefill chunk: only the KV writes matter
            return None
        return StepLogits(self.model(batch, upcast=False), None)


class StepLogits(NamedTuple):
    logits: torch.Tensor | None  # [N, V], the model's dtype (None: no row samples)
    greedy: torch.Tensor | None  # float64 [N, 2] (Sampler.greedy_head), or None
    prompt_hidden: torch.Tensor | None = None  # [len(step.prompt_rows), H]
