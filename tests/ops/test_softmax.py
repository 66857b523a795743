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


# ----------------------------------------------------------------------------- chosen_logprob


def _chosen_case(t, v, dtype, seed):
    """Rows with whole -inf chunks, every other entry -inf, and indices that hit the row's
    maximum, a -inf entry and the last column."""
    g = torch.Generator().manual_seed(seed)
    x = _x(t, v, dtype, seed)
    x[0, : v // 2] = float("-inf")
    if t > 1:
        x[1, ::2] = float("-inf")
    index = torch.randint(0, v, (t,), generator=g)
    index[0] = v - 1
    if t > 1:
        index[1] = 0  # a -inf entry: logprob -inf
    if t > 2:
        index[2] = int(x[2].float().argmax())
    return x, index


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,v", [(1, 7), (5, 300), (3, 5000)])
def test_chosen_logprob_is_the_log_softmax_column(t, v, dtype):
    """The kernel: the log-softmax kernel's column of x.float(), bit for bit (5000: two chunks
    merged); the reference: torch's log_softmax column of x.float()."""
    x, index = _chosen_case(t, v, dtype, seed=t * v)
    rows = torch.arange(t)
    got = sx.chosen_logprob(x, index)
    assert got.dtype == torch.float32 and got.shape == (t,)
    assert torch.equal(got, sx.log_softmax(x.float())[rows, index])
    want_ref = sx.log_softmax_ref(x.float()).gather(1, index[:, None])[:, 0]
    assert torch.equal(sx.chosen_logprob_ref(x, index), want_ref)
    if t > 1:
        assert got[1] == float("-inf")
    # out: float64 holds the fp32 values exactly, also through a strided view.
    for make in (lambda: torch.full((t,), float("nan")),
                 lambda: torch.full((t, 2), float("nan"), dtype=torch.float64)[:, 1]):
        out = make()
        assert sx.chosen_logprob(x, index, out=out) is out
        assert torch.equal(out, got.to(out.dtype))
        ref_out = make()
        assert sx.chosen_logprob_ref(x, index, out=ref_out) is ref_out
        assert torch.equal(ref_out, want_ref.to(out.dtype))


def test_chosen_logprob_merges_many_chunks_as_the_kernel(monkeypatch):
    monkeypatch.setattr(sx, "_CHUNK", 16)
    assert sx.softmax_config(200) == (16, 13, 1)  # 13 chunks in a 16-wide merge tile
    for dtype in (torch.float32, torch.bfloat16):
        x, index = _chosen_case(6, 200, dtype, seed=11)
        got = sx.chosen_logprob(x, index)
        assert torch.equal(got, sx.log_softmax(x.float())[torch.arange(6), index])


def test_chosen_logprob_rows_do_not_depend_on_the_batch():
    x, index = _chosen_case(9, 5000, torch.bfloat16, seed=4)
    full = sx.chosen_logprob(x, index)
    for i in (0, 1, 4, 8):
        assert torch.equal(sx.chosen_logprob(x[i:i + 1], index[i:i + 1]), full[i:i + 1])
    # A misaligned copy of the rows (canonical_rows copies it): the same bits.
    base = torch.empty(9 * 5000 + 1, dtype=torch.bfloat16)
    xv = base[1:].view(9, 5000)
    xv.copy_(x)
    assert torch.equal(sx.chosen_logprob(xv, index), full)


def test_chosen_logprob_bad_inputs_raise_value_error(monkeypatch):
    x = _x(3, 16, torch.float32, seed=1)
    idx = torch.tensor([0, 5, 15])
    cases = [
        (lambda op: op(x[0], idx), "x must have 2 dimensions"),
        (lambda op: op(x.double(), idx), "x must have dtype"),
        (lambda op: op(x.t(), idx), "x must be contiguous in its last dimension"),
        (lambda op: op(x[:, :0], idx), "x must have at least one row and column"),
        (lambda op: op(x, idx.int()), "index must have dtype"),
        (lambda op: op(x, idx[:2]), r"index must have shape \(3,\)"),
        (lambda op: op(x, idx[:, None]), "index must have 1 dimensions"),
        (lambda op: op(x, torch.tensor([0, 16, 1])), r"index must be in \[0, 16\), got 16 at "
                                                     "row 1"),
        (lambda op: op(x, torch.tensor([0, 1, -1])), r"index must be in \[0, 16\), got -1"),
        (lambda op: op(x, idx, out=torch.empty(3, dtype=torch.half)), "out must have dtype"),
        (lambda op: op(x, idx, out=torch.empty(4)), r"out must have shape \(3,\)"),
        (lambda op: op(x, idx.to("meta")), "index is on meta but x is on cpu"),
        (lambda op: op(x, idx, out=torch.empty(3, device="meta")), "out is on meta"),
    ]
    for op in (sx.chosen_logprob, sx.chosen_logprob_ref):
        for call, match in cases:
            with pytest.raises(ValueError, match=match):
                call(op)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="Triton kernels need CUDA tensors"):
        sx.chosen_logprob(x, idx)
    assert torch.equal(sx.chosen_logprob_ref(x, idx), torch.log_softmax(x, -1)[[0, 1, 2], idx])
