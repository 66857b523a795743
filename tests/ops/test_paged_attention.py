"""Paged attention in the interpreter: a dense float64 oracle, pages in shuffled order and
NaN-poisoned free slots, mixed prefill / chunked prefill / decode batches, write_kv, bitwise
equality of a query's row across every mode and across split / unsplit KV, and bad inputs.

fp16 and fp32 only: the interpreter computes bf16 ``tl.dot`` wrongly (bf16 is proven on the GPU
in tests/gpu/test_paged_attention_gpu.py).
"""

from dataclasses import dataclass

import pytest
import torch
import triton
import triton.language as tl

from detlora.ops import paged_attention as pa
from detlora.ops.paged_attention_split_kv import paged_attention_split_kv

pytestmark = pytest.mark.filterwarnings(  # the interpreter's own loop bounds, not ours
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning")

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
GARBAGE_PAGE = 987_654  # unused block-table entries: never read


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@dataclass
class Cache:
    """Dense per-sequence K/V/Q and the same K/V written into shuffled pages."""

    keys: list[torch.Tensor]  # [L, Hk, D] per sequence
    vals: list[torch.Tensor]
    queries: list[torch.Tensor]  # [L, Hq, D]: the query of every position
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor  # [num_seqs, max_blocks] int32


def _cache(lens, hq, hk, d, page, dtype, seed, extra_pages=3, extra_cols=1) -> Cache:
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page) for n in lens]
    total = sum(pages_per) + extra_pages
    perm = torch.randperm(total, generator=g)
    nan = float("nan")
    k_cache = torch.full((total, page, hk, d), nan, dtype=dtype)  # free slots poisoned
    v_cache = torch.full((total, page, hk, d), nan, dtype=dtype)
    tables = torch.full((len(lens), max(pages_per) + extra_cols), GARBAGE_PAGE,
                        dtype=torch.int32)
    keys, vals, queries, start = [], [], [], 0
    for b, n in enumerate(lens):
        mine = perm[start:start + pages_per[b]]
        start += pages_per[b]
        tables[b, :len(mine)] = mine.int()
        k = torch.randn(n, hk, d, generator=g).to(dtype)
        v = torch.randn(n, hk, d, generator=g).to(dtype)
        pos = torch.arange(n)
        slots = mine[pos // page] * page + pos % page
        pa.write_kv(k, v, k_cache, v_cache, slots)
        keys.append(k)
        vals.append(v)
        queries.append(torch.randn(n, hq, d, generator=g).to(dtype))
    return Cache(keys, vals, queries, k_cache, v_cache, tables)


def _attend(c: Cache, pieces, fn=None, **kw):
    """Run one launch over ``pieces``: (sequence, first, end) = the queries at positions
    [first, end) of that sequence, with context ``end``. Returns one [end - first, Hq, D]
    output per piece."""
    fn = fn or pa.paged_attention
    q = torch.cat([c.queries[s][a:e] for s, a, e in pieces])
    tables = torch.stack([c.tables[s] for s, _, _ in pieces])
    seq_lens = torch.tensor([e for _, _, e in pieces], dtype=torch.int32)
    q_lens = torch.tensor([e - a for _, a, e in pieces])
    qsl = torch.zeros(len(pieces) + 1, dtype=torch.int32)
    qsl[1:] = q_lens.cumsum(0)
    out = torch.full_like(q, float("nan"))
    fn(q, c.k_cache, c.v_cache, tables, seq_lens, qsl, 0.37, out=out, **kw)
    return list(out.split(q_lens.tolist()))


def _oracle(c: Cache, s: int, first: int, end: int, group: int) -> torch.Tensor:
    """Dense causal attention in float64 from the unpaged K/V."""
    q = c.queries[s][first:end].double()  # [n, Hq, D]
    k = c.keys[s][:end].double().repeat_interleave(group, dim=1)  # [end, Hq, D]
    v = c.vals[s][:end].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.37
    future = torch.arange(end)[None, :] > torch.arange(first, end)[:, None]
    probs = torch.softmax(scores.masked_fill(future[None], float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


# ----------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float16, torch.float16),
                                               (torch.float32, torch.float32),
                                               (torch.float32, torch.float16)])
def test_write_kv_matches_ref_and_skips_padding(dtype, cache_dtype):
    g = torch.Generator().manual_seed(1)
    t, hk, d, page, pages = 13, 3, 16, 4, 6
    fused = torch.randn(t, 2 * hk * d + 5, generator=g).to(dtype)  # k, v: strided views
    k = fused[:, :hk * d].view(t, hk, d)
    v = fused[:, hk * d:2 * hk * d].view(t, hk, d)
    slots = torch.randperm(pages * page, generator=g)[:t].int()
    slots[[2, 7, 12]] = -1
    base_k = torch.randn(pages, page, hk, d, generator=g).to(cache_dtype)
    base_v = torch.randn(pages, page, hk, d, generator=g).to(cache_dtype)
    got_k, got_v, want_k, want_v = base_k.clone(), base_v.clone(), base_k.clone(), base_v.clone()
    pa.write_kv(k, v, got_k, got_v, slots)
    pa.write_kv_ref(k, v, want_k, want_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    written = torch.zeros(pages * page, dtype=torch.bool)
    written[slots[slots >= 0].long()] = True
    untouched = ~written.view(pages, page)
    assert torch.equal(got_k[untouched], base_k[untouched])  # padding rows wrote nothing
    assert not torch.equal(got_k[~untouched], base_k[~untouched])


# ----------------------------------------------------------------------------- correctness


MIXED = [  # (context, query length): decode, short prefill, chunk, long prefill, decode
    (1, 1), (3, 3), (17, 5), (130, 130), (130, 1), (29, 12), (64, 64), (65, 1)]


SHAPES = [  # (dtype, Hq, Hk, D, page): GQA 2, 3 and none
    (torch.float32, 4, 2, 32, 8), (torch.float16, 6, 2, 16, 4), (torch.float16, 3, 3, 16, 8)]


@pytest.mark.parametrize("dtype,hq,hk,d,page,kv_split,kv_ctas", [
    *[(*shape, None, None) for shape in SHAPES],  # default segment: one CTA, no fold
    *[(*shape, 64, 3) for shape in SHAPES],  # segments of one block, split over 3 CTAs
    (*SHAPES[1], 64, 1),  # the same segments folded in one CTA
])
def test_mixed_batch_matches_dense_fp64(dtype, hq, hk, d, page, kv_split, kv_ctas):
    c = _cache([n for n, _ in MIXED], hq, hk, d, page, dtype, seed=hq * d + page)
    pieces = [(s, n - ql, n) for s, (n, ql) in enumerate(MIXED)]
    outs = _attend(c, pieces, kv_split=kv_split, kv_ctas=kv_ctas)
    for (s, first, end), got in zip(pieces, outs, strict=True):
        assert not got.isnan().any()
        assert _rel(got, _oracle(c, s, first, end, hq // hk)) < TOL[dtype], (s, first, end)


def test_matches_paged_ref():
    dtype = torch.float16
    c = _cache([n for n, _ in MIXED], 4, 2, 16, 4, dtype, seed=5)
    pieces = [(s, n - ql, n) for s, (n, ql) in enumerate(MIXED)]
    q = torch.cat([c.queries[s][a:e] for s, a, e in pieces])
    seq_lens = torch.tensor([e for _, _, e in pieces], dtype=torch.int32)
    qsl = torch.tensor([0] + [sum(e - a for _, a, e in pieces[:i + 1])
                              for i in range(len(pieces))], dtype=torch.int32)
    got = pa.paged_attention(q, c.k_cache, c.v_cache, c.tables, seq_lens, qsl, 0.37)
    want = pa.paged_attention_ref(q, c.k_cache, c.v_cache, c.tables, seq_lens, qsl, 0.37)
    assert _rel(got, want.double()) < TOL[dtype]


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_split_kv_fast_matches_dense_fp64(num_splits):
    mixed = [(130, 1), (17, 5), (3, 3), (1, 1)]
    c = _cache([n for n, _ in mixed], 6, 2, 16, 8, torch.float32, seed=9)
    pieces = [(s, n - ql, n) for s, (n, ql) in enumerate(mixed)]
    outs = _attend(c, pieces, fn=paged_attention_split_kv, num_splits=num_splits)
    for (s, first, end), got in zip(pieces, outs, strict=True):
        assert _rel(got, _oracle(c, s, first, end, 3)) < TOL[torch.float32]
    decode = [(s, n - 1, n) for s, (n, _) in enumerate(mixed)]
    outs = _attend(c, decode, fn=paged_attention_split_kv, num_splits=num_splits,
                   max_query_len=1)
    for (s, first, end), got in zip(decode, outs, strict=True):
        assert _rel(got, _oracle(c, s, first, end, 3)) < TOL[torch.float32]


# ----------------------------------------------------------------------------- invariance

L = 130  # crosses key blocks at 64 and 128


@pytest.mark.parametrize("dtype,hq,hk,d,page,kv_split", [
    (torch.float16, 6, 2, 16, 4, 64),  # GQA 3, one segment per key block: folds everywhere
    (torch.float32, 4, 2, 32, 8, 128),  # GQA 2, two blocks per segment
    (torch.float16, 4, 1, 16, 8, None),  # GQA 4, default segment: no fold at these lengths
])
def test_query_rows_are_identical_in_every_mode(dtype, hq, hk, d, page, kv_split):
    c = _cache([L, 40, 100, 7], hq, hk, d, page, dtype, seed=hq + d)
    kw = {"kv_split": kv_split, "kv_ctas": 1}
    full = _attend(c, [(0, 0, L)], **kw)[0]

    def check(rows, first, what):
        assert torch.equal(rows, full[first:first + rows.shape[0]]), what

    for a, e in ((0, 5), (5, 17), (17, L)):  # chunked prefill 5 + 12 + 113
        check(_attend(c, [(0, a, e)], **kw)[0], a, f"chunk {a}:{e}")
    for prefix in (17, 64, 127):  # prefill after a cached prefix
        check(_attend(c, [(0, prefix, L)], **kw)[0], prefix, f"prefix {prefix}")
    for p in (0, 63, 64, 129):  # one decode step per launch
        check(_attend(c, [(0, p, p + 1)], **kw)[0], p, f"decode {p}")
    steps = [*range(0, L, 7), 63, 64, 127, 128, 129]  # decode steps, batched
    for p, row in zip(steps, _attend(c, [(0, p, p + 1) for p in steps], **kw), strict=True):
        check(row, p, f"batched decode {p}")
    mixed = _attend(c, [(1, 0, 40), (0, 5, 17), (2, 99, 100), (0, 100, L), (3, 0, 7),
                        (0, 64, 65)], **kw)  # inside batches with other sequences
    check(mixed[1], 5, "mixed chunk")
    check(mixed[3], 100, "mixed prefix")
    check(mixed[5], 64, "mixed decode")
    # Split KV over CTAs (ordered fold by the last CTA) gives the same bits as one CTA.
    for ctas in (3, None):
        split = {"kv_split": kv_split, "kv_ctas": ctas}
        check(_attend(c, [(0, 0, L)], **split)[0], 0, f"split {ctas} prefill")
        outs = _attend(c, [(0, p, p + 1) for p in (129, 100, 64, 0)], **split)
        for p, row in zip((129, 100, 64, 0), outs, strict=True):
            check(row, p, f"split {ctas} decode {p}")
    # The grid numbering (direct slots from max_query_len, or searched) changes nothing.
    check(_attend(c, [(0, 0, L)], max_query_len=L, **kw)[0], 0, "direct slots prefill")
    for p, row in zip(steps, _attend(c, [(0, p, p + 1) for p in steps], max_query_len=1, **kw),
                      strict=True):
        check(row, p, f"direct slots decode {p}")


def test_tile_slots_direct_only_when_not_larger():
    def problem(t, b, mql):
        return pa.AttentionProblem(t, 6, 2, 16, b, 4, 10, mql)

    assert pa.tile_slots(problem(130, 1, 130), 21) == (7, 7, False)  # one prefill
    assert pa.tile_slots(problem(64, 64, 1), 21) == (64, 1, False)  # decode batch
    assert pa.tile_slots(problem(170, 2, 130), 21) == (10, 0, True)  # 2 x 7 > 170 // 21 + 2
    assert pa.tile_slots(problem(170, 2, None), 21) == (10, 0, True)


@pytest.mark.parametrize("hint", [False, True])
def test_split_and_unsplit_agree_on_long_folds(hint):
    """Many segments (kv_split 64 over 600 keys: 10, two rounds of the eight-wide fold): the
    last CTA's fold in chunks of rows equals the single CTA's fold, with fold steps of the
    decode rows alone (max_query_len 1) or of the whole tile."""
    c = _cache([600, 75], 6, 2, 16, 8, torch.float16, seed=11)
    for pieces in ([(0, 550, 600), (1, 74, 75), (0, 580, 600)], [(0, 599, 600), (1, 74, 75)]):
        mql = max(end - start for _, start, end in pieces) if hint else None
        one = _attend(c, pieces, kv_split=64, kv_ctas=1, max_query_len=mql)
        for ctas in (2, 4, 16):
            many = _attend(c, pieces, kv_split=64, kv_ctas=ctas, max_query_len=mql)
            for a, b in zip(one, many, strict=True):
                assert torch.equal(a, b)


def test_repeat_runs_are_bitwise_equal():
    c = _cache([130, 9], 4, 2, 16, 4, torch.float16, seed=3)
    pieces = [(0, 120, 130), (1, 8, 9)]
    first = _attend(c, pieces, kv_split=64, kv_ctas=3)
    for _ in range(2):
        for a, b in zip(first, _attend(c, pieces, kv_split=64, kv_ctas=3), strict=True):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------- bad inputs


def _good():
    c = _cache([20, 9], 4, 2, 16, 4, torch.float16, seed=0)
    q = torch.cat([c.queries[0][15:20], c.queries[1][8:9]])
    return dict(q=q, k_cache=c.k_cache, v_cache=c.v_cache, block_tables=c.tables,
                seq_lens=torch.tensor([20, 9], dtype=torch.int32),
                query_start_loc=torch.tensor([0, 5, 6], dtype=torch.int32), scale=0.3)


def _bad_cases():
    def edit(**changes):
        def make():
            args = _good()
            for k, fn in changes.items():
                args[k] = fn(args)
            return args
        return make

    return [
        ("q", edit(q=lambda a: a["q"][0])),
        ("q", edit(q=lambda a: a["q"].int())),
        ("k_cache", edit(k_cache=lambda a: a["k_cache"].float())),
        ("v_cache", edit(v_cache=lambda a: a["v_cache"][:, :2])),
        ("k_cache head_dim", edit(k_cache=lambda a: a["k_cache"][..., :8],
                                  v_cache=lambda a: a["v_cache"][..., :8])),
        ("q has 4 heads, not a multiple", edit(k_cache=lambda a: a["k_cache"][:, :, :1].expand(
            -1, -1, 3, -1), v_cache=lambda a: a["v_cache"][:, :, :1].expand(-1, -1, 3, -1))),
        ("q", edit(q=lambda a: a["q"].transpose(1, 2).contiguous().transpose(1, 2))),
        ("block_tables", edit(block_tables=lambda a: a["block_tables"].float())),
        ("block_tables", edit(block_tables=lambda a: a["block_tables"][:1])),
        ("block_tables too short", edit(block_tables=lambda a: a["block_tables"][:, :4])),
        ("block_tables must index pages", edit(block_tables=lambda a: a["block_tables"] * 0 - 1)),
        ("seq_lens", edit(seq_lens=lambda a: a["seq_lens"][None])),
        ("seq_lens must be >=", edit(seq_lens=lambda a: torch.tensor([4, 9], dtype=torch.int32))),
        ("query_start_loc", edit(query_start_loc=lambda a: a["query_start_loc"][:2])),
        ("query_start_loc", edit(query_start_loc=lambda a: torch.tensor([0, 5, 7]).int())),
        ("query_start_loc", edit(query_start_loc=lambda a: torch.tensor([0, 6, 5]).int())),
        ("scale", edit(scale=lambda a: torch.tensor(0.3))),
        ("scale", edit(scale=lambda a: float("nan"))),
        ("block_tables is on meta", edit(block_tables=lambda a: a["block_tables"].to("meta"))),
        ("v_cache is on meta", edit(v_cache=lambda a: a["v_cache"].to("meta"))),
    ]


@pytest.mark.parametrize("fn", [pa.paged_attention, paged_attention_split_kv])
@pytest.mark.parametrize("match,make", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_inputs_raise_value_error(fn, match, make):
    with pytest.raises(ValueError, match=match):
        fn(**make())


@pytest.mark.parametrize("kw,match", [
    ({"out": torch.empty(6, 4, 8, dtype=torch.float16)}, "out"),
    ({"out": torch.empty(6, 4, 16, dtype=torch.float32)}, "out"),
    ({"max_query_len": 4}, "max_query_len"),
    ({"max_query_len": -1}, "max_query_len"),
    ({"kv_split": 100}, "kv_split"),
    ({"kv_split": 0}, "kv_split"),
    ({"kv_ctas": 0}, "kv_ctas"),
])
def test_bad_options_raise_value_error(kw, match):
    with pytest.raises(ValueError, match=match):
        pa.paged_attention(**_good(), **kw)


def test_split_kv_bad_num_splits():
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_split_kv(**_good(), num_splits=0)


def test_write_kv_bad_inputs():
    k = torch.randn(5, 2, 16, dtype=torch.float16)
    cache = torch.zeros(3, 4, 2, 16, dtype=torch.float16)
    slots = torch.arange(5, dtype=torch.int32)
    with pytest.raises(ValueError, match="k must have shape"):
        pa.write_kv(k[:, :1], k, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="v must have shape"):
        pa.write_kv(k, k[:4], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        pa.write_kv(k, k, cache, cache.clone(), slots[:4])
    with pytest.raises(ValueError, match="slot_mapping holds slot 12"):
        pa.write_kv(k, k, cache, cache.clone(), slots + 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        pa.write_kv(k, k, cache, cache.clone(), slots.float())
    with pytest.raises(ValueError, match="v_cache"):
        pa.write_kv(k, k, cache, cache[:2].clone(), slots)
    with pytest.raises(ValueError, match="k_cache is on meta"):
        pa.write_kv(k, k, cache.to("meta"), cache.clone(), slots)


def test_default_kv_ctas_splits_only_few_tiles():
    # Batch 1 and 16 of 8 KV heads split (8 and 128 pairs), batch 32 does not (256 pairs:
    # attention_split_threshold.json); scratch past its cap never splits.
    # The count is a power of two (264 / pairs rounded down): attention_decode_ctas.json.
    assert pa.default_kv_ctas(8, 1000) == 32
    assert pa.default_kv_ctas(32, 1000) == 8
    assert pa.default_kv_ctas(64, 1000) == 4
    assert pa.default_kv_ctas(128, 1000) == 2
    assert pa.default_kv_ctas(191, 1000) == 2
    assert pa.default_kv_ctas(256, 1000) == 1
    assert pa.default_kv_ctas(8, pa._MAX_SCRATCH_FLOATS + 1) == 1


@triton.jit
def _row_sum_64_kernel(x_ptr, out_ptr, M: tl.constexpr):
    rows = tl.arange(0, M)[:, None]
    x = tl.load(x_ptr + rows * 64 + tl.arange(0, 64)[None, :])
    tl.store(out_ptr + tl.arange(0, M), pa.row_sum_64(x))


def test_row_sum_64_is_the_fixed_pairwise_tree():
    """The softmax denominator's block sum is the documented tree, bit for bit; values of
    mixed magnitude make any other order round differently in some row."""
    g = torch.Generator().manual_seed(5)
    x = (torch.rand(16, 64, generator=g) * torch.logspace(-8, 0, 64)[torch.randperm(64,
         generator=g)]).float()
    out = torch.empty(16)
    _row_sum_64_kernel[(1,)](x, out, M=16)
    want = pa.row_sum_64_ref(x)
    assert torch.equal(out, want)
    assert torch.allclose(want.double(), x.double().sum(1), rtol=1e-6)
    assert not torch.equal(want, x.sum(1))  # the order matters for these values


def test_decode_tile_only_where_every_query_fits():
    small, big = pa.decode_tile_config(128, 3), pa.tile_config(128, 3)
    assert small is not None and small.block_m == 16 and big.block_m == 64
    assert pa.call_tile_config(128, 3, 1, torch.bfloat16) == small
    assert pa.call_tile_config(128, 3, 5, torch.float16) == small  # 5 queries x 3 heads
    assert pa.call_tile_config(128, 3, 6, torch.bfloat16) == big
    assert pa.call_tile_config(128, 3, None, torch.bfloat16) == big  # unknown on the host
    assert pa.call_tile_config(128, 3, 1, torch.float32) == big
    assert pa.call_tile_config(128, 32, 1, torch.bfloat16) == pa.tile_config(128, 32)
    assert pa.call_tile_config(256, 2, 1, torch.bfloat16) == pa.tile_config(256, 2)


def test_outgrown_counters_stay_alive():
    """Graphs captured before the split-KV counters grow keep using the old buffer."""
    import gc
    import weakref

    counters = pa._Counters()
    first = counters.get(torch.device("cpu"), 10)
    ref = weakref.ref(first._base)
    del first
    counters.get(torch.device("cpu"), 5000)
    gc.collect()
    assert ref() is not None and len(counters.retired) == 1
    assert counters.get(torch.device("cpu"), 5000).numel() == 5000  # no growth, none retired
    assert len(counters.retired) == 1
