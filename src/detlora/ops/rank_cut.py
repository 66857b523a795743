"""Where a row's best-first prefix stops, found by radix selection: no sort.

Semantics:
    logits: [N, V] fp32, bf16 or fp16 (the ranking), probs: fp32 [N, V] or None (unit
    weights), limit: int64 [N], within: int64 [N] token ids or None. Returns int64 [N]: per
    row the token id ``c`` of the last rank kept (``rank_cut_ref`` below):

        sorted_logits, order = torch.sort(logits, -1, descending=True, stable=True)
        w = ones (probs None) or floor(max(probs, 0).double() * 2^40).long()  # NaN -> 0
        before = cumsum(w[order]) - w[order]           # weight ranked strictly before
        R = max(1, (before < limit[:, None]).sum(-1))  # a prefix (w >= 0)
        R = min(R, rank_of(within) + 1)                # when within is given
        c = order[R - 1]

    The ranking is torch.sort's: ties to the lower token id, -0.0 == +0.0, NaN above +inf.
    With unit weights and ``limit = k`` this is top-k's cut; with the probabilities in
    2^-40 fixed point and ``limit = floor(top_p * 2^40)``, top-p's. Integer weight sums
    are exact, so no summation order matters and every row depends on its own inputs only.

Kernel: radix selection on an ordering key (the logit's bits with the sign-magnitude order
turned into an unsigned one: 16 bits for bf16 / fp16, 32 for fp32), 4 bits per pass, most
significant first. The key u* of rank R - 1 is the smallest present key whose weight above
(``G(u)``, the weight of all keys > u) is below the limit. Each pass narrows the candidate
keys to one digit value: one program per (row, chunk of CHUNK tokens) counts and weighs the
candidates per digit (16 bins), and the next launch picks, from the chunk partials (summed
exactly), the lowest digit whose weight above is still below the limit. Program 0 of a row
stores the picked prefix and its weight above for the launch after. A last pass sums the
weight of the tokens tied at u* per chunk, and one program per row walks the tied tokens in
id order (the chunks' exclusive sums, then a ``tl.cumsum`` inside one chunk) to the last one
kept. Launches: 4 (bf16 / fp16) or 8 (fp32) passes + 2, grids (N, NUM_CHUNKS) and (N,).
The vocabulary alone fixes CHUNK and NUM_CHUNKS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import next_power_of_2, row_chunks
from detlora.ops.checks import check_same_device, check_shape, check_tensor

_FIXED_POINT = 1 << 40  # weight unit of a probability (the sampler's top-p mass)
_CHUNK = 2048  # tokens per program of a pass (128256 tokens: 63 chunks)
_MAX_CHUNKS = 512  # chunk partials merged in one register tile
_BLOCK = 128  # tokens per step inside a chunk ([BLOCK, 16] digit tiles in registers)
_DIGIT_BITS = 4
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- reference


def fixed_point_weights(probs: torch.Tensor) -> torch.Tensor:
    """floor(max(p, 0) * 2^40) as int64; NaN counts as 0."""
    p = torch.where(probs > 0, probs, 0.0)  # NaN > 0 is False
    return torch.floor(p.double() * _FIXED_POINT).to(torch.int64)


def rank_cut_ref(
    logits: torch.Tensor, probs: torch.Tensor | None, limit: torch.Tensor,
    within: torch.Tensor | None = None,
) -> torch.Tensor:
    n, vocab = logits.shape
    _, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    if probs is None:
        w = torch.ones(n, vocab, dtype=torch.int64, device=logits.device)
    else:
        w = fixed_point_weights(probs).gather(1, order)
    before = torch.cumsum(w, dim=-1) - w
    kept = (before < limit[:, None]).sum(-1).clamp(min=1)
    if within is not None:
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(vocab, device=logits.device).expand(n, vocab))
        kept = torch.minimum(kept, rank.gather(1, within[:, None])[:, 0] + 1)
    return order.gather(1, (kept - 1)[:, None])[:, 0]


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _order_key(a, KEY_BITS: tl.constexpr):
    """uint32 key in [0, 2^KEY_BITS) ordered as torch.sort orders logits: -0.0 is +0.0, every
    NaN is above +inf. ``a`` holds the raw logits (their own dtype)."""
    f = a.to(tl.float32)  # exact from bf16 / fp16
    if KEY_BITS == 16:
        b = a.to(tl.int16, bitcast=True).to(tl.int32)
        k = tl.where(b >= 0, b, b ^ 0x7FFF)  # negatives: flip the magnitude, stay below 0
        k = tl.where(f == 0.0, 0, k)
        k = tl.where(f != f, 0x7FFF, k)
        u = (k + 0x8000).to(tl.uint32, bitcast=True)
    else:
        b = a.to(tl.int32, bitcast=True)
        k = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
        k = tl.where(f == 0.0, 0, k)
        k = tl.where(f != f, 0x7FFFFFFF, k)
        u = k.to(tl.uint32, bitcast=True) ^ 0x80000000
    return u


@triton.jit
def _weight(probs_ptr, offs, ok, UNIT: tl.constexpr):
    if UNIT:
        return ok.to(tl.int64)
    p = tl.load(probs_ptr + offs, mask=ok, other=0.0)
    # Scaling by 2^40 is exact in fp32 and the conversion truncates: floor for p >= 0.
    return (tl.where(p > 0.0, p, 0.0) * 1099511627776.0).to(tl.int64)


@triton.jit
def _picked_prefix(state_ptr, cnt_ptr, wsum_ptr, row, limit, PASS: tl.constexpr,
                   NUM_PASSES: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                   CHUNKS_P2: tl.constexpr, UNIT: tl.constexpr):
    """(prefix, weight above it) after pass PASS - 1's digit is picked."""
    if PASS == 1:
        prefix = tl.zeros([], dtype=tl.int64)
        above = tl.zeros([], dtype=tl.int64)
    else:
        prefix = tl.load(state_ptr + (row * NUM_PASSES + PASS - 2) * 2)
        above = tl.load(state_ptr + (row * NUM_PASSES + PASS - 2) * 2 + 1)
    ci = tl.arange(0, CHUNKS_P2)
    d = tl.arange(0, 16)
    at = ((row * NUM_PASSES + PASS - 1) * NUM_CHUNKS + ci[:, None]) * 16 + d[None, :]
    ok = (ci < NUM_CHUNKS)[:, None]
    cnt = tl.sum(tl.load(cnt_ptr + at, mask=ok, other=0), axis=0)
    if UNIT:  # noqa: SIM108 (constexpr branches, kept as statements for Triton)
        w = cnt.to(tl.int64)
    else:
        w = tl.sum(tl.load(wsum_ptr + at, mask=ok, other=0), axis=0)
    # Weight above each digit's keys: the prefix's own weight above, plus higher digits.
    above_d = above + (tl.sum(w, axis=0) - tl.cumsum(w, axis=0))
    fits = (cnt > 0) & (above_d < limit)
    lowest = tl.min(tl.where(fits, d, 16), axis=0)
    # limit <= 0 keeps nothing but the best rank: follow the highest digit present.
    highest = tl.max(tl.where(cnt > 0, d, -1), axis=0)
    pick = tl.where(lowest < 16, lowest, highest)
    return prefix * 16 + pick, tl.sum(tl.where(d == pick, above_d, 0), axis=0)


