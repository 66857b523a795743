"""Sampling ops: Gumbel-max over hashed noise, and the temperature / top-k / top-p filter of
``detlora.engine.sample.token_filter`` (fixed-point top-p masses, no scatter).

Semantics:
    Noise (torch reference, int64 tensors holding 32-bit values, identical on CPU and GPU):
        _mix32(x)            = lowbias32 avalanche of x in [0, 2^32) (xorshift-multiply,
                               products mod 2^32 via ``_mul32``)
        token_hash(V)        = _mix32(_mix32(arange(V) ^ 0x27D4EB2F) ^ 0x165667B1)  # int64 [V]
        uniform_noise(k, th) = ((h1 << 21 | h2 >> 11).double() + 0.5) * 2^-53,
                               h1 = _mix32(k[:, 0:1] ^ th), h2 = _mix32(k[:, 1:2] ^ th)
                               # float64 [N, V] in (0, 1): 53 hashed bits
        gumbel_noise(k, th)  = -log(-log(uniform_noise(k, th)))               # float64 [N, V]

    x: fp32 [N, V] (may hold -inf), keys: int64 [N, 2] (two 32-bit row keys, values in
    [0, 2^32)), token_hash: int64 [V] (values in [0, 2^32)):
        gumbel_argmax(x, keys, token_hash)
            = torch.argmax(x.double() + gumbel_noise(keys, token_hash), dim=-1)  # int64 [N]
        The Gumbel-max draw; among equal maxima the lowest index, a NaN counts as the largest
        value (torch.argmax's conventions). Each row depends on its own inputs alone.

    The filter ops. A row's ranks are those of a stable descending sort of its raw logits,
    ``sorted_logits, order = torch.sort(logits, -1, descending=True, stable=True)`` (ties to
    the lower token id; -0.0 == +0.0; NaN above +inf, as torch.sort). temps: fp32 [N] > 0,
    top_k: int64 [N] or None (None = no limit), limit: int64 [N] (2^-40 units):
        scale_ranked(sorted_logits, temps, top_k)
            = (sorted_logits.float() / temps[:, None]).masked_fill(
                  arange(V) >= top_k[:, None], -inf)                            # fp32 [N, V]
        The temperature-scaled logits in rank order (== x.gather(1, order) with
        x = logits.float() / temps[:, None]), ranks past top-k at -inf.
        kept_ranks(probs, limit, top_k)       # probs: fp32 [N, V] in rank order, >= 0
            mass  = floor(where(isnan(probs), 0, probs).double() * 2^40).long()
            count = ((cumsum(mass, -1) - mass) < limit[:, None]).sum(-1)
            = max(1, min(count, top_k))                                         # int64 [N]
        How many ranks top-k and top-p keep: the ranks whose better-ranked mass is below
        ``limit`` form a prefix (mass >= 0), the best rank always survives. NaN probabilities
        (a row of -inf or +inf logits) count as zero mass.
        cut_filter(logits, temps, order, kept)                 # logits: fp32, bf16 or fp16
            x = logits.float() / temps[:, None]    (x itself when order is None)
            R = kept.clamp(1, V); c = order[:, R - 1]; v = logits[:, c]   (per row)
            = x.masked_fill(~(above(logits, v) | (tie(logits, v) & (arange(V) <= c))), -inf)
            above(a, v) = a > v | (isnan(a) & ~isnan(v)); tie(a, v) = a == v | both NaN
        Keeps the R best ranks in token order, with no sort of x and no scatter: for a stable
        descending order, the R best tokens are those above the cut token's raw value plus the
        tokens tied with it up to its id. Comparisons are on the raw logits, so the ranking is
        that of the logits, not of x (dividing by t > 0 keeps the order, but rounding may make
        two distinct logits equal in x).

Kernels:
    gumbel_argmax: the row is cut into fixed chunks (1024 tokens; several 1024-token blocks
    each once V would need more than 1024 chunks: a function of V alone). One program per
    (row, chunk) hashes its tokens with uint32 arithmetic (a uint32 product is the product mod
    2^32 that ``_mul32`` emulates; shifts are logical), builds the same 53-bit uniform, takes
    -log(-log(u)) in float64, adds x as float64 and keeps the chunk's (max, lowest index). A
    second launch merges each row's chunks in chunk order (none when there is one chunk). Max
    and min are exact, so nothing depends on an order or on N; a decode step (N = 1,
    V = 128k) gets 126 CTAs. ``gumbel_scores`` returns the float64 scores the kernel maximises,
    to compare their bits with the reference.
    scale_ranked, cut_filter: elementwise over (row, 1024-token block); the division is
    ``tl.math.div_rn`` (PTX ``div.rn.f32``, IEEE round-to-nearest with subnormals, as torch's
    ``/``; Triton's plain ``/`` on fp32 is the approximate ``div.full.f32``). cut_filter reads
    R, the cut token and its logit per program (three dependent scalar loads, cached).
    kept_ranks: a row is cut into chunks of CHUNK (2048) ranks, a function of V alone. One
    program per (row, chunk) sums its chunk's int64 masses (none loaded past top-k); then one
    program per row takes the chunks' exclusive prefix, finds the last chunk starting below
    ``limit`` (every chunk before it is kept whole) and counts inside that chunk alone with
    ``tl.cumsum``. The mass is ``(p * 2^40).to(int64)`` in fp32: scaling by a power of 2 is
    exact and truncation is floor for p >= 0, so it equals the float64 floor. Integer sums
    are exact: no order matters.

Devices: the uniform's bits never depend on the device; the float64 ``log``'s may. On CUDA the
kernel's ``tl.log`` is libdevice's ``__nv_log``, the implementation behind CUDA's
``log(double)`` that torch's kernel calls. In the interpreter it is numpy's, which differs from
torch's CPU ``log`` in the last bit of ~0.3% of values: a token can then differ only when two
scores tie to within that ulp, and the engine takes the torch reference on the CPU anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv, next_power_of_2, row_chunks
from detlora.ops.checks import check_same_device, check_shape, check_tensor
from detlora.ops.reductions import argmax_merge_kernel, max_and_first_index, merge_num_warps

_MASK32 = 0xFFFFFFFF
_GUMBEL_BLOCK = 1024  # elements hashed per loop step of a gumbel_argmax program
_GUMBEL_MAX_CHUNKS = 1024  # chunks per row merged in one register tile
_FILTER_BLOCK = 1024  # tokens per program of scale_ranked and cut_filter
_COUNT_CHUNK = 2048  # ranks per chunk of kept_ranks (128256 tokens: 63 chunks)
_COUNT_MAX_CHUNKS = 4096  # chunk sums merged in one register tile: V up to 8M
_FIXED_POINT = 1 << 40  # top-p mass unit (as the sampler's)


# ----------------------------------------------------------------------------- references


def _mul32(x: torch.Tensor | int, c: int) -> torch.Tensor | int:
    """(x * c) mod 2^32 for x in [0, 2^32), with no int64 overflow (16-bit halves of c)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """A 32-bit avalanche mix (xorshift-multiply, lowbias32 constants) on values < 2^32."""
    if isinstance(x, int):  # Python ints do not overflow: the same bits, 3x faster (row keys)
        x ^= x >> 16
        x = (x * 0x7FEB352D) & _MASK32
        x ^= x >> 15
        x = (x * 0x846CA68B) & _MASK32
        return x ^ (x >> 16)
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def token_hash(vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 32-bit hash of every token id: int64 [vocab], values in [0, 2^32)."""
    ids = torch.arange(vocab, dtype=torch.int64, device=device)
    return _mix32(_mix32(ids ^ 0x27D4EB2F) ^ 0x165667B1)


def uniform_noise(keys: torch.Tensor, token_hash: torch.Tensor) -> torch.Tensor:
    """u in (0, 1), float64 [N, V], from row keys [N, 2] int64 and token hashes [V] int64."""
    h1 = _mix32(keys[:, :1] ^ token_hash[None, :])
    h2 = _mix32(keys[:, 1:] ^ token_hash[None, :])
    bits53 = (h1 << 21) | (h2 >> 11)
    return (bits53.to(torch.float64) + 0.5) * (2.0**-53)


def gumbel_noise(keys: torch.Tensor, token_hash: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(uniform_noise(keys, token_hash)))


def gumbel_argmax_ref(
    x: torch.Tensor, keys: torch.Tensor, token_hash: torch.Tensor
) -> torch.Tensor:
    # Masked tokens stay -inf after adding finite noise, so they are never chosen.
    return torch.argmax(x.double() + gumbel_noise(keys, token_hash), dim=-1)


def scale_ranked_ref(
    sorted_logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor | None
) -> torch.Tensor:
    x = sorted_logits.float() / temps[:, None]
    if top_k is None:
        return x
    ranks = torch.arange(x.shape[1], device=x.device)
    return x.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))


def kept_ranks_ref(
    probs: torch.Tensor, limit: torch.Tensor, top_k: torch.Tensor | None
) -> torch.Tensor:
    probs = torch.where(probs.isnan(), 0.0, probs)  # NaN would convert to an arbitrary int
    mass = torch.floor(probs.double() * _FIXED_POINT).to(torch.int64)
    # before is non-decreasing (mass >= 0): the ranks it keeps are a prefix; count them.
    count = ((torch.cumsum(mass, dim=-1) - mass) < limit[:, None]).sum(-1)
    if top_k is not None:
        count = torch.minimum(count, top_k)
    return count.clamp(min=1)


def cut_filter_ref(
    logits: torch.Tensor, temps: torch.Tensor, order: torch.Tensor | None,
    kept: torch.Tensor | None,
) -> torch.Tensor:
    x = logits.float() / temps[:, None]
    if order is None:
        return x
    vocab = logits.shape[1]
    cut = order.gather(1, (kept.clamp(1, vocab) - 1)[:, None])  # [N, 1] token ids
    v = logits.gather(1, cut)  # raw dtype: the comparisons are those of the sort
    a_nan, v_nan = logits.isnan(), v.isnan()
    above = (logits > v) | (a_nan & ~v_nan)  # NaN ranks above everything, as in torch.sort
    tie = (logits == v) | (a_nan & v_nan)
    ids = torch.arange(vocab, device=logits.device)
    return x.masked_fill(~(above | (tie & (ids[None, :] <= cut))), float("-inf"))


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _mix32_u32(x):
    """``_mix32`` on uint32: products wrap mod 2^32 and shifts are logical."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(
    x_ptr,
    keys_ptr,
    hash_ptr,
    out_ptr,
    part_val_ptr,
    part_idx_ptr,
    scores_ptr,
    stride_x,
    stride_keys,
    V: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS_PER_CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    WRITE_SCORES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    # int64 -> uint32 keeps the low 32 bits, which are the whole key.
    k1 = tl.load(keys_ptr + row * stride_keys).to(tl.uint32)
    k2 = tl.load(keys_ptr + row * stride_keys + 1).to(tl.uint32)
    for b in tl.static_range(BLOCKS_PER_CHUNK):  # unrolled: b == 0 is known when compiling
        o = (chunk * BLOCKS_PER_CHUNK + b) * BLOCK + tl.arange(0, BLOCK)
        ok = o < V
        th = tl.load(hash_ptr + o, mask=ok, other=0).to(tl.uint32)
        h1 = _mix32_u32(k1 ^ th)
        h2 = _mix32_u32(k2 ^ th)
        bits53 = (h1.to(tl.uint64) << 21) | (h2 >> 11).to(tl.uint64)  # < 2^53: exact in fp64
        u = (bits53.to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2^-53
        g = -tl.log(-tl.log(u))
        x = tl.load(x_ptr + row * stride_x + o, mask=ok, other=float("-inf"))
        v = x.to(tl.float64) + g
        if WRITE_SCORES:  # the bits being maximised, for gumbel_scores (tests only)
            tl.store(scores_ptr + row * V + o, v, mask=ok)
        m, i = max_and_first_index(v, o, ok, V)
        if b == 0:
            best, best_idx = m, i
        else:
            # Later blocks hold higher indices: they win only strictly, or with a first NaN.
            take = (m > best) | ((m != m) & (best == best))
            best = tl.where(take, m, best)
            best_idx = tl.where(take, i, best_idx)
    if NUM_CHUNKS == 1:
        tl.store(out_ptr + row, best_idx.to(tl.int64))
    else:
        tl.store(part_val_ptr + row * NUM_CHUNKS + chunk, best)
        tl.store(part_idx_ptr + row * NUM_CHUNKS + chunk, best_idx)


@triton.jit
def _scale_ranked_kernel(
    s_ptr,
    temps_ptr,
    top_k_ptr,
    out_ptr,
    stride_s,
    stride_t,
    stride_k,
    stride_out,
    V: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = o < V
    t = tl.load(temps_ptr + row * stride_t)
    s = tl.load(s_ptr + row * stride_s + o, mask=ok, other=0.0).to(tl.float32)
    x = tl.math.div_rn(s, tl.broadcast_to(t, [BLOCK]))  # IEEE, as torch's division
    if HAS_TOP_K:
        x = tl.where(o < tl.load(top_k_ptr + row * stride_k), x, float("-inf"))
    tl.store(out_ptr + row * stride_out + o, x, mask=ok)


@triton.jit
def _fixed_point_mass(p):
    """floor(p * 2^40) as int64 for fp32 p >= 0: exact in fp32 (a power-of-2 scale), and the
    conversion truncates, which is floor here. NaN counts as 0 (before converting it)."""
    return (tl.where(p == p, p, 0.0) * 1099511627776.0).to(tl.int64)


@triton.jit
def _kept_ranks_sums_kernel(
    p_ptr,
    top_k_ptr,
    part_ptr,
    stride_p,
    stride_k,
    V: tl.constexpr,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    o = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = o < V
    if HAS_TOP_K:  # ranks past top-k never change the count: not even loaded
        ok = ok & (o < tl.load(top_k_ptr + row * stride_k))
    m = _fixed_point_mass(tl.load(p_ptr + row * stride_p + o, mask=ok, other=0.0))
    tl.store(part_ptr + row * NUM_CHUNKS + chunk, tl.sum(m, axis=0))


@triton.jit
def _kept_ranks_kernel(
    p_ptr,
    limit_ptr,
    top_k_ptr,
    part_ptr,
    out_ptr,
    stride_p,
    stride_l,
    stride_k,
    V: tl.constexpr,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    limit = tl.load(limit_ptr + row * stride_l)
    if NUM_CHUNKS == 1:
        last = tl.zeros([], dtype=tl.int32)
        before = tl.zeros([], dtype=tl.int64)
    else:
        # The chunks starting below the limit are a prefix (masses >= 0); all but the last of
        # them are kept whole, so only that last one is counted rank by rank.
        ci = tl.arange(0, CHUNKS_P2)
        part = tl.load(part_ptr + row * NUM_CHUNKS + ci, mask=ci < NUM_CHUNKS, other=0)
        start = tl.cumsum(part, axis=0) - part
        live = (start < limit) & (ci < NUM_CHUNKS)
        last = tl.maximum(tl.sum(live.to(tl.int32), axis=0) - 1, 0)
        before = tl.sum(tl.where(ci == last, start, 0), axis=0)
    o = last * CHUNK + tl.arange(0, CHUNK)
    ok = o < V
    load_ok = ok
    if HAS_TOP_K:
        top_k = tl.load(top_k_ptr + row * stride_k)
        load_ok = ok & (o < top_k)  # as the chunk sums: past top-k counts as zero mass
    m = _fixed_point_mass(tl.load(p_ptr + row * stride_p + o, mask=load_ok, other=0.0))
    # With no live chunk (limit <= 0), before = 0 >= limit and nothing is counted.
    kept = ok & ((tl.cumsum(m, axis=0) - m + before) < limit)
    count = last.to(tl.int64) * CHUNK + tl.sum(kept.to(tl.int64), axis=0)
    if HAS_TOP_K:
        count = tl.minimum(count, top_k)
    tl.store(out_ptr + row, tl.maximum(count, 1))


@triton.jit
def _cut_filter_kernel(
    x_ptr,
    temps_ptr,
    order_ptr,
    kept_ptr,
    out_ptr,
    stride_x,
    stride_t,
    stride_order,
    stride_kept,
    stride_out,
    V: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_CUT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = o < V
    t = tl.load(temps_ptr + row * stride_t)
    # bf16 / fp16 -> fp32 is exact: comparing in fp32 is comparing the raw logits.
    a = tl.load(x_ptr + row * stride_x + o, mask=ok, other=0.0).to(tl.float32)
    x = tl.math.div_rn(a, tl.broadcast_to(t, [BLOCK]))  # IEEE, as torch's division
    if HAS_CUT:
        r = tl.minimum(tl.maximum(tl.load(kept_ptr + row * stride_kept), 1), V)
        cut = tl.load(order_ptr + row * stride_order + r - 1)
        v = tl.broadcast_to(tl.load(x_ptr + row * stride_x + cut).to(tl.float32), [BLOCK])
        a_nan = a != a
        above = (a > v) | (a_nan & (v == v))  # NaN outranks every number, as in torch.sort
        tie = (a == v) | (a_nan & (v != v))
        x = tl.where(above | (tie & (o <= cut)), x, float("-inf"))
    tl.store(out_ptr + row * stride_out + o, x, mask=ok)


# ----------------------------------------------------------------------------- wrappers


def gumbel_argmax_config(vocab: int) -> tuple[int, int, int, int]:
    """(BLOCK, BLOCKS_PER_CHUNK, NUM_CHUNKS, num_warps) for rows of ``vocab``: a function of V.

    A chunk is one block (1024 tokens) until the vocabulary needs more than
    ``_GUMBEL_MAX_CHUNKS`` chunks; then each program walks several blocks.
    """
    block = min(next_power_of_2(vocab), _GUMBEL_BLOCK)
    blocks_per_chunk = cdiv(cdiv(vocab, block), _GUMBEL_MAX_CHUNKS)
    num_chunks = cdiv(vocab, block * blocks_per_chunk)
    return block, blocks_per_chunk, num_chunks, min(4, max(1, block // 256))


def _check_gumbel(x: object, keys: object, token_hash: object) -> torch.Tensor:
    x = check_tensor("x", x, ndim=2, dtypes=(torch.float32,), unit_last_stride=True)
    if x.shape[1] == 0:
        raise ValueError(f"x must have at least one column, got {tuple(x.shape)}")
    keys = check_tensor("keys", keys, ndim=2, dtypes=(torch.int64,), unit_last_stride=True)
    check_shape("keys", keys, (x.shape[0], 2))
    token_hash = check_tensor("token_hash", token_hash, ndim=1, dtypes=(torch.int64,),
                              unit_last_stride=True)
    check_shape("token_hash", token_hash, (x.shape[1],))
    check_same_device(x=x, keys=keys, token_hash=token_hash)
    return x


def _launch_gumbel(x: torch.Tensor, keys: torch.Tensor, token_hash: torch.Tensor,
                   scores: torch.Tensor | None) -> torch.Tensor:
    n, vocab = x.shape
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if n == 0:
        return out
    block, blocks_per_chunk, num_chunks, num_warps = gumbel_argmax_config(vocab)
    if num_chunks == 1:
        part_val, part_idx = out, out  # unused
    else:
        part_val = torch.empty(n, num_chunks, dtype=torch.float64, device=x.device)
        part_idx = torch.empty(n, num_chunks, dtype=torch.int32, device=x.device)
    _gumbel_argmax_kernel[(n, num_chunks)](
        x, keys, token_hash, out, part_val, part_idx, out if scores is None else scores,
        x.stride(0), keys.stride(0), V=vocab, BLOCK=block, BLOCKS_PER_CHUNK=blocks_per_chunk,
        NUM_CHUNKS=num_chunks, WRITE_SCORES=scores is not None, num_warps=num_warps,
    )
    if num_chunks > 1:
        # The chunks' (fp64 max, index) pairs merge exactly as argmax's chunks do.
        argmax_merge_kernel[(n,)](
            part_val, part_idx, out, out.stride(0), N=vocab, NUM_CHUNKS=num_chunks,
            CHUNKS_P2=next_power_of_2(num_chunks), num_warps=merge_num_warps(num_chunks),
        )
    return out


def gumbel_argmax(x: torch.Tensor, keys: torch.Tensor, token_hash: torch.Tensor) -> torch.Tensor:
    """Gumbel-max token of every row of ``x`` [N, V] fp32: int64 [N] (see the module doc).

    ``keys`` int64 [N, 2] and ``token_hash`` int64 [V] must hold values in [0, 2^32); that is
    not checked (it would sync the host): the kernel reads their low 32 bits.
    """
    return _launch_gumbel(_check_gumbel(x, keys, token_hash), keys, token_hash, None)


def gumbel_scores(x: torch.Tensor, keys: torch.Tensor, token_hash: torch.Tensor) -> torch.Tensor:
    """The float64 [N, V] scores ``gumbel_argmax`` maximises, as its kernel computes them.

    For checking the kernel's bits against ``x.double() + gumbel_noise(keys, token_hash)``
    (on CUDA they must be equal); the sampler never calls it.
    """
    x = _check_gumbel(x, keys, token_hash)
    scores = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    _launch_gumbel(x, keys, token_hash, scores)
    return scores


def filter_block_config(vocab: int) -> tuple[int, int, int]:
    """(BLOCK, NUM_BLOCKS, num_warps) of scale_ranked and cut_filter for rows of ``vocab``."""
    block = min(next_power_of_2(vocab), _FILTER_BLOCK)
    return block, cdiv(vocab, block), min(4, max(1, block // 256))


def kept_ranks_config(vocab: int) -> tuple[int, int, int, int]:
    """(CHUNK, NUM_CHUNKS, CHUNKS_P2, num_warps) of kept_ranks: a function of V alone."""
    chunk, num_chunks, num_warps = row_chunks(vocab, _COUNT_CHUNK, _COUNT_MAX_CHUNKS)
    return chunk, num_chunks, next_power_of_2(num_chunks), num_warps


def _check_rows(name: str, t: object, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-row parameter: 1-D [n] of ``dtype`` (any stride: the kernels take it)."""
    t = check_tensor(name, t, ndim=1, dtypes=(dtype,))
    check_shape(name, t, (n,))
    return t


def _check_matrix(name: str, t: object, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    t = check_tensor(name, t, ndim=2, dtypes=dtypes, unit_last_stride=True)
    if t.shape[1] == 0:
        raise ValueError(f"{name} must have at least one column, got {tuple(t.shape)}")
    return t


_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def scale_ranked(
    sorted_logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor | None
) -> torch.Tensor:
    """``sorted_logits.float() / temps[:, None]``, ranks >= top_k at -inf: fp32 [N, V]."""
    s = _check_matrix("sorted_logits", sorted_logits, _LOGIT_DTYPES)
    n, vocab = s.shape
    temps = _check_rows("temps", temps, n, torch.float32)
    tensors = {"sorted_logits": s, "temps": temps}
    if top_k is not None:
        tensors["top_k"] = top_k = _check_rows("top_k", top_k, n, torch.int64)
    check_same_device(**tensors)
    out = torch.empty(n, vocab, dtype=torch.float32, device=s.device)
    if n == 0:
        return out
    block, num_blocks, num_warps = filter_block_config(vocab)
    _scale_ranked_kernel[(n, num_blocks)](
        s, temps, temps if top_k is None else top_k, out, s.stride(0), temps.stride(0),
        0 if top_k is None else top_k.stride(0), out.stride(0),
        V=vocab, BLOCK=block, HAS_TOP_K=top_k is not None, num_warps=num_warps,
    )
    return out


def kept_ranks(
    probs: torch.Tensor, limit: torch.Tensor, top_k: torch.Tensor | None
) -> torch.Tensor:
    """How many ranks top-p (``limit``) and top-k keep per row: int64 [N] in [1, V]
    (see the module doc). ``probs`` fp32 [N, V] in rank order."""
    probs = _check_matrix("probs", probs, (torch.float32,))
    n, vocab = probs.shape
    limit = _check_rows("limit", limit, n, torch.int64)
    tensors = {"probs": probs, "limit": limit}
    if top_k is not None:
        tensors["top_k"] = top_k = _check_rows("top_k", top_k, n, torch.int64)
    check_same_device(**tensors)
    out = torch.empty(n, dtype=torch.int64, device=probs.device)
    if n == 0:
        return out
    chunk, num_chunks, chunks_p2, num_warps = kept_ranks_config(vocab)
    has_top_k = top_k is not None
    top_k_arg, stride_k = (top_k, top_k.stride(0)) if has_top_k else (limit, 0)
    part = out  # unused with one chunk
    if num_chunks > 1:
        part = torch.empty(n, num_chunks, dtype=torch.int64, device=probs.device)
        _kept_ranks_sums_kernel[(n, num_chunks)](
            probs, top_k_arg, part, probs.stride(0), stride_k, V=vocab, CHUNK=chunk,
            NUM_CHUNKS=num_chunks, HAS_TOP_K=has_top_k, num_warps=num_warps,
        )
    _kept_ranks_kernel[(n,)](
        probs, limit, top_k_arg, part, out, probs.stride(0), limit.stride(0), stride_k,
        V=vocab, CHUNK=chunk, NUM_CHUNKS=num_chunks, CHUNKS_P2=chunks_p2,
        HAS_TOP_K=has_top_k, num_warps=num_warps,
    )
    return out


def cut_filter(
    logits: torch.Tensor, temps: torch.Tensor, order: torch.Tensor | None,
    kept: torch.Tensor | None,
) -> torch.Tensor:
    """``logits.float() / temps[:, None]`` with every token outside the ``kept`` best ranks of
    ``order`` at -inf: fp32 [N, V] (see the module doc). ``order`` and ``kept`` are both None
    (temperature only) or both given; ``order`` must be the stable descending sort of
    ``logits`` (not checked: it is what the comparisons reproduce)."""
    logits = _check_matrix("logits", logits, _LOGIT_DTYPES)
    n, vocab = logits.shape
    temps = _check_rows("temps", temps, n, torch.float32)
    tensors = {"logits": logits, "temps": temps}
    if (order is None) != (kept is None):
        raise ValueError("order and kept must both be given or both be None")
    if order is not None:
        tensors["order"] = order = _check_matrix("order", order, (torch.int64,))
        check_shape("order", order, (n, vocab))
        tensors["kept"] = kept = _check_rows("kept", kept, n, torch.int64)
    check_same_device(**tensors)
    out = torch.empty(n, vocab, dtype=torch.float32, device=logits.device)
    if n == 0:
        return out
    block, num_blocks, num_warps = filter_block_config(vocab)
    has_cut = order is not None
    _cut_filter_kernel[(n, num_blocks)](
        logits, temps, order if has_cut else logits, kept if has_cut else temps, out,
        logits.stride(0), temps.stride(0), order.stride(0) if has_cut else 0,
        kept.stride(0) if has_cut else 0, out.stride(0),
        V=vocab, BLOCK=block, HAS_CUT=has_cut, num_warps=num_warps,
    )
    return out


__all__ = [
    "cut_filter",
    "cut_filter_ref",
    "filter_block_config",
    "gumbel_argmax",
    "gumbel_argmax_config",
    "gumbel_argmax_ref",
    "gumbel_noise",
    "gumbel_scores",
    "kept_ranks",
    "kept_ranks_config",
    "kept_ranks_ref",
    "scale_ranked",
    "scale_ranked_ref",
    "token_hash",
    "uniform_noise",
]
