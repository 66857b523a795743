"""Head sizes that are not powers of two on the GPU in bf16: 96 (Phi-3-mini / Phi-3.5-mini,
32 q and 32 KV heads; and GQA 3), 80 (Phi-2, StableLM), beside 128 (unchanged). The kernels
hold a head in BLOCK_D = next power of two lanes, padding masked to zeros (ops/paged_attention.py,
``head_lanes``). Checked bit for bit: decode rows across batch sizes 1..64 and batch makeup
(with and without the decode tile), prefill = chunked prefill = cached prefix = decode,
split = unsplit KV, the decode tile = the prefill tile, with and without a sliding window;
the same bits as the head zero-padded to 128 lanes (padding changes no real lane); the
float64 oracle for both kernels (and the fast kernel's combine); the fused rotary / LoRA
expand + KV-write kernels at 96 against the ops they fuse; nothing stored past a head.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from detlora.ops import paged_attention as pa
from detlora.ops.paged_attention_split_kv import paged_attention_split_kv

pytestmark = pytest.mark.gpu

DEV = "cuda"
PAGE = 16
GAP = 48  # columns after every head: NaN in the inputs, a sentinel in the output
SENTINEL = 7.0
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
# (q heads, kv heads, head_dim)
SHAPES = {"phi3.5-mini": (32, 32, 96), "gqa3-96": (24, 8, 96), "phi2-80": (32, 32, 80),
          "llama-128": (24, 8, 128)}


def _gapped(shape, d, dtype, fill):
    """A [..., d] view with unit last stride into a [..., d + GAP] buffer of ``fill``."""
    return torch.full((*shape, d + GAP), fill, dtype=dtype, device=DEV)[..., :d]


class Pool:
    """Sequences' K/V written with write_kv into shuffled pages of gapped caches (free slots
    and gaps NaN), their dense K/V for the oracle, and a seeded query for every position."""

    def __init__(self, lens, hq, hk, d, seed, dtype=torch.bfloat16):
        self.lens, self.hq, self.hk, self.d, self.seed, self.dtype = (list(lens), hq, hk, d,
                                                                      seed, dtype)
        self.scale = d**-0.5
        g = torch.Generator(device=DEV).manual_seed(seed)
        pages_per = [-(-n // PAGE) for n in lens]
        total = sum(pages_per) + 5
        perm = torch.randperm(total, device=DEV, generator=g)
        self.k_cache = _gapped((total, PAGE, hk), d, dtype, float("nan"))
        self.v_cache = _gapped((total, PAGE, hk), d, dtype, float("nan"))
        self.tables = torch.full((len(lens), max(pages_per) + 2), 1 << 30, dtype=torch.int32,
                                 device=DEV)
        self.keys, self.vals, self._queries = [], [], {}
        start = 0
        for b, n in enumerate(lens):
            mine = perm[start:start + pages_per[b]]
            start += pages_per[b]
            self.tables[b, :len(mine)] = mine.int()
            k = torch.randn(n, hk, d, device=DEV, generator=g).to(dtype)
            v = torch.randn(n, hk, d, device=DEV, generator=g).to(dtype)
            pos = torch.arange(n, device=DEV)
            pa.write_kv(k, v, self.k_cache, self.v_cache, mine[pos // PAGE] * PAGE + pos % PAGE)
            self.keys.append(k)
            self.vals.append(v)

    def queries(self, s, first, end):
        if s not in self._queries:
            g = torch.Generator(device=DEV).manual_seed(self.seed * 1000 + s)
            self._queries[s] = torch.randn(self.lens[s], self.hq, self.d, device=DEV,
                                           generator=g).to(self.dtype)
        return self._queries[s][first:end]

    def padded_caches(self, d):
        pad = torch.nn.functional.pad
        return (pad(self.k_cache.nan_to_num(0.0), (0, d - self.d)),
                pad(self.v_cache.nan_to_num(0.0), (0, d - self.d)))

    def attend(self, pieces, fn=pa.paged_attention, caches=None, **kw):
        """One launch over pieces (sequence, first, end): queries [first, end), context end;
        q and out gapped. Returns one [end - first, Hq, D] output per piece."""
        k_cache, v_cache = caches or (self.k_cache, self.v_cache)
        d = k_cache.shape[-1]
        rows = torch.cat([self.queries(s, a, e) for s, a, e in pieces])
        if d > self.d:
            rows = torch.nn.functional.pad(rows, (0, d - self.d))
        q = _gapped(rows.shape[:2], d, self.dtype, float("nan"))
        q.copy_(rows)
        tables = self.tables[[s for s, _, _ in pieces]]
        seq_lens = torch.tensor([e for _, _, e in pieces], dtype=torch.int32, device=DEV)
        q_lens = [e - a for _, a, e in pieces]
        qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEV)
        out = _gapped(q.shape[:2], d, self.dtype, SENTINEL)
        fn(q, k_cache, v_cache, tables, seq_lens, qsl, self.scale, out=out, **kw)
        gaps = out.as_strided((*out.shape[:2], GAP), (out.stride(0), out.stride(1), 1),
                              out.storage_offset() + d)
        assert bool((gaps == SENTINEL).all()), "a kernel stored past the head"
        return list(out.split(q_lens))

    def oracle(self, s, first, end, window=None):
        group = self.hq // self.hk
        q = self.queries(s, first, end).double()
        k = self.keys[s][:end].double().repeat_interleave(group, dim=1)
        v = self.vals[s][:end].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
        pos_q = torch.arange(first, end, device=DEV)[:, None]
        pos_k = torch.arange(end, device=DEV)[None, :]
        hidden = pos_k > pos_q
        if window is not None:
            hidden |= pos_k <= pos_q - window
        probs = torch.softmax(scores.masked_fill(hidden[None], float("-inf")), dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v)


def _rel(got, want):
    return float((got.double() - want).norm() / want.norm())


MIXED = [(8192, 1), (5000, 300), (1500, 1500), (1, 1), (17, 17), (130, 1), (4097, 1),
         (600, 88)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fn,kw", [
    (pa.paged_attention, {}), (pa.paged_attention, {"kv_ctas": 1}),
    (pa.paged_attention, {"kv_ctas": 5}), (pa.paged_attention, {"window": 700}),
    (paged_attention_split_kv, {}), (paged_attention_split_kv, {"num_splits": 7}),
], ids=["auto", "unsplit", "split5", "window", "fast", "fast7"])
def test_mixed_batch_matches_dense_fp64(shape, fn, kw):
    pool = Pool([n for n, _ in MIXED], *SHAPES[shape], seed=1)
    pieces = [(s, n - ql, n) for s, (n, ql) in enumerate(MIXED)]
    for (s, first, end), got in zip(pieces, pool.attend(pieces, fn, **kw), strict=True):
        assert not got.isnan().any()
        want = pool.oracle(s, first, end, kw.get("window"))
        assert _rel(got, want) < TOL[torch.bfloat16], (s, first, end)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hint", [False, True])
@pytest.mark.parametrize("window", [None, 1000])
def test_decode_rows_do_not_depend_on_batch(shape, hint, window):
    g = torch.Generator().manual_seed(3)
    targets = [8192, 3001, 517]
    others = torch.randint(1, 8193, (64,), generator=g).tolist()
    pool = Pool(targets + others, *SHAPES[shape], seed=4)
    n_t = len(targets)
    alone = {t: pool.attend([(t, n - 1, n)], max_query_len=1 if hint else None,
                            window=window)[0] for t, n in enumerate(targets)}
    for bs in (1, 2, 3, 8, 16, 31, 64):
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
            got = pool.attend(pieces, max_query_len=mql, window=window)[at]
            assert torch.equal(got, alone[t]), (bs, t)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [None, 700])
def test_prefill_chunked_decode_prefix_and_split_rows_agree(shape, window):
    length = 3000  # crosses the 512-position segments five times
    pool = Pool([length, 700, 4001], *SHAPES[shape], seed=5)
    full = pool.attend([(0, 0, length)], window=window)[0]

    def check(rows, first, what):
        assert torch.equal(rows, full[first:first + rows.shape[0]]), what

    for bounds in ((0, 1000, 2000, length), (0, 517, length), (0, 1, 512, 513, 1024, length)):
        for a, e in itertools.pairwise(bounds):
            check(pool.attend([(0, a, e)], window=window)[0], a, f"chunk {a}:{e}")
    for prefix in (512, 1000, 2999):
        check(pool.attend([(0, prefix, length)], window=window)[0], prefix, f"prefix {prefix}")
    steps = [0, 1, 63, 64, 511, 512, 699, 700, 701, 1024, 2048, 2999]
    for p, row in zip(steps, pool.attend([(0, p, p + 1) for p in steps], window=window),
                      strict=True):
        check(row, p, f"batched decode {p}")
    mixed = pool.attend([(1, 0, 700), (0, 1000, 2000), (2, 4000, 4001), (0, 2999, 3000)],
                        window=window)
    check(mixed[1], 1000, "mixed chunk")
    check(mixed[3], 2999, "mixed decode")
    for ctas in (1, 2, 7):
        check(pool.attend([(0, 0, length)], kv_ctas=ctas, window=window)[0], 0,
              f"prefill kv_ctas {ctas}")
        for p, row in zip(steps, pool.attend([(0, p, p + 1) for p in steps], kv_ctas=ctas,
                                             window=window), strict=True):
            check(row, p, f"decode {p} kv_ctas {ctas}")
    padded = pool.attend([(0, 0, length)], window=window, caches=pool.padded_caches(128)
                         if pool.d < 128 else None)[0]
    assert torch.equal(padded[..., :pool.d], full), "zero-padded to 128 lanes"


@pytest.mark.parametrize("shape", ["gqa3-96", "phi3.5-mini", "phi2-80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_tile_gives_the_prefill_tile_bits(shape, dtype):
    """Decode steps on the 16-row tile (max_query_len known) against the same rows of one
    prefill on the 64-row tile, batched and alone, split over CTAs and not."""
    hq, hk, d = SHAPES[shape]
    assert pa.call_tile_config(d, hq // hk, 1, dtype).block_m == 16
    length = 3000
    pool = Pool([length, 1700], hq, hk, d, seed=8, dtype=dtype)
    full = pool.attend([(0, 0, length)])[0]
    other = pool.attend([(1, 0, 1700)])[0]
    steps = [*range(0, length, 7), 511, 512, 513, length - 1]
    for kw in ({}, {"kv_ctas": 1}, {"kv_ctas": 6}):
        rows = pool.attend([(0, p, p + 1) for p in steps], max_query_len=1, **kw)
        for p, row in zip(steps, rows, strict=True):
            assert torch.equal(row, full[p:p + 1]), (p, kw)
    for n1 in (1700, 900, 1):
        got = pool.attend([(1, n1 - 1, n1), (0, 2999, 3000)], max_query_len=1)
        assert torch.equal(got[0], other[n1 - 1:n1]), n1
        assert torch.equal(got[1], full[2999:3000])


def test_fast_kernel_decode_rows_repeat():
    """The fast (split-KV, not batch-invariant) kernel at 96: a fixed batch repeats bit for
    bit, through its combine kernel."""
    pool = Pool([8192, 5000, 77, 1], 32, 32, 96, seed=6)
    pieces = [(s, n - 1, n) for s, n in enumerate(pool.lens)]
    first = pool.attend(pieces, paged_attention_split_kv, max_query_len=1)
    for _ in range(20):
        again = pool.attend(pieces, paged_attention_split_kv, max_query_len=1)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.parametrize("d", [96, 80])
def test_fused_rotary_and_kv_writes(d):
    """rotary_write_kv and the LoRA expand fused with rotary and the KV write, at a padded
    head in bf16: the bits of the ops they fuse (rotary, write_kv; lora_expand, then
    rotary_write_kv), over 300 rows of three adapters and the base."""
    from detlora.ops.lora_expand import lora_expand
    from detlora.ops.lora_expand_rotary_write_kv import lora_expand_rotary_write_kv
    from detlora.ops.rotary import rope_cos_sin_cache, rotary
    from detlora.ops.rotary_write_kv import rotary_write_kv

    g = torch.Generator(device=DEV).manual_seed(d)
    m, hq, hk, r, dtype, pages = 300, 32, 8, 16, torch.bfloat16, 40
    width = (hq + 2 * hk) * d
    y = torch.randn(m, width, device=DEV, generator=g).to(dtype)
    h = torch.randn(3, m, r, device=DEV, generator=g)
    b = (torch.randn(3, width, r, device=DEV, generator=g) * 0.1).to(dtype)
    ids = torch.randint(-1, 3, (m,), device=DEV, generator=g).int()
    offsets = [0, hq * d, (hq + hk) * d, width]
    pos = torch.randint(0, 4000, (m,), device=DEV, generator=g)
    slots = torch.randperm(pages * PAGE, device=DEV, generator=g)[:m]
    slots[::11] = -1
    cos_sin = rope_cos_sin_cache(d, 4096, 10000.0).to(DEV)
    cache = torch.randn(2, pages, PAGE, hk, d, device=DEV, generator=g).to(dtype)

    kc, vc = cache[0].clone(), cache[1].clone()
    got_q = lora_expand_rotary_write_kv(y, h, b, ids, offsets, pos, cos_sin, kc, vc, slots)
    y2 = lora_expand(y.clone(), h, b, ids, offsets)
    q, k, v = (y2[:, lo:hi].view(m, -1, d) for lo, hi in itertools.pairwise(offsets))
    wk, wv = cache[0].clone(), cache[1].clone()
    want_q = rotary_write_kv(q, k, v, pos, cos_sin, wk, wv, slots)
    assert torch.equal(got_q, want_q) and torch.equal(kc, wk) and torch.equal(vc, wv)
    rq, rk = rotary(q, k, pos, cos_sin)
    ek, ev = cache[0].clone(), cache[1].clone()
    pa.write_kv(rk, v, ek, ev, slots)
    assert torch.equal(want_q, rq) and torch.equal(wk, ek) and torch.equal(wv, ev)
