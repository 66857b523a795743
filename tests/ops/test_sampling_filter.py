"""The filter kernels of detlora.ops.sampling in the interpreter (scale_ranked, kept_ranks,
cut_filter) against their torch references bit for bit: one and many chunks, cuts on chunk
edges, exact limits, ties, -0.0, NaN and infinities, the IEEE division, strided rows, bad
inputs; and their sm_90 compilation (no spills, ``div.rn.f32``)."""

import pytest
import torch

from detlora.ops import sampling as sp

INF = float("inf")
NO_LIMIT = 1 << 62


def _x(n, v, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g) * 3).to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal on the fp32 bit patterns: NaN equals NaN, -0.0 differs from +0.0."""
    return a.dtype == b.dtype == torch.float32 and torch.equal(
        a.view(torch.int32), b.view(torch.int32))


def _sorted(x):
    return torch.sort(x, dim=-1, descending=True, stable=True)


def _small(monkeypatch):
    """Chunks of 16 ranks and blocks of 32 tokens: V = 150 has 10 chunks, 5 blocks."""
    monkeypatch.setattr(sp, "_COUNT_CHUNK", 16)
    monkeypatch.setattr(sp, "_FILTER_BLOCK", 32)
    assert sp.kept_ranks_config(150) == (16, 10, 16, 1)
    assert sp.filter_block_config(150)[:2] == (32, 5)


def test_configs_depend_on_the_vocabulary_only():
    assert sp.kept_ranks_config(128256) == (2048, 63, 64, 4)
    assert sp.kept_ranks_config(151936) == (2048, 75, 128, 4)
    assert sp.kept_ranks_config(5) == (8, 1, 1, 1)
    assert sp.filter_block_config(128256) == (1024, 126, 4)
    assert sp.filter_block_config(3) == (4, 1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("small", [False, True])
def test_scale_ranked_matches_reference(monkeypatch, dtype, small):
    if small:
        _small(monkeypatch)
    v = 150 if small else 1500
    s, _ = _sorted(_x(6, v, seed=1, dtype=dtype))
    s[5, 100:] = -INF
    temps = torch.tensor([1.0, 0.7, 1.3, 2.0, 0.05, 3.0])
    top_k = torch.tensor([0, 1, 32, 33, v, v + 7])  # 32: a block edge when small
    for tk in (top_k, None):
        got = sp.scale_ranked(s, temps, tk)
        assert got.dtype == torch.float32 and got.shape == (6, v)
        assert torch.equal(got, sp.scale_ranked_ref(s, temps, tk))
    assert torch.equal(sp.scale_ranked(s, temps, None), s.float() / temps[:, None])


def _probs(n, v, seed):
    """Unnormalised non-negative fp32 rows with total mass up to ~2 (<= 2^41 units)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, v, generator=g) ** 4
    return p / p.sum(-1, keepdim=True) * torch.linspace(0.5, 2.0, n)[:, None]


