"""Head sizes that are not powers of two (Phi-3-mini's 96, 80, 48) in the attention path, in
the interpreter: the kernels hold a head in BLOCK_D = next power of two lanes, the padding
masked to zeros in q, K and V and never stored. Checked against a float64 oracle with every
tensor a view into a wider buffer whose gaps are NaN (an unmasked padding lane would read
them, and 0 x NaN is NaN) and an output buffer whose gaps hold a sentinel (an unmasked store
would overwrite it); a query row bit-identical in a prefill, chunks, after a cached prefix,
in decode steps alone or batched, on the decode tile, split over CTAs, with a window; the
same bits as the head zero-padded to 128 lanes; the CPU path; the rotary + KV-write kernels.

fp16 and fp32 only (the interpreter computes bf16 ``tl.dot`` wrongly; bf16 is proven on the
GPU in tests/gpu/test_head_dim_gpu.py).
"""

import pytest
import torch

from detlora.ops import cpu_invariant
from detlora.ops import paged_attention as pa
from detlora.ops.paged_attention_split_kv import paged_attention_split_kv, split_kv_config

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning")

SCALE = 0.29
GAP = 48  # columns of NaN (inputs) or sentinel (output) after every head: >= any padding
SENTINEL = 7.0


def _gapped(shape, d, dtype, fill):
    """A [..., d] view with unit last stride into a [..., d + GAP] buffer holding ``fill``."""
    return torch.full((*shape, d + GAP), fill, dtype=dtype)[..., :d]


