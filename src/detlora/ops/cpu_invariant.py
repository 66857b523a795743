"""Batch-invariant CPU versions of the ops whose torch references are not.

The references compute ``x @ W^T`` and attention with whole-batch BLAS calls. On the CPU
those calls pick their algorithm from the matrix sizes (a different one below 4 rows, and
attention's softmax and ``P @ V`` change with the context length), so the bits of a row change
with the batch, with prefill chunking and between prefill and decode. Here every reduction
runs in calls whose shapes do not depend on the batch:

* GEMMs (linear, LoRA shrink and expand): rows are cut into tiles of ``ROW_TILE`` and
  output columns into tiles of ``COL_TILE`` (the last ones zero-padded); every tile is one
  product of fixed shape ``[ROW_TILE, K] x [K, COL_TILE]``, the column tiles of a row tile
  one ``torch.bmm``. An output element's bits then depend only on its row, its column of W
  and K: not on the batch, and not on how many columns the call computes, so a column shard
  of a layer (tensor parallelism) gets the bits the whole layer gives (CPU BLAS picks other
  kernels for narrow outputs, which a whole-width ``torch.mm`` per tile would expose). CPU
  BLAS computes a tile row the same way wherever it sits in the tile (checked in
  tests/engine).
* grouped linears (``linear_grouped``, ``linear_partials``; see ``detlora.ops.grouped_linear``):
  the same tiles over each K group, fp32 partials added in group order.
* SiLU(gate) * up (``silu_and_mul``): torch's ``silu`` runs the vectorised part of a row
  with one exp and its scalar tail with another, which differ in the last bit for ~4% of
  inputs, so an element's bits depended on its place in the row (and, with threads, on where
  a thread's chunk starts): a tensor-parallel shard moves the MLP's columns to other places.
  Here it is ``g / (1 + exp(-g)) * u``: ``exp`` runs every element through the same vector
  code (a partial last vector, not a scalar tail) and the rest rounds exactly.
* attention: per sequence, the keys are visited in blocks of ``KV_BLOCK`` positions (aligned
  to position 0, not to pages), each block's scores and ``P @ V`` reduced over a fixed-length
  innermost axis, blocks merged in position order with an online softmax. Blocks after a
  query's position (or, with a sliding window, before its window) are fully masked and leave
  its state unchanged exactly (``x * 1 + 0``), so the same query gives the same bits in a
  prefill, a chunk of one, or a decode step, wherever the visit starts.

The engine swaps these into the CPU backend for ``batch_invariant``; the other elementwise ops,
gathers and the row reductions (RMSNorm, log-softmax, argmax) of the references are already
batch-invariant for the hidden and vocabulary sizes a CPU runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from detlora.ops.adapter_groups import AdapterGroups
from detlora.ops.grouped_linear import sum_partials
from detlora.ops.lora_partials import ShrinkPartials, reduce_partials_ref
from detlora.ops.slot_columns import SlotColumns

ROW_TILE = 16
COL_TILE = 16
KV_BLOCK = 16


def _column_tiles(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] as fp32 [ceil(N / COL_TILE), COL_TILE, K], zero rows padding the last tile."""
    n, k = w.shape
    cols = -(-n // COL_TILE)
    w = w.float()
    if n % COL_TILE:
        w = torch.cat([w, w.new_zeros(cols * COL_TILE - n, k)])
    return w.reshape(cols, COL_TILE, k)


def rows_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 ``x [M, K] @ w[N, K]^T`` in fixed ``ROW_TILE`` x ``COL_TILE`` tiles: [M, N] fp32."""
    return _tiled_partials(x, w, 1)[0]


def _tiled_partials(x: torch.Tensor, w: torch.Tensor, groups: int) -> torch.Tensor:
    """fp32 [G, M, N]: group g is ``x[:, Kg-slice g] @ w[:, Kg-slice g]^T`` in fixed tiles."""
    m, k = x.shape
    n = w.shape[0]
    kg = k // groups
    wt = _column_tiles(w).transpose(1, 2)  # [C, K, COL_TILE]
    cols = wt.shape[0]
    out = torch.empty(groups, m, n, dtype=torch.float32, device=x.device)
    tile = torch.zeros(ROW_TILE, k, dtype=torch.float32, device=x.device)
    for lo in range(0, m, ROW_TILE):
        hi = min(lo + ROW_TILE, m)
        tile.zero_()
        tile[: hi - lo] = x[lo:hi]
        for g in range(groups):
            ks = slice(g * kg, (g + 1) * kg)
            part = torch.bmm(tile[:, ks].expand(cols, ROW_TILE, kg), wt[:, ks])  # [C, R, CT]
            out[g, lo:hi] = part.transpose(0, 1).reshape(ROW_TILE, -1)[: hi - lo, :n]
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           *, slot_columns: SlotColumns | None = None) -> torch.Tensor:
    """Same semantics as ``detlora.ops.matmul.linear_ref``. With ``slot_columns`` the base
    columns and each used slot's are separate fixed-shape products (their bits depend neither
    on the number of slots nor on where a slot sits); unused slots' columns are zero."""
    if slot_columns is None:
        return _linear_columns(x, weight, bias)
    first, width = slot_columns.first, slot_columns.width
    y = torch.zeros(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    spans = [(0, first)] + [(first + s * width, first + (s + 1) * width)
                            for s in sorted(set(slot_columns.groups.token_adapter.tolist()))
                            if s >= 0]
    for lo, hi in spans:
        y[:, lo:hi] = _linear_columns(x, weight[lo:hi], None if bias is None else bias[lo:hi])
    return y


def _linear_columns(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    y = rows_matmul(x.float(), weight)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def linear_partials(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Same semantics as ``detlora.ops.grouped_linear.linear_partials_ref``: fp32 [G, M, N]."""
    if weight.shape[1] != x.shape[1] or x.shape[1] % groups:
        raise ValueError(f"groups {groups} must divide K, and x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)} must agree on it")
    return _tiled_partials(x.float(), weight, groups)


def linear_grouped(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, groups: int,
    *, slot_columns: SlotColumns | None = None,
) -> torch.Tensor:
    """Same semantics as ``detlora.ops.grouped_linear.linear_grouped_ref`` (every column
    computed, so the bits are those of the ranks' partials)."""
    del slot_columns
    return sum_partials(linear_partials(x, weight, groups), bias, x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same semantics as ``detlora.ops.silu_and_mul.silu_and_mul_ref``; an element's bits
    depend on its value alone, not on its place in the row."""
    g, u = x.float().chunk(2, dim=-1)
    return torch.div(g, torch.neg(g).exp_().add_(1)).mul_(u).to(x.dtype)


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, groups: AdapterGroups, scale: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same semantics as ``detlora.ops.lora_shrink.lora_shrink_ref``: fp32 [S, M, R]."""
    _, slices, rank, hidden = lora_a.shape
    m = x.shape[0]
    if out is None:
        out = torch.empty(slices, m, rank, dtype=torch.float32, device=x.device)
    out.zero_()
    ids = groups.token_adapter.to(torch.int64)
    for a in torch.unique(ids).tolist():
        if a < 0:
            continue
        rows = (ids == a).nonzero().flatten()
        h = rows_matmul(x[rows].float(), lora_a[a].reshape(slices * rank, hidden))
        out[:, rows] = scale[a].float() * h.view(-1, slices, rank).transpose(0, 1)
    return out


def lora_expand(
    y: torch.Tensor,
    shrink_out: torch.Tensor,
    lora_b: torch.Tensor,
    groups: AdapterGroups,
    slice_offsets: Sequence[int] | None = None,
    slot_ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same semantics as ``detlora.ops.lora_expand.lora_expand_ref`` (in place, returns y).
    Every rank is summed whatever ``slot_ranks`` say: past a slot's rank h and B are zero."""
    if isinstance(shrink_out, ShrinkPartials):
        shrink_out = reduce_partials_ref(shrink_out, groups.token_adapter)
    slices = shrink_out.shape[0]
    if slice_offsets is None:
        width = lora_b.shape[1] // slices
        slice_offsets = [s * width for s in range(slices + 1)]
    ids = groups.token_adapter.to(torch.int64)
    for a in torch.unique(ids).tolist():
        if a < 0:
            continue
        rows = (ids == a).nonzero().flatten()
        for s in range(slices):
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            h = shrink_out[s, rows].to(lora_b.dtype).float()
            y[rows, lo:hi] += rows_matmul(h, lora_b[a, lo:hi]).to(y.dtype)
    return y


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,  # a grid hint of the kernels; no meaning here
    window: int | None = None,
) -> torch.Tensor:
    """Same semantics as ``detlora.ops.paged_attention.paged_attention_ref``."""
    # Imported here: that module defines Triton kernels, which the CPU engine never launches.
    from detlora.ops.paged_attention import sequence_kv, window_start

    _, hq, d = q.shape
    hk = k_cache.shape[2]
    group = hq // hk
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for b, ctx in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        n = hi - lo
        if n == 0:
            continue
        # Keys from the block holding the first query's window start (0 without a window);
        # positions before that start are never read (their pages may be released).
        first = window_start(ctx - n, window)
        base = first // KV_BLOCK * KV_BLOCK
        num_blocks = -(-ctx // KV_BLOCK) - base // KV_BLOCK
        padded = num_blocks * KV_BLOCK
        keys = torch.zeros(padded, hk, d, dtype=torch.float32, device=q.device)
        vals = torch.zeros(padded, hk, d, dtype=torch.float32, device=q.device)
        keys[first - base:ctx - base], vals[first - base:ctx - base] = sequence_kv(
            k_cache, v_cache, block_tables, b, ctx, first)
        # [blocks, H, KV_BLOCK, D] for scores and [blocks, H, D, KV_BLOCK] for P @ V, so both
        # reductions run over the innermost, fixed-length axis.
        keys = keys.repeat_interleave(group, dim=1).view(num_blocks, KV_BLOCK, hq, d)
        vals = vals.repeat_interleave(group, dim=1).view(num_blocks, KV_BLOCK, hq, d)
        keys = keys.permute(0, 2, 1, 3).contiguous()
        vals = vals.permute(0, 2, 3, 1).contiguous()
        qb = q[lo:hi].float()[:, :, None, :]  # [n, H, 1, D]
        pos_q = torch.arange(ctx - n, ctx, device=q.device)[:, None, None]
        m_run = torch.full((n, hq), float("-inf"), dtype=torch.float32, device=q.device)
        l_run = torch.zeros(n, hq, dtype=torch.float32, device=q.device)
        acc = torch.zeros(n, hq, d, dtype=torch.float32, device=q.device)
        for j in range(num_blocks):
            s = (qb * keys[j][None]).sum(-1) * scale  # [n, H, KV_BLOCK]
            pos_k = torch.arange(base + j * KV_BLOCK, base + (j + 1) * KV_BLOCK,
                                 device=q.device)[None, None, :]
            hidden = pos_k > pos_q
            if window is not None:
                hidden |= pos_k <= pos_q - window
            s = s.masked_fill(hidden, float("-inf"))
            m_new = torch.maximum(m_run, s.amax(-1))
            # A row that saw no key yet keeps (-inf, 0, 0) exactly through a block it cannot
            # see either: alpha 1 where the max did not move, exponents taken from 0.
            m_use = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha = torch.where(m_run == m_new, 1.0, torch.exp(m_run - m_use))
            p = torch.exp(s - m_use[..., None])
            l_run = l_run * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + (p[:, :, None, :] * vals[j][None]).sum(-1)
            m_run = m_new
        out[lo:hi] = (acc / l_run[..., None]).to(q.dtype)
    return out
