"""Row-wise ops on the GPU: correctness against float64 (bf16 first), exact bits where the
semantics fix them, batch invariance (row i alone equals row i inside every M), repeatability,
misaligned operands, in-place use and CUDA-graph capture."""

import pytest
import torch

from detlora.ops.embedding import embedding
from detlora.ops.paged_attention import write_kv
from detlora.ops.reductions import argmax, argmax_ref, mean
from detlora.ops.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm
from detlora.ops.rotary import rope_cos_sin_cache, rotary
from detlora.ops.rotary_write_kv import rotary_write_kv
from detlora.ops.silu_and_mul import silu_and_mul
from detlora.ops.softmax import log_softmax, softmax

pytestmark = pytest.mark.gpu

DEV = "cuda"
BATCH_SIZES = (2, 3, 7, 16, 64, 128, 257, 1024, 4096)
ROWS = 40  # rows compared alone vs. in every batch
TOL = {torch.bfloat16: 5e-3, torch.float16: 1e-3, torch.float32: 1e-5}
EPS = 1e-5
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _randn(g, *shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def _rms_oracle(x, w):
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


# ----------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,h", [(1, 3072), (7, 1024), (130, 100), (257, 20000), (4096, 3072)])
def test_rms_norms_match_fp64(m, h, dtype):
    g = _gen(m + h)
    x, res, w = _randn(g, m, h, dtype=dtype, scale=3), _randn(g, m, h, dtype=dtype), \
        _randn(g, h, dtype=dtype) + 1
    out = torch.full((m, h), float("nan"), device=DEV, dtype=dtype)
    rms_norm(x, w, EPS, out=out)
    assert _rel(out, _rms_oracle(x, w)) < TOL[dtype]
    y = torch.full_like(out, float("nan"))
    r = torch.full_like(out, float("nan"))
    fused_add_rms_norm(x, res, w, EPS, out=y, residual_out=r)
    _, want_r = fused_add_rms_norm_ref(x, res, w, EPS)
    assert torch.equal(r, want_r)  # one fp32 add, rounded to nearest even: exact bits
    assert _rel(y, _rms_oracle(want_r, w)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,inter", [(1, 8192), (130, 3072), (4096, 8192), (3, 100)])
def test_silu_and_mul_matches_fp64(m, inter, dtype):
    x = _randn(_gen(inter), m, 2 * inter, dtype=dtype, scale=3)
    out = torch.full((m, inter), float("nan"), device=DEV, dtype=dtype)
    silu_and_mul(x, out=out)
    gd, ud = x.double().chunk(2, dim=-1)
    assert _rel(out, gd / (1 + torch.exp(-gd)) * ud) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,hq,hk,d", [(1, 24, 8, 128), (257, 16, 8, 128), (3, 5, 3, 64)])
def test_rotary_matches_fp64(m, hq, hk, d, dtype):
    g = _gen(m * hq)
    cos_sin = rope_cos_sin_cache(d, 131072, 500000.0, LLAMA3).to(DEV)
    q, k = _randn(g, m, hq, d, dtype=dtype), _randn(g, m, hk, d, dtype=dtype)
    pos = torch.randint(0, 131072, (m,), device=DEV, generator=g)
    qo, ko = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    rotary(q, k, pos, cos_sin, out=(qo, ko))
    cos, sin = cos_sin.double()[pos].chunk(2, dim=-1)
    for got, x in ((qo, q), (ko, k)):
        x1, x2 = x.double().chunk(2, dim=-1)
        c, s = cos[:, None], sin[:, None]
        assert _rel(got, torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,hq,hk,d", [(1, 24, 8, 128), (64, 24, 8, 128), (4096, 16, 8, 128),
                                       (7, 5, 3, 64)])
def test_rotary_write_kv_has_the_unfused_bits(m, hq, hk, d, dtype):
    """The fused op against rotary then write_kv, on strided views of one qkv output, with
    padding slots and a slot past the cache (both skipped)."""
    g = _gen(m + hq)
    cos_sin = rope_cos_sin_cache(d, 131072, 500000.0, LLAMA3).to(DEV)
    qkv = _randn(g, m, (hq + 2 * hk) * d, dtype=dtype)
    q = qkv[:, : hq * d].view(m, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(m, hk, d)
    v = qkv[:, (hq + hk) * d:].view(m, hk, d)
    pos = torch.randint(0, 131072, (m,), device=DEV, generator=g)
    pages, page = m // 8 + 4, 16
    slots = torch.randperm(pages * page, device=DEV, generator=g)[:m]
    slots[::5] = -1
    if m > 2:
        slots[1] = pages * page + 3
    cache = _randn(g, 2, pages, page, hk, d, dtype=dtype)
    kc, vc = cache[0].clone(), cache[1].clone()
    want_q, k_rot = rotary(q, k, pos, cos_sin)
    write_kv(k_rot, v, kc, vc, slots)
    got_kc, got_vc = cache[0].clone(), cache[1].clone()
    got_q = rotary_write_kv(q, k, v, pos, cos_sin, got_kc, got_vc, slots)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_kc, kc) and torch.equal(got_vc, vc)


def test_embedding_is_an_exact_gather():
    g = _gen(5)
    w = _randn(g, 128256, 3072)
    ids = torch.randint(0, 128256, (257,), device=DEV, generator=g)
    ids[0] = 128255
    out = torch.full((257, 3072), float("nan"), device=DEV, dtype=torch.bfloat16)
    assert torch.equal(embedding(ids.int(), w, out=out), w[ids])
    with pytest.raises(ValueError, match=r"ids must be in \[0, 128256\)"):
        embedding(torch.tensor([128256], device=DEV), w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,v", [(1, 128256), (7, 151936), (64, 1000), (3, 256000)])
def test_softmaxes_match_fp64(m, v, dtype):
    x = _randn(_gen(m + v), m, v, dtype=dtype, scale=5)
    x[0, : v // 2] = float("-inf")  # masked logits, whole chunks of them
    for op, oracle in ((softmax, torch.softmax), (log_softmax, torch.log_softmax)):
        out = torch.full((m, v), float("nan"), device=DEV, dtype=dtype)
        op(x, out=out)
        want = oracle(x.double(), dim=-1)
        fin = want.isfinite()
        assert torch.equal(out.isfinite(), fin)
        assert _rel(out[fin], want[fin]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mean_and_argmax(dtype):
    g = _gen(9)
    x = _randn(g, 257, 3072, dtype=dtype) + 0.5
    got = mean(x)
    want = x.double().mean(-1)
    assert ((got.double() - want).abs() <= TOL[dtype] * x.double().abs().mean(-1)).all()
    logits = _randn(g, 64, 128256, dtype=dtype, scale=5)
    logits[1, 100] = logits[1, 90000] = 1e4  # a tie across chunks
    logits[2, 7] = logits[2, 8] = 1e4  # a tie inside a chunk
    logits[3] = 1.0
    logits[4, 128000] = float("nan")
    logits[4, 5] = float("inf")
    got = argmax(logits)
    assert torch.equal(got, torch.argmax(logits.float(), -1))
    assert got[1] == 100 and got[2] == 7 and got[3] == 0 and got[4] == 128000
    keep = torch.arange(64, device=DEV) != 4
    assert torch.equal(got[keep], argmax_ref(logits[keep]))


# ----------------------------------------------------------------------------- invariance


def _cases():
    """(name, make(m, g) -> inputs, call(inputs, lo, hi) -> outputs with rows first)."""
    cos_sin = rope_cos_sin_cache(128, 8192, 500000.0, LLAMA3).to(DEV)

    def rms_inputs(h):
        return lambda m, g: (_randn(g, m, h, scale=3), _randn(g, m, h), _randn(g, h) + 1)

    def rot_call(hq, hk):
        def call(d, lo, hi):
            q = d[0][lo:hi, : hq * 128].view(hi - lo, hq, 128)
            k = d[0][lo:hi, hq * 128: (hq + hk) * 128].view(hi - lo, hk, 128)
            return rotary(q, k, d[1][lo:hi], cos_sin, validate=False)
        return call

    def row_op(fn, width, scale=1.0):
        return (lambda m, g: _randn(g, m, width, scale=scale), lambda x, lo, hi: (fn(x[lo:hi]),))

    cases = []
    for h in (3072, 1024, 20000):
        cases.append((f"rms_norm-H{h}", rms_inputs(h),
                      lambda d, lo, hi: (rms_norm(d[0][lo:hi], d[2], EPS),)))
        cases.append((f"fused_add_rms_norm-H{h}", rms_inputs(h),
                      lambda d, lo, hi: fused_add_rms_norm(d[0][lo:hi], d[1][lo:hi], d[2], EPS)))
    for hq, hk in ((24, 8), (16, 8)):
        cases.append((f"rotary-{hq}x{hk}",
                      lambda m, g, hq=hq, hk=hk: (
                          _randn(g, m, (hq + 2 * hk) * 128),
                          torch.randint(0, 8192, (m,), device=DEV, generator=g)),
                      rot_call(hq, hk)))
    cases.append(("embedding-128256x3072",
                  lambda m, g: (torch.randint(0, 128256, (m,), device=DEV, generator=g),
                                _randn(g, 128256, 3072)),
                  lambda d, lo, hi: (embedding(d[0][lo:hi], d[1], validate=False),)))
    cases += [
        ("silu_and_mul-8192", *row_op(silu_and_mul, 2 * 8192, 3)),
        ("silu_and_mul-3072", *row_op(silu_and_mul, 2 * 3072, 3)),
        ("softmax-128256", *row_op(softmax, 128256, 5)),
        ("log_softmax-128256", *row_op(log_softmax, 128256, 5)),
        ("log_softmax-151936", *row_op(log_softmax, 151936, 5)),
        ("log_softmax-1000", *row_op(log_softmax, 1000, 5)),
        ("mean-3072", *row_op(mean, 3072)),
        ("argmax-128256", *row_op(argmax, 128256, 5)),
        ("argmax-151936", *row_op(argmax, 151936, 5)),
    ]
    return cases


CASE_NAMES = [
    "rms_norm-H3072", "fused_add_rms_norm-H3072", "rms_norm-H1024", "fused_add_rms_norm-H1024",
    "rms_norm-H20000", "fused_add_rms_norm-H20000", "rotary-24x8", "rotary-16x8",
    "embedding-128256x3072", "silu_and_mul-8192", "silu_and_mul-3072", "softmax-128256",
    "log_softmax-128256", "log_softmax-151936", "log_softmax-1000", "mean-3072",
    "argmax-128256", "argmax-151936",
]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_rows_do_not_depend_on_batch_size(name):
    cases = {c[0]: c for c in _cases()}
    assert set(cases) == set(CASE_NAMES)
    _, make, call = cases[name]
    m_max = max(BATCH_SIZES)
    data = make(m_max, _gen(len(name)))
    alone = [[o.clone() for o in call(data, i, i + 1)] for i in range(ROWS)]
    for m in BATCH_SIZES:
        batch = call(data, 0, m)
        for i in range(min(m, ROWS)):
            for b, a in zip(batch, alone[i], strict=True):
                assert torch.equal(b[i], a[0]), (name, m, i)
        # The last row of the batch too, computed alone.
        last = call(data, m - 1, m)
        for b, a in zip(batch, last, strict=True):
            assert torch.equal(b[m - 1], a[0]), (name, m, m - 1)


@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm", "softmax", "log_softmax",
                                "mean", "argmax"])
def test_repeated_runs_are_bitwise_equal(op):
    g = _gen(3)
    x, res, w = _randn(g, 257, 3072, scale=3), _randn(g, 257, 3072), _randn(g, 3072) + 1
    logits = _randn(g, 64, 128256, scale=5)
    fn = {
        "rms_norm": lambda: (rms_norm(x, w, EPS),),
        "fused_add_rms_norm": lambda: fused_add_rms_norm(x, res, w, EPS),
        "softmax": lambda: (softmax(logits),),
        "log_softmax": lambda: (log_softmax(logits),),
        "mean": lambda: (mean(x),),
        "argmax": lambda: (argmax(logits),),
    }[op]
    first = fn()
    for _ in range(50):
        for a, b in zip(fn(), first, strict=True):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------- alignment etc.


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of t whose data pointer sits one element past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 != 0
    return view


def test_misaligned_operands_give_the_aligned_bits():
    g = _gen(11)
    x, res, w = _randn(g, 33, 3072, scale=3), _randn(g, 33, 3072), _randn(g, 3072) + 1
    logits = _randn(g, 5, 128256, scale=5)
    xm, rm, wm = _misaligned(x), _misaligned(res), _misaligned(w)
    assert torch.equal(rms_norm(xm, wm, EPS), rms_norm(x, w, EPS))
    out = _misaligned(torch.zeros_like(x))
    rms_norm(x, w, EPS, out=out)
    assert torch.equal(out, rms_norm(x, w, EPS))
    for a, b in zip(fused_add_rms_norm(xm, rm, w, EPS), fused_add_rms_norm(x, res, w, EPS),
                    strict=True):
        assert torch.equal(a, b)
    assert torch.equal(log_softmax(_misaligned(logits)), log_softmax(logits))
    assert torch.equal(softmax(_misaligned(logits)), softmax(logits))
    assert torch.equal(mean(xm), mean(x))
    assert torch.equal(argmax(_misaligned(logits)), argmax(logits))


def test_in_place_updates():
    g = _gen(12)
    x, res, w = _randn(g, 64, 3072), _randn(g, 64, 3072), _randn(g, 3072) + 1
    want_y, want_r = fused_add_rms_norm(x, res, w, EPS)
    fused_add_rms_norm(x, res, w, EPS, out=x, residual_out=res)
    assert torch.equal(x, want_y) and torch.equal(res, want_r)
    # Multi-block rows (H > 8192) read the new residual back after writing it.
    x, res, w = _randn(g, 64, 20000), _randn(g, 64, 20000), _randn(g, 20000) + 1
    want_y, want_r = fused_add_rms_norm(x, res, w, EPS)
    fused_add_rms_norm(x, res, w, EPS, out=x, residual_out=res)
    assert torch.equal(x, want_y) and torch.equal(res, want_r)
    cos_sin = rope_cos_sin_cache(128, 4096, 500000.0, LLAMA3).to(DEV)
    qkv = _randn(g, 17, (24 + 16) * 128)
    q, k = qkv[:, :3072].view(17, 24, 128), qkv[:, 3072:4096].view(17, 8, 128)
    pos = torch.randint(0, 4096, (17,), device=DEV, generator=g)
    want_q, want_k = rotary(q, k, pos, cos_sin)
    v = qkv[:, 4096:].clone()
    rotary(q, k, pos, cos_sin, out=(q, k))
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(qkv[:, 4096:], v)


def test_cuda_graph_replay_matches_eager():
    g = _gen(13)
    x, res, w = _randn(g, 16, 3072), _randn(g, 16, 3072), _randn(g, 3072) + 1
    logits = _randn(g, 16, 128256, scale=5)
    table = _randn(g, 1000, 3072)
    ids = torch.randint(0, 1000, (16,), device=DEV, generator=g)

    def step():
        y, r = fused_add_rms_norm(x, res, w, EPS)
        return (y, r, log_softmax(logits), argmax(logits), silu_and_mul(x),
                embedding(ids, table, validate=False))

    eager = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager, strict=True):
        assert torch.equal(a, b)
