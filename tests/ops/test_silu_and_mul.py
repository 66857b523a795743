"""SiLU-and-mul kernel in the interpreter: float64 oracle, poisoned output, row invariance,
bad inputs."""

import pytest
import torch

from detlora.ops import silu_and_mul as sm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# bf16 is looser: the interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest even).
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.2e-2}


def _oracle(x: torch.Tensor) -> torch.Tensor:
    g, u = x.double().chunk(2, dim=-1)
    return g / (1 + torch.exp(-g)) * u


def _x(t, inter, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, 2 * inter, generator=g) * 4).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,inter", [(1, 64), (3, 100), (17, 2500), (130, 33)])
def test_matches_fp64(t, inter, dtype):
    x = _x(t, inter, dtype, seed=t + inter)
    out = torch.full((t, inter), float("nan"), dtype=dtype)
    assert sm.silu_and_mul(x, out=out) is out
    assert not out.isnan().any()
    want = _oracle(x)
    assert float((out.double() - want).norm() / want.norm()) < TOL[dtype]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_strided_rows_and_large_gates():
    # x as a column slice of a wider buffer; gates far in both tails (exp overflow side).
    buf = _x(5, 80, torch.float32, seed=2)
    x = buf[:, :96]
    x[0, :8] = torch.tensor([-200.0, -90.0, -30.0, 0.0, 30.0, 90.0, 200.0, 1e-3])
    got = sm.silu_and_mul(x)
    want = _oracle(x)
    assert not got.isnan().any()
    assert float((got.double() - want).norm() / want.norm()) < 1e-6


def test_rows_do_not_depend_on_batch_size():
    x = _x(130, 2500, torch.bfloat16, seed=7)
    rows = [0, 2, 16, 129]
    alone = {i: sm.silu_and_mul(x[i:i + 1]) for i in rows}
    for t in (3, 17, 130):
        y = sm.silu_and_mul(x[:t])
        for i in (i for i in rows if i < t):
            assert torch.equal(y[i], alone[i][0]), (t, i)


def test_bad_inputs_raise_value_error(monkeypatch):
    x = _x(3, 8, torch.float16, seed=1)
    cases = [
        (lambda: sm.silu_and_mul(x[0]), "x must have 2 dimensions"),
        (lambda: sm.silu_and_mul(x.double()), "x must have dtype"),
        (lambda: sm.silu_and_mul(x[:, :15]), "x.shape.1. must be even"),
        (lambda: sm.silu_and_mul(x.t()), "x must be contiguous in its last dimension"),
        (lambda: sm.silu_and_mul(x[:0]), "x must have at least one row"),
        (lambda: sm.silu_and_mul(x, out=torch.empty(3, 16, dtype=torch.float16)),
         r"out must have shape \(3, 8\)"),
        (lambda: sm.silu_and_mul(x, out=torch.empty(3, 8)), "out must have dtype"),
        (lambda: sm.silu_and_mul(x, out=torch.empty(3, 8, dtype=torch.float16, device="meta")),
         "out is on meta"),
        (lambda: sm.silu_and_mul(None), "x must be a torch.Tensor"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="Triton kernels need CUDA tensors"):
        sm.silu_and_mul(x)
