"""Causal attention over a paged KV cache with grouped-query heads (prefill, chunked
prefill, cached prefix and decode in one op), and the KV write into pages.

Semantics:
    KV cache pages: k_cache, v_cache: [num_blocks, block_size, Hk, D].
    A batch of B sequences flattened into T query tokens: sequence b owns query rows
    query_start_loc[b]:query_start_loc[b+1] (q_len_b of them), which are its *last* q_len_b
    positions: context length seq_lens[b] counts cached tokens plus the new ones, whose K/V
    were already written with ``write_kv``. Token at position p of sequence b lives in page
    block_tables[b, p // block_size], slot p % block_size.

        write_kv(k, v, k_cache, v_cache, slot_mapping):   # slot = page * block_size + offset
            for t, slot in enumerate(slot_mapping):        # slot < 0: padding, skipped
                k_cache.view(-1, Hk, D)[slot] = k[t]; v_cache.view(-1, Hk, D)[slot] = v[t]

        paged_attention(q [T, Hq, D], k_cache, v_cache, block_tables [B, max_blocks],
                        seq_lens [B], query_start_loc [B + 1], scale) -> out [T, Hq, D]:
            query j of sequence b sits at position p = seq_lens[b] - q_len_b + j and attends
            to positions 0..p (causal); head h reads KV head h // (Hq // Hk);
            out = softmax(scale * q . K^T) @ V, fp32 accumulation, cast to q.dtype.

    Batch invariance: a query row's bits depend only on its own KV, visited in blocks of a
    fixed size in position order (any split of the KV axis falls at fixed positions and is
    merged in order). So the same query gives the same bits in a prefill, in a chunk of a
    chunked prefill, after a cached prefix, or in a decode step.
"""

from __future__ import annotations

import torch


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    slots = slot_mapping.long()
    keep = slots >= 0
    hk, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, hk, d)[slots[keep]] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, hk, d)[slots[keep]] = v[keep].to(v_cache.dtype)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    _, hq, d = q.shape
    block_size, hk = k_cache.shape[1], k_cache.shape[2]
    group = hq // hk
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for b, ctx in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        q_len = hi - lo
        if q_len == 0:
            continue
        n_pages = -(-ctx // block_size)
        pages = block_tables[b, :n_pages].long()
        keys = k_cache[pages].reshape(-1, hk, d)[:ctx].float()  # [ctx, Hk, D]
        vals = v_cache[pages].reshape(-1, hk, d)[:ctx].float()
        keys = keys.repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        vals = vals.repeat_interleave(group, dim=1)
        qb = q[lo:hi].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qb, keys) * scale
        pos_q = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        pos_k = torch.arange(ctx, device=q.device)[None, :]
        scores = scores.masked_fill((pos_k > pos_q)[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, vals).to(q.dtype)
    return out