class Heads:
    """Sequences' K/V written into shuffled pages of gapped caches, and their queries."""

    def __init__(self, lens, hq, hk, d, page, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        self.hq, self.hk, self.d, self.page, self.dtype = hq, hk, d, page, dtype
        pages_per = [-(-n // page) for n in lens]
        total = sum(pages_per) + 2
        perm = torch.randperm(total, generator=g)
        nan = float("nan")
        self.k_cache = _gapped((total, page, hk), d, dtype, nan)
        self.v_cache = _gapped((total, page, hk), d, dtype, nan)
        self.tables = torch.full((len(lens), max(pages_per) + 1), 987_654, dtype=torch.int32)
        self.keys, self.vals, self.queries, start = [], [], [], 0
        for b, n in enumerate(lens):
            mine = perm[start:start + pages_per[b]]
            start += pages_per[b]
            self.tables[b, :len(mine)] = mine.int()
            k = torch.randn(n, hk, d, generator=g).to(dtype)
            v = torch.randn(n, hk, d, generator=g).to(dtype)
            pos = torch.arange(n)
            pa.write_kv(k, v, self.k_cache, self.v_cache, mine[pos // page] * page + pos % page)
            self.keys.append(k)
            self.vals.append(v)
            self.queries.append(torch.randn(n, hq, d, generator=g).to(dtype))

    def attend(self, pieces, fn=pa.paged_attention, window=None, caches=None, **kw):
        """One launch over pieces (sequence, first, end): queries [first, end), context end;
        q and out are gapped views. Returns one [end - first, Hq, D] output per piece."""
        k_cache, v_cache = caches or (self.k_cache, self.v_cache)
        d = k_cache.shape[-1]
        rows = torch.cat([self.queries[s][a:e] for s, a, e in pieces])
        if d > self.d:  # the same heads zero-padded to d lanes
            rows = torch.nn.functional.pad(rows, (0, d - self.d))
        q = _gapped(rows.shape[:2], d, self.dtype, float("nan"))
        q.copy_(rows)
        tables = torch.stack([self.tables[s] for s, _, _ in pieces])
        seq_lens = torch.tensor([e for _, _, e in pieces], dtype=torch.int32)
        q_lens = [e - a for _, a, e in pieces]
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        if fn is cpu_invariant.paged_attention:
            out = fn(q, k_cache, v_cache, tables, seq_lens, qsl, SCALE, window=window, **kw)
        else:
            out = _gapped(q.shape[:2], d, self.dtype, SENTINEL)
            fn(q, k_cache, v_cache, tables, seq_lens, qsl, SCALE, out=out, window=window, **kw)
            gaps = out.as_strided((*out.shape[:2], GAP), (out.stride(0), out.stride(1), 1),
                                  out.storage_offset() + d)
            assert torch.equal(gaps, torch.full_like(gaps, SENTINEL)), "stored past the head"
        return list(out.split(q_lens))

    def padded_caches(self, d):
        """The caches with every head zero-padded to ``d`` lanes (plain, no gaps)."""
        pad = torch.nn.functional.pad
        return (pad(self.k_cache.nan_to_num(0.0), (0, d - self.d)),
                pad(self.v_cache.nan_to_num(0.0), (0, d - self.d)))

    def oracle(self, s, first, end, window=None):
        group = self.hq // self.hk
        q = self.queries[s][first:end].double()
        k = self.keys[s][:end].double().repeat_interleave(group, dim=1)
        v = self.vals[s][:end].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
        pos_q, pos_k = torch.arange(first, end)[:, None], torch.arange(end)[None, :]
        hidden = pos_k > pos_q
        if window is not None:
            hidden |= pos_k <= pos_q - window
        probs = torch.softmax(scores.masked_fill(hidden[None], float("-inf")), dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v)


def _rel(got, want):
    return float((got.double() - want).norm() / want.norm())


TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
MIXED = [(1, 1), (70, 70), (70, 1), (29, 12)]  # (context, query length)


@pytest.mark.parametrize("dtype,hq,hk,d,page", [
    (torch.float32, 4, 2, 96, 8), (torch.float16, 6, 2, 80, 4), (torch.float16, 3, 1, 48, 8)])
def test_padded_heads_match_dense_fp64(dtype, hq, hk, d, page):
    c = Heads([n for n, _ in MIXED], hq, hk, d, page, dtype, seed=d)
    pieces = [(s, n - ql, n) for s, (n, ql) in enumerate(MIXED)]
    # Each path once over the cases (the interpreter is slow): one CTA, the KV split over
    # CTAs and folded, the fast kernel and its combine, the decode tile (16-bit only).
    runs = {"split KV": dict(kv_split=64, kv_ctas=3)} if d == 80 else {"one CTA": {}}
    if dtype == torch.float32:
        runs = {"fast split-KV": dict(fn=paged_attention_split_kv, num_splits=3)}
    for name, kw in runs.items():
        for (s, a, e), got in zip(pieces, c.attend(pieces, **kw), strict=True):
            assert not got.isnan().any(), (name, s)
            assert _rel(got, c.oracle(s, a, e)) < TOL[dtype], (name, s, a, e)
    if dtype == torch.float16:
        decode = [(s, n - 1, n) for s, (n, _) in enumerate(MIXED)]
        assert pa.call_tile_config(d, hq // hk, 1, dtype).block_m == 16  # the decode tile
        for (s, a, e), got in zip(decode, c.attend(decode, max_query_len=1), strict=True):
            assert _rel(got, c.oracle(s, a, e)) < TOL[dtype], ("decode tile", s)


@pytest.mark.parametrize("fn,d,window", [("triton", 96, 20), ("cpu_invariant", 96, None),
                                         ("cpu_invariant", 80, 20)])
def test_rows_identical_in_every_mode(fn, d, window):
    """A query row's bits in one prefill are those of every other way to it, and (kernel)
    those of the same head zero-padded to 128 lanes."""
    attn = pa.paged_attention if fn == "triton" else cpu_invariant.paged_attention
    c = Heads([70, 23], 6, 2, d, 8, torch.float16, seed=3 + d)
    kw = {"kv_split": 64, "kv_ctas": 1} if fn == "triton" else {}
    full = c.attend([(0, 0, 70)], attn, window, **kw)[0]

    def check(rows, first, what):
        assert torch.equal(rows, full[first:first + rows.shape[0]]), what

    for a, e in ((0, 5), (5, 21), (21, 70)):  # chunked prefill across the window and block
        check(c.attend([(0, a, e), (1, 0, 23)], attn, window, **kw)[0], a, f"chunk {a}:{e}")
    steps = [0, 20, 63, 64, 69]
    for p in steps:
        check(c.attend([(0, p, p + 1)], attn, window, **kw)[0], p, f"decode {p}")
    batched = c.attend([(1, 22, 23), *[(0, p, p + 1) for p in steps]], attn, window, **kw)
    for p, row in zip(steps, batched[1:], strict=True):
        check(row, p, f"batched decode {p}")
    if fn != "triton":
        return
    for p, row in zip(steps, c.attend([(0, p, p + 1) for p in steps], attn, window,
                                      max_query_len=1, **kw), strict=True):
        check(row, p, f"decode tile {p}")
    check(c.attend([(0, 0, 70)], attn, window, kv_split=64, kv_ctas=2)[0], 0, "split prefill")
    check(c.attend([(0, 69, 70)], attn, window, kv_split=64, kv_ctas=2, max_query_len=1)[0],
          69, "split decode")
    padded = c.attend([(0, 0, 70)], attn, window, caches=c.padded_caches(128), **kw)[0]
    assert torch.equal(padded[..., :d], full), "a 128-lane head padded with zeros"


def test_tiles_follow_the_padded_head():
    for group in (1, 3, 4, 8, 32):
        assert pa.tile_config(96, group) == pa.tile_config(128, group)
        assert pa.tile_config(80, group) == pa.tile_config(128, group)
        assert pa.tile_config(192, group) == pa.tile_config(256, group)
        assert pa.decode_tile_config(96, group) == pa.decode_tile_config(128, group)
        assert split_kv_config(160, group, True) == split_kv_config(256, group, True)
    assert [pa.head_lanes_width(d) for d in (48, 64, 80, 96, 112, 128, 160, 320)] == \
        [64, 64, 128, 128, 128, 128, 256, 512]
    assert pa.decode_tile_config(160, 4) is None  # 256 lanes: the prefill tile only


@pytest.mark.parametrize("d", [96, 80])
def test_rotary_and_kv_writes(d):
    """rotary_write_kv and the fused LoRA expand + rotary + KV write at a padded head: the
    bits of the ops they fuse, every row and lane."""
    import itertools

    from detlora.ops.lora_expand import lora_expand
    from detlora.ops.lora_expand_rotary_write_kv import lora_expand_rotary_write_kv
    from detlora.ops.rotary import rope_cos_sin_cache, rotary, rotary_ref
    from detlora.ops.rotary_write_kv import rotary_write_kv

    g = torch.Generator().manual_seed(d)
    m, hq, hk, r, dtype, page, pages = 6, 3, 1, 16, torch.float16, 4, 4
    width = (hq + 2 * hk) * d
    y = torch.randn(m, width, generator=g).to(dtype)
    h = torch.randn(3, m, r, generator=g).to(torch.float32)
    b = (torch.randn(2, width, r, generator=g) * 0.1).to(dtype)
    ids = torch.tensor([0, -1, 1, 0, 1, -1], dtype=torch.int32)
    offsets = [0, hq * d, (hq + hk) * d, width]
    pos = torch.randint(0, 200, (m,), generator=g)
    slots = torch.randperm(pages * page, generator=g)[:m]
    slots[2] = -1
    cos_sin = rope_cos_sin_cache(d, 256, 10000.0)
    cache = torch.randn(2, pages, page, hk, d, generator=g).to(dtype)

    kc, vc = cache[0].clone(), cache[1].clone()
    got_q = lora_expand_rotary_write_kv(y, h, b, ids, offsets, pos, cos_sin, kc, vc, slots)
    y2 = lora_expand(y.clone(), h, b, ids, offsets)
    q, k, v = (y2[:, lo:hi].view(m, -1, d) for lo, hi in itertools.pairwise(offsets))
    wk, wv = cache[0].clone(), cache[1].clone()
    want_q = rotary_write_kv(q, k, v, pos, cos_sin, wk, wv, slots)
    assert torch.equal(got_q, want_q) and torch.equal(kc, wk) and torch.equal(vc, wv)
    # rotary_write_kv is rotary then write_kv, bit for bit.
    rq, rk = rotary(q, k, pos, cos_sin)
    ek, ev = cache[0].clone(), cache[1].clone()
    pa.write_kv(rk, v, ek, ev, slots)
    assert torch.equal(want_q, rq) and torch.equal(wk, ek) and torch.equal(wv, ev)
    ref_q, _ = rotary_ref(q, k, pos, cos_sin)
    assert _rel(want_q, ref_q.double()) < 2e-3


# Run without the interpreter (sm90_compile's subprocess): the padded-head variants that
# the interpreter cannot show compile for the GPU, each on tensor cores.
_SM90_SCRIPT = r"""
import json, sys
from compile_sm90 import compile_kernel, ptx_summary
from detlora.ops import paged_attention as pa
from detlora.ops import paged_attention_split_kv as sk

d = json.loads(sys.argv[1])
ptrs = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
        "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "counter_ptr": "*i32"}
common = dict(PAGE=16, GROUP=3, HEAD_DIM=d, BLOCK_D=pa.head_lanes_width(d), BLOCK_N=64,
              SEARCH=False, BLOCK_B=128, SPLIT=True, DOT_PRECISION="tf32", HAS_WINDOW=True,
              PDL=True)
cfg = pa.decode_tile_config(d, 3)
k, _ = compile_kernel(pa._paged_attention_kernel,
                      dict(common, BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_m // 3, MERGE_ROWS=16),
                      ptrs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                      int_types={"qk_scale": "fp32"})
s = ptx_summary(k.asm["ptx"])
k2, _ = compile_kernel(sk._combine_kernel, dict(HEAD_DIM=d, BLOCK_D=pa.head_lanes_width(d),
                                                SPLITS_P2=8, PDL=True),
                       {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"})
print(json.dumps([s.get("mma.sync", 0) + s.get("wgmma.mma_async", 0),
                  s.get("atom.global.gpu.acq_rel.add.u32", 0), len(k2.asm["ptx"]) > 0]))
"""


def test_padded_head_kernels_compile_for_sm90(sm90_compile):
    """The split, windowed attention kernel on the decode tile (every padded helper: loads,
    partial stores and loads, the fold's stores) and the fast kernel's combine, at 96."""
    mmas, atomics, combine = sm90_compile(_SM90_SCRIPT, 96)
    assert mmas > 0 and atomics == 1 and combine