@pytest.mark.parametrize("small,n,v", [
    (False, 1, 1), (False, 3, 7), (False, 4, 1000), (False, 3, 5003),  # 1, 1, 1, 3 chunks
    (True, 1, 1), (True, 5, 150), (True, 4, 1000),  # 1, 10, 63 chunks
])
def test_kept_ranks_matches_reference(monkeypatch, small, n, v):
    if small:
        _small(monkeypatch)
    probs = _probs(n, v, seed=n * v)
    limit = (torch.tensor([0.3, 0.95, 0.0, 1.0, 0.5])[:n] * 2**40).long()
    limit[-1] = NO_LIMIT
    top_k = torch.tensor([v, 1, 17, v + 3, max(1, v // 2)])[:n]
    for tk in (top_k, None):
        got = sp.kept_ranks(probs, limit, tk)
        assert got.dtype == torch.int64 and got.shape == (n,)
        assert torch.equal(got, sp.kept_ranks_ref(probs, limit, tk))
        assert int(got.min()) >= 1 and int(got.max()) <= v


def test_kept_ranks_exact_limits_chunk_edges_and_nan(monkeypatch):
    _small(monkeypatch)
    v = 150
    probs = _probs(1, v, seed=4).repeat(12, 1)
    mass = torch.floor(probs.double() * 2**40).long()
    before = torch.cumsum(mass, -1) - mass
    # Limits on a rank's start (not kept) and one unit above (kept), at chunk edges 16, 32,
    # inside a chunk (40) and at the last rank; 0 keeps the best rank alone.
    ranks = [16, 32, 40, 149]
    limit = torch.tensor([int(before[0, r]) for r in ranks] + [int(before[0, r]) + 1 for r in ranks]
                         + [0, -5, NO_LIMIT, int(before[0, -1]) + int(mass[0, -1])])
    want = ranks + [r + 1 for r in ranks] + [1, 1, v, v]
    got = sp.kept_ranks(probs, limit, None)
    assert got.tolist() == want
    assert torch.equal(got, sp.kept_ranks_ref(probs, limit, None))
    # top_k cuts first: on a chunk edge, past the top-p count, and above V.
    top_k = torch.tensor([16, 17, 5, 200, 1, 0, 33, 150, 3, 1, 64, 2])
    got = sp.kept_ranks(probs, limit, top_k)
    assert torch.equal(got, sp.kept_ranks_ref(probs, limit, top_k))
    assert got.tolist() == [max(1, min(k, w)) for k, w in zip(top_k.tolist(), want, strict=True)]
    # NaN probabilities (a row of -inf or +inf logits) count as no mass.
    probs[0, 3] = probs[1, 20] = float("nan")
    probs[2] = float("nan")
    assert torch.equal(sp.kept_ranks(probs, limit, None), sp.kept_ranks_ref(probs, limit, None))
    assert sp.kept_ranks(probs, limit, None)[2] == v  # no mass: every rank starts at 0 < limit


def _cut_inputs(n, v, seed, dtype):
    x = _x(n, v, seed, dtype)
    x[1] = torch.round(x[1])  # ties everywhere
    x[2, ::2] = 0.0
    x[2, 1::2] = -0.0
    x[3, : v // 2] = -INF
    x[4, [5, 9]] = INF
    x[4, [3, 11]] = float("nan")
    x[5] = -INF
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("small", [False, True])
def test_cut_filter_keeps_the_best_ranks_in_token_order(monkeypatch, dtype, small):
    if small:
        _small(monkeypatch)
    v = 150 if small else 1500
    logits = _cut_inputs(6, v, seed=7, dtype=dtype)
    temps = torch.tensor([0.7, 1.0, 1.3, 2.0, 0.5, 1.0])
    _, order = _sorted(logits)
    x = logits.float() / temps[:, None]
    for kept in ([1, 2, 3, 1, 4, 1], [v // 3, v // 2, v // 2 + 1, v - 1, 3, v],
                 [0, -3, v + 1, v, 2, 7]):  # out of [1, V]: clamped
        kept = torch.tensor(kept)
        got = sp.cut_filter(logits, temps, order, kept)
        assert _same_bits(got, sp.cut_filter_ref(logits, temps, order, kept))
        # The kept tokens are exactly order[:, :R] (the scatter the filter replaces).
        r = kept.clamp(1, v)
        ranks = torch.arange(v)[None, :] < r[:, None]
        scattered = torch.empty_like(x).scatter_(
            1, order, x.gather(1, order).masked_fill(~ranks, -INF))
        assert _same_bits(got, scattered)
    assert _same_bits(sp.cut_filter(logits, temps, None, None), x)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_cut_filter_division_is_ieee():
    """Subnormal, huge, tiny and ordinary quotients: torch's (IEEE) bits, not approximate."""
    g = torch.Generator().manual_seed(3)
    logits = torch.cat([
        torch.randn(4, 200, generator=g) * 3,
        torch.randn(4, 200, generator=g) * 1e-38,  # subnormal quotients
        torch.randn(4, 200, generator=g) * 3e38,  # overflow to inf for t < 1
    ])
    temps = torch.rand(12, generator=g) * 2 + 0.01
    temps[0], temps[4], temps[8] = 0.3, 7.0, 0.9
    assert _same_bits(sp.cut_filter(logits, temps, None, None), logits / temps[:, None])


def test_filter_ops_take_strided_rows():
    logits = _x(4, 300, seed=5)[:, :250]  # row stride 300
    slots = torch.zeros(4, dtype=torch.int64)
    slots.view(torch.float32)[::2] = torch.tensor([0.5, 1.0, 2.0, 1.5])
    temps = slots.view(torch.float32)[::2]  # stride 2, as the sampler's
    big = torch.tensor([[9, 3, 7, 0], [200, 1, 250, 0]])
    top_k, kept = big[0, ::2].repeat(2), big[1, ::2].repeat(2)  # stride 1 copies, and:
    top_k_s, kept_s = big[:, 0].repeat(2), big[:, 2].repeat(2)
    s, order = _sorted(logits)
    for tk, kp in ((top_k, kept), (top_k_s, kept_s), (big[0, :], big[1, :])):
        assert torch.equal(sp.scale_ranked(s, temps, tk), sp.scale_ranked_ref(s, temps, tk))
        assert torch.equal(sp.cut_filter(logits, temps, order, kp),
                           sp.cut_filter_ref(logits, temps, order, kp))
    probs = torch.softmax(s, -1)
    limit = torch.tensor([NO_LIMIT, 0, 2**39, 2**38])
    tk = big.t().reshape(-1)[::2]  # stride 2
    assert tk.stride(0) == 2
    assert torch.equal(sp.kept_ranks(probs, limit, tk), sp.kept_ranks_ref(probs, limit, tk))


def test_rows_do_not_depend_on_the_batch(monkeypatch):
    _small(monkeypatch)
    v = 150
    logits = _cut_inputs(6, v, seed=8, dtype=torch.float32)
    temps = torch.tensor([0.7, 1.0, 1.3, 2.0, 0.5, 1.0])
    top_k = torch.tensor([3, 150, 40, 17, 2, 90])
    limit = torch.tensor([2**39, NO_LIMIT, 2**38, 0, 2**40, 2**35])
    s, order = _sorted(logits)
    probs = torch.softmax(sp.scale_ranked(s, temps, top_k), -1)
    kept = sp.kept_ranks(probs, limit, top_k)
    out = sp.cut_filter(logits, temps, order, kept)
    for i in range(6):
        one = slice(i, i + 1)
        assert torch.equal(sp.kept_ranks(probs[one], limit[one], top_k[one]), kept[one])
        assert _same_bits(sp.cut_filter(logits[one], temps[one], order[one], kept[one]),
                          out[one])


def test_empty_batch():
    z = torch.zeros(0, 9)
    none = torch.zeros(0, dtype=torch.int64)
    assert sp.scale_ranked(z, torch.zeros(0), none).shape == (0, 9)
    assert sp.kept_ranks(z, none, none).shape == (0,)
    assert sp.cut_filter(z, torch.zeros(0), none.view(0, 9), none).shape == (0, 9)


def test_bad_inputs_raise_value_error(monkeypatch):
    x = _x(3, 16, seed=1)
    s, order = _sorted(x)
    t, k = torch.ones(3), torch.full((3,), 4)
    lim = torch.full((3,), NO_LIMIT)
    cases = [
        (lambda: sp.scale_ranked(s.double(), t, k), "sorted_logits must have dtype"),
        (lambda: sp.scale_ranked(s[0], t, k), "sorted_logits must have 2 dimensions"),
        (lambda: sp.scale_ranked(s.t(), t.repeat(6)[:16], None), "sorted_logits must be contig"),
        (lambda: sp.scale_ranked(s[:, :0], t, k), "sorted_logits must have at least one"),
        (lambda: sp.scale_ranked(s, t.half(), k), "temps must have dtype"),
        (lambda: sp.scale_ranked(s, t, k[:2]), r"top_k must have shape \(3,\)"),
        (lambda: sp.scale_ranked(s, t, k.to("meta")), "top_k is on meta"),
        (lambda: sp.kept_ranks(s.half(), lim, k), "probs must have dtype"),
        (lambda: sp.kept_ranks(s, lim.int(), k), "limit must have dtype"),
        (lambda: sp.kept_ranks(s, lim[:, None], k), "limit must have 1 dimensions"),
        (lambda: sp.kept_ranks(s, lim, k.float()), "top_k must have dtype"),
        (lambda: sp.kept_ranks(s, [1, 2, 3], k), "limit must be a torch.Tensor"),
        (lambda: sp.cut_filter(x, t, order, None), "order and kept must both be given"),
        (lambda: sp.cut_filter(x, t, None, k), "order and kept must both be given"),
        (lambda: sp.cut_filter(x, t, order.int(), k), "order must have dtype"),
        (lambda: sp.cut_filter(x, t, order[:, :8], k), r"order must have shape \(3, 16\)"),
        (lambda: sp.cut_filter(x, t, order, k[:1]), r"kept must have shape \(3,\)"),
        (lambda: sp.cut_filter(x, t[:2], order, k), r"temps must have shape \(3,\)"),
        (lambda: sp.cut_filter(x.to(torch.int64), t, order, k), "logits must have dtype"),
        (lambda: sp.cut_filter(x, t, order.to("meta"), k), "order is on meta"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for call in (lambda: sp.scale_ranked(s, t, k), lambda: sp.kept_ranks(s, lim, k),
                 lambda: sp.cut_filter(x, t, order, k)):
        with pytest.raises(ValueError, match="Triton kernels need CUDA tensors"):
            call()


_SM90_SCRIPT = r"""
import json, re, sys
from compile_sm90 import compile_kernel, ptx_summary, ptxas_spills
from detlora.ops import sampling as sp

base = {"temps_ptr": "*fp32", "top_k_ptr": "*i64", "out_ptr": "*fp32", "p_ptr": "*fp32",
        "part_ptr": "*i64", "limit_ptr": "*i64", "order_ptr": "*i64", "kept_ptr": "*i64"}
strides = ("stride_s", "stride_out", "stride_p", "stride_x", "stride_order")

def build(fn, consts, num_warps, ptrs):
    k, _ = compile_kernel(fn, consts, ptrs, num_warps=num_warps, div16=strides)
    ptx = k.asm["ptx"]
    spills = ptxas_spills(ptx)
    return {"name": fn.__name__, "spills": spills, "div_rn": "div.rn.f32" in ptx,
            "div_other": bool(re.search(r"div\.(full|approx)", ptx)), "ptx": ptx_summary(ptx)}

out = []
for vocab in json.loads(sys.argv[1]):
    block, _, warps = sp.filter_block_config(vocab)
    for dt in ("*fp32", "*bf16"):
        for flag in (False, True):
            out.append(build(sp._scale_ranked_kernel, dict(V=vocab, BLOCK=block,
                             HAS_TOP_K=flag), warps, base | {"s_ptr": dt}))
            out.append(build(sp._cut_filter_kernel, dict(V=vocab, BLOCK=block, HAS_CUT=flag),
                             warps, base | {"x_ptr": dt}))
    chunk, chunks, p2, warps = sp.kept_ranks_config(vocab)
    for flag in (False, True):
        out.append(build(sp._kept_ranks_sums_kernel, dict(V=vocab, CHUNK=chunk,
                         NUM_CHUNKS=chunks, HAS_TOP_K=flag), warps, base))
        out.append(build(sp._kept_ranks_kernel, dict(V=vocab, CHUNK=chunk, NUM_CHUNKS=chunks,
                         CHUNKS_P2=p2, HAS_TOP_K=flag), warps, base))
print(json.dumps(out))
"""


def test_filter_kernels_compile_for_sm90_with_ieee_division(sm90_compile):
    """The GPU path, checked without a GPU: no spills, and the temperature division is
    ``div.rn.f32`` (torch's IEEE division), never ``div.full``/``div.approx``."""
    results = sm90_compile(_SM90_SCRIPT, [128256])
    assert len(results) == 12
    for r in results:
        assert r["spills"] == 0 and not r["div_other"], r
        divides = r["name"] in ("_scale_ranked_kernel", "_cut_filter_kernel")
        assert r["div_rn"] == divides, r