@triton.jit
def _rank_cut_pass_kernel(
    logits_ptr,
    probs_ptr,
    limit_ptr,
    state_ptr,  # int64 [N, NUM_PASSES, 2]: (prefix, weight above) after each pass
    cnt_ptr,  # int32 [N, NUM_PASSES, NUM_CHUNKS, 16]
    wsum_ptr,  # int64 [N, NUM_PASSES, NUM_CHUNKS, 16]
    tie_cnt_ptr,  # int32 [N, NUM_CHUNKS]
    tie_w_ptr,  # int64 [N, NUM_CHUNKS]
    stride_x,
    stride_p,
    stride_limit,
    V: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    KEY_BITS: tl.constexpr,
    NUM_PASSES: tl.constexpr,
    PASS: tl.constexpr,  # NUM_PASSES: the pass over the tokens tied at the picked key
    UNIT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if PASS == 0:
        prefix = tl.zeros([], dtype=tl.int64)  # unused: every token is a candidate
    else:
        limit = tl.load(limit_ptr + row * stride_limit)
        prefix, above = _picked_prefix(state_ptr, cnt_ptr, wsum_ptr, row, limit, PASS,
                                       NUM_PASSES, NUM_CHUNKS, CHUNKS_P2, UNIT)
        if chunk == 0:
            tl.store(state_ptr + (row * NUM_PASSES + PASS - 1) * 2, prefix)
            tl.store(state_ptr + (row * NUM_PASSES + PASS - 1) * 2 + 1, above)
    # Per-(token slot, digit) sums kept in registers across the chunk's blocks and reduced
    # once at the end: no cross-thread reduction per block.
    d = tl.arange(0, 16)
    cnt = tl.zeros([BLOCK, 16], dtype=tl.int32)
    w = tl.zeros([BLOCK, 16], dtype=tl.int64)
    tie_cnt = tl.zeros([BLOCK], dtype=tl.int32)
    tie_w = tl.zeros([BLOCK], dtype=tl.int64)
    shift = KEY_BITS - 4 * (PASS + 1)  # 4-bit digits (unused by the tie pass)
    match = prefix.to(tl.uint32)
    for b in range(CHUNK // BLOCK):
        o = chunk * CHUNK + b * BLOCK + tl.arange(0, BLOCK)
        ok = o < V
        u = _order_key(tl.load(logits_ptr + row * stride_x + o, mask=ok, other=0.0), KEY_BITS)
        if PASS == NUM_PASSES:
            tied = ok & (u == match)
            tie_cnt += tied.to(tl.int32)
            if not UNIT:
                tie_w += tl.where(tied, _weight(probs_ptr + row * stride_p, o, ok, UNIT), 0)
        else:
            if PASS == 0:  # noqa: SIM108 (constexpr branches, kept as statements for Triton)
                live = ok
            else:
                live = ok & ((u >> (shift + 4)) == match)
            hit = live[:, None] & (((u >> shift) & 15).to(tl.int32)[:, None] == d[None, :])
            cnt += hit.to(tl.int32)
            if not UNIT:
                m = _weight(probs_ptr + row * stride_p, o, ok, UNIT)
                w += tl.where(hit, m[:, None], 0)
    if PASS == NUM_PASSES:
        tl.store(tie_cnt_ptr + row * NUM_CHUNKS + chunk, tl.sum(tie_cnt, axis=0))
        if not UNIT:
            tl.store(tie_w_ptr + row * NUM_CHUNKS + chunk, tl.sum(tie_w, axis=0))
    else:
        at = ((row * NUM_PASSES + PASS) * NUM_CHUNKS + chunk) * 16 + d
        tl.store(cnt_ptr + at, tl.sum(cnt, axis=0))
        if not UNIT:
            tl.store(wsum_ptr + at, tl.sum(w, axis=0))


@triton.jit
def _rank_cut_final_kernel(
    logits_ptr,
    probs_ptr,
    limit_ptr,
    within_ptr,
    state_ptr,
    tie_cnt_ptr,
    tie_w_ptr,
    out_ptr,
    stride_x,
    stride_p,
    stride_limit,
    stride_within,
    V: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    KEY_BITS: tl.constexpr,
    NUM_PASSES: tl.constexpr,
    UNIT: tl.constexpr,
    HAS_WITHIN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    limit = tl.load(limit_ptr + row * stride_limit)
    key = tl.load(state_ptr + (row * NUM_PASSES + NUM_PASSES - 1) * 2).to(tl.uint32)
    above = tl.load(state_ptr + (row * NUM_PASSES + NUM_PASSES - 1) * 2 + 1)
    # The tied tokens kept are a prefix of them in id order: find the chunk holding the last
    # one (the last chunk whose first tied token starts below the limit), then walk it.
    ci = tl.arange(0, CHUNKS_P2)
    ok_c = ci < NUM_CHUNKS
    tc = tl.load(tie_cnt_ptr + row * NUM_CHUNKS + ci, mask=ok_c, other=0)
    if UNIT:  # noqa: SIM108 (constexpr branches, kept as statements for Triton)
        tw = tc.to(tl.int64)
    else:
        tw = tl.load(tie_w_ptr + row * NUM_CHUNKS + ci, mask=ok_c, other=0)
    start = above + tl.cumsum(tw, axis=0) - tw
    last = tl.max(tl.where((tc > 0) & (start < limit), ci, -1), axis=0)
    first = tl.min(tl.where(tc > 0, ci, CHUNKS_P2), axis=0)
    last = tl.where(last >= 0, last, first)  # limit <= 0: the first tied token alone
    before = tl.sum(tl.where(ci == last, start, 0), axis=0)
    best = tl.full([], -1, tl.int64)
    first_tied = tl.full([], V, tl.int64)
    for b in range(CHUNK // BLOCK):
        o = last * CHUNK + b * BLOCK + tl.arange(0, BLOCK)
        ok = o < V
        u = _order_key(tl.load(logits_ptr + row * stride_x + o, mask=ok, other=0.0), KEY_BITS)
        tied = ok & (u == key)
        m = tl.where(tied, _weight(probs_ptr + row * stride_p, o, ok, UNIT), 0)
        kept = tied & (before + tl.cumsum(m, axis=0) - m < limit)
        best = tl.maximum(best, tl.max(tl.where(kept, o, -1), axis=0).to(tl.int64))
        first_tied = tl.minimum(first_tied, tl.min(tl.where(tied, o, V), axis=0).to(tl.int64))
        before += tl.sum(m, axis=0)
    cut = tl.where(best >= 0, best, first_tied)
    if HAS_WITHIN:  # keep the earlier-ranked of the two cuts
        w = tl.load(within_ptr + row * stride_within)
        wk = _order_key(tl.load(logits_ptr + row * stride_x + w), KEY_BITS)
        cut = tl.where((wk > key) | ((wk == key) & (w < cut)), w, cut)
    tl.store(out_ptr + row, cut)


# ----------------------------------------------------------------------------- wrapper


def rank_cut_config(vocab: int) -> tuple[int, int, int, int, int]:
    """(CHUNK, NUM_CHUNKS, CHUNKS_P2, BLOCK, num_warps): a function of the vocabulary alone."""
    chunk, num_chunks, _ = row_chunks(vocab, _CHUNK, _MAX_CHUNKS)
    block = min(chunk, _BLOCK)
    return chunk, num_chunks, next_power_of_2(num_chunks), block, 4 if block >= 128 else 1


def _check(logits: object, probs: object, limit: object, within: object):
    logits = check_tensor("logits", logits, ndim=2, dtypes=_LOGIT_DTYPES, unit_last_stride=True)
    n, vocab = logits.shape
    if vocab == 0:
        raise ValueError(f"logits must have at least one column, got {tuple(logits.shape)}")
    tensors = {"logits": logits}
    if probs is not None:
        probs = check_tensor("probs", probs, ndim=2, dtypes=(torch.float32,),
                             unit_last_stride=True)
        check_shape("probs", probs, (n, vocab))
        tensors["probs"] = probs
    tensors["limit"] = limit = check_tensor("limit", limit, ndim=1, dtypes=(torch.int64,))
    check_shape("limit", limit, (n,))
    if within is not None:
        within = check_tensor("within", within, ndim=1, dtypes=(torch.int64,))
        check_shape("within", within, (n,))
        tensors["within"] = within
    check_same_device(**tensors)
    return logits, probs, limit, within


def rank_cut(
    logits: torch.Tensor, probs: torch.Tensor | None, limit: torch.Tensor,
    within: torch.Tensor | None = None,
) -> torch.Tensor:
    """The token id of every row's last kept rank: int64 [N] (see the module doc).

    ``within`` token ids must lie in [0, V): not checked (it would sync the host).
    """
    logits, probs, limit, within = _check(logits, probs, limit, within)
    n, vocab = logits.shape
    dev = logits.device
    out = torch.empty(n, dtype=torch.int64, device=dev)
    if n == 0:
        return out
    chunk, num_chunks, chunks_p2, block, num_warps = rank_cut_config(vocab)
    key_bits = 32 if logits.dtype == torch.float32 else 16
    passes = key_bits // _DIGIT_BITS
    unit = probs is None
    state = torch.empty(n, passes, 2, dtype=torch.int64, device=dev)
    cnt = torch.empty(n, passes, num_chunks, 16, dtype=torch.int32, device=dev)
    wsum = cnt if unit else torch.empty(n, passes, num_chunks, 16, dtype=torch.int64,
                                        device=dev)
    tie_cnt = torch.empty(n, num_chunks, dtype=torch.int32, device=dev)
    tie_w = tie_cnt if unit else torch.empty(n, num_chunks, dtype=torch.int64, device=dev)
    p = logits if unit else probs
    common = dict(V=vocab, CHUNK=chunk, BLOCK=block, NUM_CHUNKS=num_chunks,
                  CHUNKS_P2=chunks_p2, KEY_BITS=key_bits, NUM_PASSES=passes, UNIT=unit,
                  num_warps=num_warps)
    for pass_ in range(passes + 1):
        _rank_cut_pass_kernel[(n, num_chunks)](
            logits, p, limit, state, cnt, wsum, tie_cnt, tie_w,
            logits.stride(0), p.stride(0), limit.stride(0), PASS=pass_, **common,
        )
    has_within = within is not None
    _rank_cut_final_kernel[(n,)](
        logits, p, limit, within if has_within else limit, state, tie_cnt, tie_w, out,
        logits.stride(0), p.stride(0), limit.stride(0),
        within.stride(0) if has_within else 0, HAS_WITHIN=has_within, **common,
    )
    return out


__all__ = ["fixed_point_weights", "rank_cut", "rank_cut_config", "rank_cut_ref"]
