"""Paged attention on the GPU in bf16 at model sizes (D = 128, pages of 16, contexts to 8k):
float64 oracle, bitwise batch invariance (batch sizes 1..64, mixed prefill/decode batches),
prefill = chunked prefill = decode = cached prefix, split = unsplit KV, CUDA-graph replay
of the split path (self-resetting counters), write_kv, and the fast split-KV kernel."""

import itertools

import pytest
import torch

from detlora.ops import paged_attention as pa
from detlora.ops.paged_attention_split_kv import paged_attention_split_kv

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPE = torch.bfloat16
PAGE = 16
D = 128
SCALE = D**-0.5
MODELS = {"llama3b": (24, 8), "qwen3_0_6b": (16, 8)}  # (q heads, kv heads)
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
GARBAGE_PAGE = 1 << 30  # unused block-table entries: never read


class Pool:
    """Sequences' K/V written with write_kv into pages in shuffled order (free slots NaN),
    their dense K/V for the oracle, and a seeded query for every position."""

    def __init__(self, lens, hq, hk, seed, dtype=DTYPE):
        self.lens, self.hq, self.hk, self.seed, self.dtype = list(lens), hq, hk, seed, dtype
        g = torch.Generator(device=DEV).manual_seed(seed)
        pages_per = [-(-n // PAGE) for n in lens]
        total = sum(pages_per) + 5
        perm = torch.randperm(total, device=DEV, generator=g)
        self.k_cache = torch.full((total, PAGE, hk, D), float("nan"), dtype=dtype, device=DEV)
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        self.tables = torch.full((len(lens), max(pages_per) + 2), GARBAGE_PAGE,
                                 dtype=torch.int32, device=DEV)
        self.keys, self.vals, self._queries = [], [], {}
        start = 0
        for b, n in enumerate(lens):
            mine = perm[start:start + pages_per[b]]
            start += pages_per[b]
            self.tables[b, :len(mine)] = mine.int()
            k = torch.randn(n, hk, D, device=DEV, generator=g).to(dtype)
            v = torch.randn(n, hk, D, device=DEV, generator=g).to(dtype)
            pos = torch.arange(n, device=DEV)
            pa.write_kv(k, v, self.k_cache, self.v_cache, mine[pos // PAGE] * PAGE + pos % PAGE)
            self.keys.append(k)
            self.vals.append(v)

    def queries(self, s, first, end):
        if s not in self._queries:
            g = torch.Generator(device=DEV).manual_seed(self.seed * 1000 + s)
            self._queries[s] = torch.randn(self.lens[s], self.hq, D, device=DEV,
                                           generator=g).to(self.dtype)
        return self._queries[s][first:end]

    def attend(self, pieces, fn=pa.paged_attention, **kw):
        """One launch over pieces (sequence, first, end): queries [first, end), context end."""
        q = torch.cat([self.queries(s, a, e) for s, a, e in pieces])
        tables = self.tables[[s for s, _, _ in pieces]]
        seq_lens = torch.tensor([e for _, _, e in pieces], dtype=torch.int32, device=DEV)
        q_lens = [e - a for _, a, e in pieces]
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                           device=DEV)
        out = torch.full_like(q, float("nan"))
        fn(q, self.k_cache, self.v_cache, tables, seq_lens, qsl, SCALE, out=out, **kw)
        return list(out.split(q_lens))

    def oracle(self, s, first, end):
        group = self.hq // self.hk
        q = self.queries(s, first, end).double()
        k = self.keys[s][:end].double().repeat_interleave(group, dim=1)
        v = self.vals[s][:end].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
        future = (torch.arange(end, device=DEV)[None, :]
                  > torch.arange(first, end, device=DEV)[:, None])
        probs = torch.softmax(scores.masked_fill(future[None], float("-inf")), dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v)


def _rel(got, want):
    return float((got.double() - want).norm() / want.norm())


# ----------------------------------------------------------------------------- correctness


def test_write_kv_matches_ref():
    g = torch.Generator(device=DEV).manual_seed(0)
    t, hk, pages = 300, 8, 40
    fused = torch.randn(t, 3 * hk * D, device=DEV, generator=g).to(DTYPE)
    k, v = fused[:, :hk * D].view(t, hk, D), fused[:, hk * D:2 * hk * D].view(t, hk, D)
    slots = torch.randperm(pages * PAGE, device=DEV, generator=g)[:t].int()
    slots[::7] = -1
    base = torch.randn(pages, PAGE, hk, D, device=DEV, generator=g).to(DTYPE)
    got_k, got_v, want_k, want_v = base.clone(), base.clone(), base.clone(), base.clone()
    pa.write_kv(k, v, got_k, got_v, slots)
    pa.write_kv_ref(k, v, want_k, want_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


MIXED = [(8192, 1), (8000, 1), (5000, 300), (1500, 1500), (1, 1), (17, 17), (130, 1),
         (4097, 1), (600, 88)]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("fn,kw", [
    (pa.paged_attention, {}), (pa.paged_attention, {"kv_ctas": 1}),
    (pa.paged_attention, {"kv_ctas": 5}), (pa.paged_attention, {"max_query_len": 1500}),
    (paged_attention_split_kv, {}), (paged_attention_split_kv, {"num_splits": 7}),
], ids=["auto", "unsplit", "split5", "hint", "fast", "fast7"])
def test_mixed_batch_matches_dense_fp64(model, fn, kw):
    pool = Pool([n for n, _ in MIXED], *MODELS[model], seed=1)
    pieces = [(s, n - ql, n) for s, (n, ql) in enumerate(MIXED)]
    for (s, first, end), got in zip(pieces, pool.attend(pieces, fn, **kw), strict=True):
        assert not got.isnan().any()
        assert _rel(got, pool.oracle(s, first, end)) < TOL[DTYPE], (s, first, end)


@pytest.mark.parametrize("fn", [pa.paged_attention, paged_attention_split_kv])
def test_fp16_decode_matches_dense_fp64(fn):
    lens = [8192, 1, 2049, 333]
    pool = Pool(lens, 24, 8, seed=2, dtype=torch.float16)
    pieces = [(s, n - 1, n) for s, n in enumerate(lens)]
    for (s, first, end), got in zip(pieces, pool.attend(pieces, fn, max_query_len=1),
                                    strict=True):
        assert _rel(got, pool.oracle(s, first, end)) < TOL[torch.float16]


# ----------------------------------------------------------------------------- invariance


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("hint", [False, True])
def test_decode_rows_do_not_depend_on_batch(model, hint):
    g = torch.Generator().manual_seed(3)
    targets = [8192, 3001, 517]
    others = torch.randint(1, 8193, (64,), generator=g).tolist()
    pool = Pool(targets + others, *MODELS[model], seed=4)
    n_t = len(targets)
    alone = {t: pool.attend([(t, n - 1, n)], max_query_len=1 if hint else None)[0]
             for t, n in enumerate(targets)}
    for bs in (1, 2, 3, 5, 8, 16, 31, 48, 64):
        for t, n in enumerate(targets):
            pick = torch.randperm(len(others), generator=g)[:bs - 1].tolist()
            pieces = []
            for j, o in enumerate(pick):  # every fourth neighbour is a prefill chunk
                ln = others[o]
                q_len = min(ln, 37) if j % 4 == 3 else 1
                pieces.append((n_t + o, ln - q_len, ln))
            at = int(torch.randint(0, bs, (1,), generator=g))
            pieces.insert(at, (t, n - 1, n))
            mql = max(e - a for _, a, e in pieces) if hint else None
            got = pool.attend(pieces, max_query_len=mql)[at]
            assert torch.equal(got, alone[t]), (bs, t)


@pytest.mark.parametrize("model", MODELS)
def test_prefill_chunked_decode_and_prefix_rows_agree(model):
    length = 3000  # crosses the 512-position segments five times
    pool = Pool([length, 700, 4001], *MODELS[model], seed=5)
    full = pool.attend([(0, 0, length)])[0]

    def check(rows, first, what):
        assert torch.equal(rows, full[first:first + rows.shape[0]]), what

    for bounds in ((0, 1000, 2000, length), (0, 517, length), (0, 1, 512, 513, 1024, length)):
        for a, e in itertools.pairwise(bounds):
            check(pool.attend([(0, a, e)])[0], a, f"chunk {a}:{e}")
    for prefix in (512, 1000, 2048, 2999):
        check(pool.attend([(0, prefix, length)])[0], prefix, f"prefix {prefix}")
    steps = [0, 1, 63, 64, 511, 512, 513, 1023, 1024, 2047, 2048, 2500, 2999]
    for p, row in zip(steps, pool.attend([(0, p, p + 1) for p in steps]), strict=True):
        check(row, p, f"batched decode {p}")
    for p in (0, 512, 2999):
        check(pool.attend([(0, p, p + 1)], max_query_len=1)[0], p, f"decode {p}")
    mixed = pool.attend([(1, 0, 700), (0, 1000, 2000), (2, 4000, 4001), (0, 2999, 3000)])
    check(mixed[1], 1000, "mixed chunk")
    check(mixed[3], 2999, "mixed decode")
    for ctas in (1, 2, 7):
        check(pool.attend([(0, 0, length)], kv_ctas=ctas)[0], 0, f"prefill kv_ctas {ctas}")
        for p, row in zip(steps, pool.attend([(0, p, p + 1) for p in steps], kv_ctas=ctas),
                          strict=True):
            check(row, p, f"decode {p} kv_ctas {ctas}")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_tile_gives_the_prefill_tile_bits(model, dtype):
    """Decode steps on the 16-row tile (max_query_len known) against the same rows of one
    prefill on the 64-row tile: every 7th position of 3000, batched and alone, split over
    CTAs and not, and decode batches of several sequences."""
    hq, hk = MODELS[model]
    assert pa.call_tile_config(D, hq // hk, 1, dtype).block_m == 16
    length = 3000
    pool = Pool([length, 1700, 9000], hq, hk, seed=8, dtype=dtype)
    full = pool.attend([(0, 0, length)])[0]
    others = {1: pool.attend([(1, 0, 1700)])[0], 2: pool.attend([(2, 0, 9000)])[0]}
    steps = [*range(0, length, 7), 511, 512, 513, length - 1]
    for kw in ({}, {"kv_ctas": 1}, {"kv_ctas": 6}):
        rows = pool.attend([(0, p, p + 1) for p in steps], max_query_len=1, **kw)
        for p, row in zip(steps, rows, strict=True):
            assert torch.equal(row, full[p:p + 1]), (p, kw)
    for p in steps[::10]:
        assert torch.equal(pool.attend([(0, p, p + 1)], max_query_len=1)[0], full[p:p + 1]), p
    for n1, n2 in ((1700, 9000), (900, 4097), (1, 64)):
        got = pool.attend([(1, n1 - 1, n1), (2, n2 - 1, n2), (0, 2999, 3000)], max_query_len=1)
        assert torch.equal(got[0], others[1][n1 - 1:n1]), n1
        assert torch.equal(got[1], others[2][n2 - 1:n2]), n2
        assert torch.equal(got[2], full[2999:3000])


def test_split_decode_repeats_bitwise():
    pool = Pool([8192, 5000, 77, 1], 24, 8, seed=6)
    pieces = [(s, n - 1, n) for s, n in enumerate(pool.lens)]
    first = pool.attend(pieces, kv_ctas=16)
    for _ in range(50):
        for a, b in zip(first, pool.attend(pieces, kv_ctas=16), strict=True):
            assert torch.equal(a, b)


def test_split_decode_in_cuda_graph_self_resets():
    lens = [8192, 4000, 1000, 3]
    pool = Pool(lens, 24, 8, seed=7)
    b = len(lens)
    q = torch.randn(b, 24, D, device=DEV).to(DTYPE)
    out = torch.empty_like(q)
    tables = pool.tables.clone()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=DEV)

    def step():
        pa.paged_attention(q, pool.k_cache, pool.v_cache, tables, seq_lens, qsl, SCALE, out=out,
                           max_query_len=1)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # grows the counters outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    for i in range(10):
        q.copy_(torch.randn(b, 24, D, device=DEV, generator=torch.Generator(DEV).manual_seed(i)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = pa.paged_attention(q, pool.k_cache, pool.v_cache, tables, seq_lens, qsl, SCALE,
                                   kv_ctas=1)
        assert torch.equal(out, eager), i
    counters = pa.COUNTERS.buffer(torch.device(DEV, torch.cuda.current_device()))
    assert counters is not None and int(counters.abs().sum()) == 0  # all back at zero
