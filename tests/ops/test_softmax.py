"""Softmax and log-softmax kernels in the interpreter: float64 oracle on one- and multi-chunk
rows, poisoned outputs, row invariance, -inf entries, bad inputs."""

import pytest
import torch

from detlora.ops import softmax as sx

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# bf16 is looser: the interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest even).
TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 1.2e-2}
OPS = [(sx.softmax, lambda x: torch.softmax(x, -1)),
       (sx.log_softmax, lambda x: torch.log_softmax(x, -1))]


def _x(t, v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, v, generator=g) * 4).to(dtype)


def _check(op, oracle, x, dtype):
    out = torch.full(x.shape, float("nan"), dtype=dtype)
    assert op(x, out=out) is out
    assert not out.isnan().any()
    want = oracle(x.double())
    assert float((out.double() - want).norm() / want.norm()) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,v", [(1, 2), (3, 100), (17, 5000), (130, 37)])
@pytest.mark.parametrize("op,oracle", OPS, ids=["softmax", "log_softmax"])
def test_matches_fp64(op, oracle, t, v, dtype):
    assert sx.softmax_config(5000)[1] == 2  # 5000 exercises two chunks (4096 + 904)
    _check(op, oracle, _x(t, v, dtype, seed=t + v), dtype)


@pytest.mark.parametrize("op,oracle", OPS, ids=["softmax", "log_softmax"])
def test_many_chunks_match_fp64(monkeypatch, op, oracle):
    monkeypatch.setattr(sx, "_CHUNK", 16)
    assert sx.softmax_config(200) == (16, 13, 1)
    for dtype in (torch.float32, torch.bfloat16):
        _check(op, oracle, _x(5, 200, dtype, seed=3), dtype)


@pytest.mark.parametrize("op,oracle", OPS, ids=["softmax", "log_softmax"])
def test_masked_logits(monkeypatch, op, oracle):
    monkeypatch.setattr(sx, "_CHUNK", 16)
    x = _x(3, 100, torch.float32, seed=6)
    x[0, :50] = float("-inf")  # whole chunks of -inf, as a grammar mask leaves them
    x[1, ::2] = float("-inf")
    got = op(x)
    want = oracle(x.double())
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite)
    assert float((got.double()[finite] - want[finite]).norm() / want[finite].norm()) < 2e-6


# The forced multi-chunk path stops at 33 rows to keep the interpreter fast.
@pytest.mark.parametrize("chunk,sizes", [(None, (3, 17, 130)), (64, (3, 17, 33))])
def test_rows_do_not_depend_on_batch_size(monkeypatch, chunk, sizes):
    if chunk:
        monkeypatch.setattr(sx, "_CHUNK", chunk)  # 160 = 64 + 64 + 32: three chunks
    x = _x(max(sizes), 160, torch.bfloat16, seed=7)
    rows = [0, 2, 16, max(sizes) - 1]
    for op in (sx.softmax, sx.log_softmax):
        alone = {i: op(x[i:i + 1]) for i in rows}
        for t in sizes:
            y = op(x[:t])
            for i in (i for i in rows if i < t):
                assert torch.equal(y[i], alone[i][0]), (op.__name__, t, i)


def test_misaligned_input_and_output():
    x = _x(4, 40, torch.float16, seed=9)
    base = torch.empty(4 * 40 + 1, dtype=torch.float16)
    xv = base[1:].view(4, 40)
    xv.copy_(x)
    out = torch.full((4 * 40 + 1,), float("nan"), dtype=torch.float16)[1:].view(4, 40)
    assert sx.log_softmax(xv, out=out) is out
    assert torch.equal(out, sx.log_softmax(x))


@pytest.mark.parametrize("op", [sx.softmax, sx.log_softmax])
def test_bad_inputs_raise_value_error(monkeypatch, op):
    x = _x(3, 16, torch.float32, seed=1)
    cases = [
        (lambda: op(x[0]), "x must have 2 dimensions"),
        (lambda: op(x.double()), "x must have dtype"),
        (lambda: op(x.t()), "x must be contiguous in its last dimension"),
        (lambda: op(x[:, :0]), "x must have at least one row and column"),
        (lambda: op(x, out=torch.empty(3, 15)), r"out must have shape \(3, 16\)"),
        (lambda: op(x, out=torch.empty(3, 16, dtype=torch.half)), "out must have dtype"),
        (lambda: op(x, out=torch.empty(3, 16, device="meta")), "out is on meta"),
        (lambda: op("x"), "x must be a torch.Tensor"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    monkeypatch.setattr(sx, "_MAX_CHUNKS", 4)
    with pytest.raises(ValueError, match="at most 4 are supported"):
        op(_x(1, 5 * 4096, torch.float32, seed=2))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="Triton kernels need CUDA tensors"):
        op(x)
