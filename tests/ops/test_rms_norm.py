"""RMSNorm kernels in the interpreter: float64 oracle, poisoned outputs, row invariance,
several rows per program, the multi-block path, alignment copies, bad inputs and configs,
and the sm_90 compile of the default configs."""

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
    assert rn.rms_norm_blocks(100) == (32, 4)
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


# ----------------------------------------------------------------------------- configs

CONFIGS = [rn.RmsNormConfig(1, 1), rn.RmsNormConfig(2, 4), rn.RmsNormConfig(4, 2),
           rn.RmsNormConfig(8, 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"r{c.rows}w{c.num_warps}")
@pytest.mark.parametrize("t,h", [(7, 100), (13, 37)])  # T not a multiple of the rows
def test_configs_match_fp64(t, h, cfg, dtype):
    x, res, w = _inputs(t, h, dtype, seed=t * 31 + h + cfg.rows)
    y = torch.full((t, h), float("nan"), dtype=dtype)
    rn.rms_norm(x, w, EPS, out=y, config=cfg)
    assert not y.isnan().any()
    assert _rel(y, _oracle(x, w, EPS)) < TOL[dtype]
    fy = torch.full((t, h), float("nan"), dtype=dtype)
    fr = torch.full((t, h), float("nan"), dtype=dtype)
    rn.fused_add_rms_norm(x, res, w, EPS, out=fy, residual_out=fr, config=cfg)
    want_r = _interpreter_round(x.float() + res.float(), dtype)
    assert torch.equal(fr, want_r)
    assert not fy.isnan().any()
    assert _rel(fy, _oracle(want_r, w, EPS)) < TOL[dtype]


# The multi-block path (forced by a small _MAX_BLOCK) once, to keep the interpreter fast.
@pytest.mark.parametrize("rows,max_block", [(1, None), (2, None), (4, None), (4, 32)])
def test_row_alone_equals_row_in_batch_for_each_config(monkeypatch, rows, max_block):
    """Row i of an M-row call has the bits of row i called alone (M = 1), whatever the rows
    per program; also through the multi-block path."""
    if max_block:
        monkeypatch.setattr(rn, "_MAX_BLOCK", max_block)
    cfg = rn.RmsNormConfig(rows, 4)
    x, res, w = _inputs(33, 72, torch.float16, seed=rows)
    # Every place in a program and in a partly masked last program, for every M below.
    check = [*range(7), 16, 31, 32]
    alone = {i: rn.rms_norm(x[i:i + 1], w, EPS, config=cfg) for i in check}
    alone_f = {i: rn.fused_add_rms_norm(x[i:i + 1], res[i:i + 1], w, EPS, config=cfg)
               for i in check}
    for m in (2, 3, 7, 33):
        y = rn.rms_norm(x[:m], w, EPS, config=cfg)
        fy, fr = rn.fused_add_rms_norm(x[:m], res[:m], w, EPS, config=cfg)
        for i in (i for i in check if i < m):
            assert torch.equal(y[i], alone[i][0]), (m, i)
            assert torch.equal(fy[i], alone_f[i][0][0]), (m, i)
            assert torch.equal(fr[i], alone_f[i][1][0]), (m, i)


@pytest.mark.parametrize("max_block", [None, 32])
def test_in_place_update_with_several_rows_per_program(monkeypatch, max_block):
    if max_block:
        monkeypatch.setattr(rn, "_MAX_BLOCK", max_block)
    cfg = rn.RmsNormConfig(4, 4)
    x, res, w = _inputs(7, 100, torch.float32, seed=21)
    want_y, want_r = rn.fused_add_rms_norm(x, res, w, EPS, config=cfg)
    xi, ri = x.clone(), res.clone()
    rn.fused_add_rms_norm(xi, ri, w, EPS, out=xi, residual_out=ri, config=cfg)
    assert torch.equal(xi, want_y) and torch.equal(ri, want_r)
    xi = x.clone()
    rn.rms_norm(xi, w, EPS, out=xi, config=cfg)
    assert torch.equal(xi, rn.rms_norm(x, w, EPS, config=cfg))


def test_default_config_is_valid_and_depends_on_h_only():
    for h in [*range(1, 300, 7), 1024, 3072, 4096, 8192, 8193, 20000, 151936]:
        block, num_blocks = rn.rms_norm_blocks(h)
        assert block * (num_blocks - 1) < h <= block * num_blocks
        cfg = rn.rms_norm_config(h)
        assert rn.check_rms_norm_config(cfg, h) is cfg
        assert cfg.rows == 1 or num_blocks == 1  # wide rows: one row per program
    # The tilings measured fastest on the H200 (benchmarks/results/rms_norm_sweep.json).
    assert rn.rms_norm_config(1024) == rn.RmsNormConfig(rows=2, num_warps=4)
    assert rn.rms_norm_config(3072) == rn.RmsNormConfig(rows=1, num_warps=8)


def test_bad_configs_raise_value_error_naming_the_argument():
    x, res, w = _inputs(3, 64, torch.float32, seed=2)
    cases = [
        ((2, 4), "config must be an RmsNormConfig, got tuple"),
        (rn.RmsNormConfig(3, 4), r"config.rows must be a power of two in \[1, 64\], got 3"),
        (rn.RmsNormConfig(0, 4), "config.rows must be a power of two"),
        (rn.RmsNormConfig(128, 4), "config.rows must be a power of two"),
        (rn.RmsNormConfig(2.0, 4), "config.rows must be a power of two"),
        (rn.RmsNormConfig(True, 4), "config.rows must be a power of two"),
        (rn.RmsNormConfig(2, 6), r"config.num_warps must be a power of two in \[1, 32\], got 6"),
        (rn.RmsNormConfig(2, 64), "config.num_warps must be a power of two"),
    ]
    for cfg, match in cases:
        with pytest.raises(ValueError, match=match):
            rn.rms_norm(x, w, EPS, config=cfg)
        with pytest.raises(ValueError, match=match):
            rn.fused_add_rms_norm(x, res, w, EPS, config=cfg)
    with pytest.raises(ValueError, match=r"config.rows is too large for H = 8192"):
        rn.check_rms_norm_config(rn.RmsNormConfig(16, 8), 8192)


_SM90_SCRIPT = r"""
import json, sys
from compile_sm90 import compile_kernel, ptx_summary, ptxas_spills
from detlora.ops import rms_norm as rn

out = []
for h in json.loads(sys.argv[1]):
    block, num_blocks = rn.rms_norm_blocks(h)
    cfg = rn.rms_norm_config(h)
    for dtype in ("*bf16", "*fp32"):
        for fn in (rn._rms_norm_kernel, rn._fused_add_rms_norm_kernel):
            k, _ = compile_kernel(
                fn, dict(H=h, BLOCK=block, NUM_BLOCKS=num_blocks, ROWS=cfg.rows, PDL=True), {},
                num_warps=cfg.num_warps, default_ptr=dtype, int_types={"eps": "fp32"},
                div16=("stride_x", "stride_r", "stride_y", "stride_ro"))
            ptx = k.asm["ptx"]
            out.append({"H": h, "dtype": dtype, "kernel": fn.__name__,
                        "spills": ptxas_spills(ptx), "ptx": ptx_summary(ptx),
                        "v4_loads": len([ln for ln in ptx.splitlines()
                                         if "ld.global" in ln and ".v4." in ln])})
print(json.dumps(out))
"""


def test_default_configs_compile_for_sm90_without_spills(sm90_compile):
    """The GPU path, checked without a GPU: Triton compiles the default tilings for sm_90."""
    results = sm90_compile(_SM90_SCRIPT, [1024, 3072])
    assert len(results) == 8
    for r in results:
        # No spills, and x (and the residual) are read in 16-byte vectors.
        assert r["spills"] == 0 and r["v4_loads"] > 0, r
        # Launched with PDL on sm_90 (ops/pdl.py): let the next kernel in, then wait.
        assert r["ptx"].get("griddepcontrol.launch_dependents") == 1, r
        assert r["ptx"].get("griddepcontrol.wait") == 1, r


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
