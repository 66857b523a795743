"""RMSNorm kernels in the interpreter: float64 oracle, poisoned outputs, row invariance,
the multi-block path, alignment copies, bad inputs."""

import pytest
import torch

from detlora.ops import rms_norm as rn

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest even), so a bf16
# element may be off by up to 2^-7 here: hence the looser bf16 bound.
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.2e-2}
EPS = 1e-6


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def _oracle(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _interpreter_round(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> dtype as the interpreter casts: bf16 by truncation, the others to nearest."""
    if dtype != torch.bfloat16:
        return v.to(dtype)
    return (v.view(torch.int32) & -65536).view(torch.float32).to(dtype)


def _inputs(t, h, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h, generator=g) * 3).to(dtype)
    res = torch.randn(t, h, generator=g).to(dtype)
    w = (torch.rand(h, generator=g) + 0.5).to(dtype)
    return x, res, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 64), (3, 100), (17, 1000), (130, 33)])
def test_rms_norm_matches_fp64(t, h, dtype):
    x, _, w = _inputs(t, h, dtype, seed=t * 1000 + h)
    out = torch.full((t, h), float("nan"), dtype=dtype)
    y = rn.rms_norm(x, w, EPS, out=out)
    assert y is out
    assert not out.isnan().any()
    assert _rel(out, _oracle(x, w, EPS)) < TOL[dtype]
    assert _rel(rn.rms_norm(x, w, EPS), _oracle(x, w, EPS)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 64), (3, 100), (17, 1000), (130, 33)])
def test_fused_add_rms_norm_matches_fp64(t, h, dtype):
    x, res, w = _inputs(t, h, dtype, seed=t * 7 + h)
    y = torch.full((t, h), float("nan"), dtype=dtype)
    r = torch.full((t, h), float("nan"), dtype=dtype)
    got_y, got_r = rn.fused_add_rms_norm(x, res, w, EPS, out=y, residual_out=r)
    assert got_y is y and got_r is r
    # The new residual is one fp32 add rounded once: exact bits.
    want_r = _interpreter_round(x.float() + res.float(), dtype)
    assert torch.equal(r, want_r)
    assert not y.isnan().any()
    assert _rel(y, _oracle(want_r, w, EPS)) < TOL[dtype]


def test_fused_in_place_update_of_the_residual_stream():
    x, res, w = _inputs(5, 96, torch.float16, seed=3)
    want_y, want_r = rn.fused_add_rms_norm(x, res, w, EPS)
    xi, ri = x.clone(), res.clone()
    y, r = rn.fused_add_rms_norm(xi, ri, w, EPS, out=xi, residual_out=ri)
    assert y is xi and r is ri
    assert torch.equal(y, want_y) and torch.equal(r, want_r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_block_path_matches_fp64(monkeypatch, dtype):
    monkeypatch.setattr(rn, "_MAX_BLOCK", 32)
    assert rn.rms_norm_config(100)[:2] == (32, 4)
    x, res, w = _inputs(17, 100, dtype, seed=11)
    y = torch.full((17, 100), float("nan"), dtype=dtype)
    rn.rms_norm(x, w, EPS, out=y)
    assert _rel(y, _oracle(x, w, EPS)) < TOL[dtype]
    fy, fr = rn.fused_add_rms_norm(x, res, w, EPS)
    want_r = _interpreter_round(x.float() + res.float(), dtype)
    assert torch.equal(fr, want_r)
    assert _rel(fy, _oracle(want_r, w, EPS)) < TOL[dtype]


# The forced multi-block path stops at 33 rows to keep the interpreter fast.
@pytest.mark.parametrize("max_block,sizes", [(None, (3, 17, 130)), (64, (3, 17, 33))])
def test_rows_do_not_depend_on_batch_size(monkeypatch, max_block, sizes):
    if max_block:
        monkeypatch.setattr(rn, "_MAX_BLOCK", max_block)
    x, res, w = _inputs(max(sizes), 100, torch.bfloat16, seed=5)
    rows = [0, 1, 2, 16, max(sizes) - 1]
    alone = {i: rn.rms_norm(x[i:i + 1], w, EPS) for i in rows}
    alone_f = {i: rn.fused_add_rms_norm(x[i:i + 1], res[i:i + 1], w, EPS) for i in rows}
    for t in sizes:
        y = rn.rms_norm(x[:t], w, EPS)
        fy, fr = rn.fused_add_rms_norm(x[:t], res[:t], w, EPS)
        for i in (i for i in rows if i < t):
            assert torch.equal(y[i], alone[i][0]), (t, i)
            assert torch.equal(fy[i], alone_f[i][0][0]), (t, i)
            assert torch.equal(fr[i], alone_f[i][1][0]), (t, i)


def test_misaligned_views_go_through_aligned_copies():
    x, _, w = _inputs(4, 64, torch.float16, seed=9)
    base = torch.empty(4 * 64 + 1, dtype=torch.float16)
    xv = base[1:].view(4, 64)  # data pointer 2 bytes past a 16-byte boundary
    xv.copy_(x)
    out_base = torch.full((4 * 64 + 1,), float("nan"), dtype=torch.float16)
    out = out_base[1:].view(4, 64)
    y = rn.rms_norm(xv, w, EPS, out=out)
    assert y is out
    assert torch.equal(out, rn.rms_norm(x, w, EPS))


def test_bad_inputs_raise_value_error(monkeypatch):
    x, res, w = _inputs(3, 64, torch.float32, seed=1)
    cases = [
        (lambda: rn.rms_norm(x[0], w, EPS), "x must have 2 dimensions"),
        (lambda: rn.rms_norm(x.double(), w, EPS), "x must have dtype"),
        (lambda: rn.rms_norm(x.int(), w, EPS), "x must have dtype"),
        (lambda: rn.rms_norm(x.t(), w[:3], EPS), "x must be contiguous in its last dimension"),
        (lambda: rn.rms_norm(x[:0], w, EPS), "x must have at least one row"),
        (lambda: rn.rms_norm(x, w[:10], EPS), r"weight must have shape \(64,\)"),
        (lambda: rn.rms_norm(x, w[None], EPS), "weight must have 1 dimensions"),
        (lambda: rn.rms_norm(x, w, -1.0), "eps must be finite and >= 0"),
        (lambda: rn.rms_norm(x, w, float("nan")), "eps must be finite"),
        (lambda: rn.rms_norm(x, w, "1e-6"), "eps must be a float"),
        (lambda: rn.rms_norm(x.tolist(), w, EPS), "x must be a torch.Tensor"),
        (lambda: rn.rms_norm(x, w, EPS, out=torch.empty(3, 63)), r"out must have shape"),
        (lambda: rn.rms_norm(x, w, EPS, out=torch.empty(3, 64, dtype=torch.float16)),
         "out must have dtype"),
        (lambda: rn.rms_norm(x, w.to("meta"), EPS), "weight is on meta"),
        (lambda: rn.rms_norm(x, w, EPS, out=torch.empty(3, 64, device="meta")), "out is on meta"),
        (lambda: rn.fused_add_rms_norm(x, res[:2], w, EPS), r"residual must have shape"),
        (lambda: rn.fused_add_rms_norm(x, res.half(), w, EPS), "residual must have dtype"),
        (lambda: rn.fused_add_rms_norm(x, res.to("meta"), w, EPS), "residual is on meta"),
        (lambda: rn.fused_add_rms_norm(x, res, w, EPS, residual_out=torch.empty(3, 64, 1)),
         "residual_out must have 2 dimensions"),
        (lambda: rn.fused_add_rms_norm(x, res, w, EPS, out=res, residual_out=res),
         "out and residual_out must be different"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="Triton kernels need CUDA tensors"):
        rn.rms_norm(x, w, EPS)
