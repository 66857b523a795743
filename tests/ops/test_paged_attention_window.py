"""Sliding-window paged attention (Gemma, Mistral) and head_dim 512 (Gemma 4's full layers),
in the interpreter and on the CPU path: a dense float64 oracle, released pages (-1 table
entries, NaN-poisoned pages) before the window never read, and a query row bit-identical in a
prefill, any chunking across the window's edge, after a cached prefix and in decode steps,
in one CTA or split over several, on the Triton kernel and on ``cpu_invariant``.

fp16 and fp32 only (the interpreter computes bf16 ``tl.dot`` wrongly).
"""

import pytest
import torch

from detlora.ops import cpu_invariant
from detlora.ops import paged_attention as pa
from detlora.ops.paged_attention_split_kv import paged_attention_split_kv

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning")

SCALE = 0.37


def _cache(lens, hq, hk, d, page, dtype, seed):
    """Dense K/V/Q per sequence and the same K/V in shuffled, NaN-poisoned pages."""
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page) for n in lens]
    total = sum(pages_per) + 2
    perm = torch.randperm(total, generator=g)
    k_cache = torch.full((total, page, hk, d), float("nan"), dtype=dtype)
    v_cache = torch.full((total, page, hk, d), float("nan"), dtype=dtype)
    tables = torch.full((len(lens), max(pages_per) + 1), 987_654, dtype=torch.int32)
    data, start = [], 0
    for b, n in enumerate(lens):
        mine = perm[start:start + pages_per[b]]
        start += pages_per[b]
        tables[b, :len(mine)] = mine.int()
        k = torch.randn(n, hk, d, generator=g).to(dtype)
        v = torch.randn(n, hk, d, generator=g).to(dtype)
        pos = torch.arange(n)
        pa.write_kv_ref(k, v, k_cache, v_cache, mine[pos // page] * page + pos % page)
        data.append((k, v, torch.randn(n, hq, d, generator=g).to(dtype)))
    return data, k_cache, v_cache, tables


def _release(k_cache, v_cache, tables, s, before, page):
    """Sequence ``s``'s pages wholly before position ``before``: poisoned and -1 in a copy
    of the table, as the engine leaves a window's released pages."""
    tables = tables.clone()
    for i in range(before // page):
        p = int(tables[s, i])
        if p >= 0:
            k_cache[p] = float("nan")
            v_cache[p] = float("nan")
        tables[s, i] = -1
    return tables


def _run(fn, data, k_cache, v_cache, tables, pieces, window, **kw):
    q = torch.cat([data[s][2][a:e] for s, a, e in pieces])
    tab = torch.stack([tables[s] for s, _, _ in pieces])
    seq_lens = torch.tensor([e for _, _, e in pieces], dtype=torch.int32)
    q_lens = [e - a for _, a, e in pieces]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    if fn is cpu_invariant.paged_attention or fn is pa.paged_attention_ref:
        out = fn(q, k_cache, v_cache, tab, seq_lens, qsl, SCALE, window=window, **kw)
    else:
        out = torch.full_like(q, float("nan"))
        fn(q, k_cache, v_cache, tab, seq_lens, qsl, SCALE, out=out, window=window, **kw)
    return list(out.split(q_lens))


def _oracle(data, s, first, end, group, window):
    k, v, qs = data[s]
    q = qs[first:end].double()
    keys = k[:end].double().repeat_interleave(group, dim=1)
    vals = v[:end].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * SCALE
    pos_q = torch.arange(first, end)[:, None]
    pos_k = torch.arange(end)[None, :]
    hidden = (pos_k > pos_q) | (pos_k <= pos_q - window)
    probs = torch.softmax(scores.masked_fill(hidden[None], float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vals)


def _rel(got, want):
    return float((got.double() - want).norm() / want.norm())


CASES = [  # (dtype, Hq, Hk, D, page, window): windows shorter and longer than a key block
    (torch.float32, 4, 2, 32, 4, 20),
    (torch.float16, 6, 2, 16, 8, 70),
    (torch.float32, 4, 1, 512, 8, 40),  # head_dim 512, GQA 4 (Gemma 4 E4B's full layers)
]
FNS = {"triton": pa.paged_attention, "cpu_invariant": cpu_invariant.paged_attention,
       "ref": pa.paged_attention_ref}
# The Triton interpreter is slow: the kernel runs the cases that differ for it (a window
# within one key block and beyond, head_dim 512), the CPU ops every case.
ORACLE = [(fn, c) for c in CASES for fn in FNS if fn != "triton" or c[3] != 32]


@pytest.mark.parametrize("fn,case", ORACLE, ids=[f"{f}-w{c[5]}-d{c[3]}" for f, c in ORACLE])
def test_window_matches_dense_fp64_with_released_pages(fn, case):
    dtype, hq, hk, d, page, window = case
    lens = [150, 23, 90]
    data, kc, vc, tables = _cache(lens, hq, hk, d, page, dtype, seed=d + window)
    # Sequence 0 decodes at 149 and sequence 2 prefills 60..90: pages before their first
    # query's window are released (the engine never keeps them).
    tables = _release(kc, vc, tables, 0, 149 - window + 1, page)
    tables = _release(kc, vc, tables, 2, 60 - window + 1, page)
    pieces = [(0, 149, 150), (1, 0, 23), (2, 60, 90)]
    kw = {"kv_split": 64, "kv_ctas": 3} if fn == "triton" else {}
    outs = _run(FNS[fn], data, kc, vc, tables, pieces, window, **kw)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for (s, a, e), got in zip(pieces, outs, strict=True):
        assert not got.isnan().any()
        assert _rel(got, _oracle(data, s, a, e, hq // hk, window)) < tol, (s, a, e)


INVARIANCE = [  # (fn, case, thorough): the interpreter gets a shorter list of ways in
    ("cpu_invariant", CASES[0], True), ("cpu_invariant", CASES[1], True),
    ("triton", (torch.float16, 6, 2, 16, 8, 20), True),
    ("triton", (torch.float16, 4, 1, 512, 8, 40), False)]


@pytest.mark.parametrize("fn,case,thorough", INVARIANCE,
                         ids=[f"{f}-w{c[5]}-d{c[3]}" for f, c, _ in INVARIANCE])
def test_rows_identical_across_modes_and_window_edges(fn, case, thorough):
    """Every way of reaching a query (one prefill; chunks cut before, at and after the
    window's edge; a cached prefix; decode steps alone or batched; split over CTAs) gives
    its row the same bits, with the pages behind the window released."""
    dtype, hq, hk, d, page, window = case
    n = 100
    data, kc, vc, tables = _cache([n, 37], hq, hk, d, page, dtype, seed=7 + d)
    attn = FNS[fn]
    kw = {"kv_split": 64, "kv_ctas": 1} if fn == "triton" else {}
    full = _run(attn, data, kc, vc, tables, [(0, 0, n)], window, **kw)[0]

    def check(first, end, what, **extra):
        released = _release(kc.clone(), vc.clone(), tables, 0, first - window + 1, page)
        got = _run(attn, data, kc, vc, released, [(0, first, end), (1, 36, 37)], window,
                   **{**kw, **extra})[0]
        assert torch.equal(got, full[first:end]), what

    cuts = [window - 1, window, window + 1, 64] if thorough else [window + 1]
    for cut in cuts:  # chunked prefill in two pieces, cut around the window's edge
        check(0, cut, f"chunk 0:{cut}")
        check(cut, n, f"chunk {cut}:{n}")
    decodes = [0, window - 1, window, 64, n - 1] if thorough else [n - 1]
    for p in decodes:  # one decode step per launch
        check(p, p + 1, f"decode {p}")
    if fn == "triton":
        check(n - 1, n, "decode over 2 CTAs", kv_ctas=2, max_query_len=1)
        if thorough:
            check(0, n, "prefill over 2 CTAs", kv_ctas=2)
    steps = [window - 1, 64, n - 1]
    batched = _run(attn, data, kc, vc, tables, [(0, p, p + 1) for p in steps], window, **kw)
    for p, row in zip(steps, batched, strict=True):
        assert torch.equal(row, full[p:p + 1]), f"batched decode {p}"


def test_split_kv_fast_kernel_takes_the_window():
    data, kc, vc, tables = _cache([150, 23], 6, 2, 16, 8, torch.float32, seed=3)
    tables = _release(kc, vc, tables, 0, 149 - 30 + 1, 8)
    pieces = [(0, 149, 150), (1, 3, 23)]
    for splits in (None, 3):
        outs = _run(paged_attention_split_kv, data, kc, vc, tables, pieces, 30,
                    num_splits=splits)
        for (s, a, e), got in zip(pieces, outs, strict=True):
            assert _rel(got, _oracle(data, s, a, e, 3, 30)) < 1e-5


def test_bad_window_and_head_dim_raise():
    data, kc, vc, tables = _cache([10], 2, 1, 16, 4, torch.float32, seed=1)
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="window must be a positive int"):
            _run(pa.paged_attention, data, kc, vc, tables, [(0, 0, 10)], bad)
    for d in (1024, 72, 8):  # too wide, not a multiple of 16, too narrow
        q = torch.zeros(1, 2, d)
        cache = torch.zeros(2, 4, 1, d)
        with pytest.raises(ValueError, match=rf"multiple of 16 in \[16, 512\], got {d}"):
            pa.paged_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32),
                               torch.tensor([0, 1], dtype=torch.int32), 1.0)
    # A used page before the window is checked; one wholly before it is not read.
    released = tables.clone()
    released[0, 0] = -1
    with pytest.raises(ValueError, match="block_tables must index pages"):
        _run(pa.paged_attention, data, kc, vc, released, [(0, 9, 10)], 8)
    _run(pa.paged_attention, data, kc, vc, released, [(0, 9, 10)], 5)
