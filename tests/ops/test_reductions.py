"""Mean and argmax kernels in the interpreter: float64 oracle, ties to the lowest index, NaN
and -inf rows, one- and multi-chunk rows, row invariance, alignment checks, bad inputs."""

import pytest
import torch

from detlora.ops import reductions as rd

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative to the row's scale (a mean can cancel to near zero). bf16 is looser: the
# interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest even).
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _x(t, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, n, generator=g) + 0.5).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n", [(1, 1), (3, 100), (17, 5000), (130, 37)])
def test_mean_matches_fp64(t, n, dtype):
    x = _x(t, n, dtype, seed=t + n)
    out = torch.full((t,), float("nan"), dtype=dtype)
    assert rd.mean(x, out=out) is out
    want = x.double().mean(-1)
    scale = x.double().abs().mean(-1)
    assert ((out.double() - want).abs() <= TOL[dtype] * scale).all()


def test_mean_multi_block_path(monkeypatch):
    monkeypatch.setattr(rd, "_MEAN_MAX_BLOCK", 16)
    assert rd.mean_config(100)[:2] == (16, 7)
    x = _x(5, 100, torch.float32, seed=4)
    want = x.double().mean(-1)
    assert ((rd.mean(x).double() - want).abs() <= 1e-6 * x.double().abs().mean(-1)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n", [(1, 1), (3, 100), (17, 5000), (130, 37)])
def test_argmax_matches_torch(t, n, dtype):
    x = _x(t, n, dtype, seed=t * n)
    out = torch.full((t,), -1, dtype=torch.int64)
    assert rd.argmax(x, out=out) is out
    assert torch.equal(out, rd.argmax_ref(x))
    assert torch.equal(out, torch.argmax(x.double(), -1))


@pytest.mark.parametrize("chunk", [None, 32])
def test_argmax_ties_nan_and_inf(monkeypatch, chunk):
    if chunk:
        monkeypatch.setattr(rd, "_ARGMAX_CHUNK", chunk)
    n = 200
    x = _x(8, n, torch.bfloat16, seed=5)
    x[0, 40] = x[0, 170] = x[0, 171] = 100.0  # ties across chunks
    x[1, 60:64] = 100.0  # ties inside a chunk
    x[2] = 3.0  # all equal
    x[3] = float("-inf")  # all -inf
    x[4, 150] = float("nan")
    x[4, 180] = float("nan")
    x[4, 10] = float("inf")  # NaN outranks +inf, as in torch.argmax
    x[5, 199] = 100.0  # maximum in the last, partial chunk
    x[6, 0] = 100.0
    x[7, 5] = x[7, 100] = float("inf")
    want = torch.tensor([40, 60, 0, 0, 150, 199, 0, 5])
    assert torch.equal(rd.argmax(x), want)
    assert torch.equal(rd.argmax(x), torch.argmax(x.float(), -1))
    assert torch.equal(rd.argmax(x), rd.argmax(x.float()))  # the sampler reads bf16 logits
    no_nan = torch.tensor([0, 1, 2, 3, 5, 6, 7])
    assert torch.equal(rd.argmax(x[no_nan]), rd.argmax_ref(x[no_nan]))


# The forced multi-chunk path stops at 33 rows to keep the interpreter fast.
@pytest.mark.parametrize("chunk,sizes", [(None, (3, 17, 130)), (64, (3, 17, 33))])
def test_rows_do_not_depend_on_batch_size(monkeypatch, chunk, sizes):
    if chunk:  # 160 = 64 + 64 + 32: three chunks (argmax) and blocks (mean)
        monkeypatch.setattr(rd, "_ARGMAX_CHUNK", chunk)
        monkeypatch.setattr(rd, "_MEAN_MAX_BLOCK", chunk)
    x = _x(max(sizes), 160, torch.bfloat16, seed=7)
    x[::3, 10] = x[::3, 150] = 50.0  # ties in every third row
    rows = [0, 2, 16, max(sizes) - 1]
    for op in (rd.mean, rd.argmax):
        alone = {i: op(x[i:i + 1]) for i in rows}
        for t in sizes:
            y = op(x[:t])
            for i in (i for i in rows if i < t):
                assert torch.equal(y[i], alone[i][0]), (op.__name__, t, i)


def test_canonical_rows():
    x = torch.empty(4, 64, dtype=torch.float16)
    assert rd.is_canonical_rows(x) and rd.canonical_rows(x) is x
    assert rd.is_canonical_rows(torch.empty(8, 128)[:, :64])  # stride 128 ~ 64: both % 16
    assert not rd.is_canonical_rows(torch.empty(4, 72)[:, :64])  # stride 72 vs 64
    assert not rd.is_canonical_rows(torch.empty(4 * 64 + 1, dtype=torch.half)[1:].view(4, 64))
    assert rd.is_canonical_rows(torch.empty(4, 33))  # stride 33 as a fresh tensor has
    odd = torch.empty(4, 48)[:, :33]
    assert not rd.is_canonical_rows(odd)  # stride 48 % 16 == 0 but 33 % 16 != 0
    copy = rd.canonical_rows(odd)
    assert copy.is_contiguous() and rd.is_canonical_rows(copy) and copy.data_ptr() % 16 == 0


@pytest.mark.parametrize("op", [rd.mean, rd.argmax])
def test_bad_inputs_raise_value_error(monkeypatch, op):
    x = _x(3, 16, torch.float32, seed=1)
    out_dtype = torch.int64 if op is rd.argmax else torch.float32
    cases = [
        (lambda: op(x[0]), "x must have 2 dimensions"),
        (lambda: op(x.double()), "x must have dtype"),
        (lambda: op(x.long()), "x must have dtype"),
        (lambda: op(x.t()), "x must be contiguous in its last dimension"),
        (lambda: op(x[:0]), "x must have at least one row and column"),
        (lambda: op(x, out=torch.empty(2, dtype=out_dtype)), r"out must have shape \(3,\)"),
        (lambda: op(x, out=torch.empty(3, 1, dtype=out_dtype)), "out must have 1 dim"),
        (lambda: op(x, out=torch.empty(3, dtype=torch.int32)), "out must have dtype"),
        (lambda: op(x, out=torch.empty(3, dtype=out_dtype, device="meta")), "out is on meta"),
        (lambda: op(None), "x must be a torch.Tensor"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    if op is rd.argmax:
        monkeypatch.setattr(rd, "_ARGMAX_MAX_CHUNKS", 2)
        with pytest.raises(ValueError, match="at most 2 are supported"):
            op(_x(1, 3 * 4096, torch.float32, seed=2))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="Triton kernels need CUDA tensors"):
        op(x)
