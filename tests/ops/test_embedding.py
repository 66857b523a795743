"""Embedding kernel in the interpreter: exact gather, poisoned output, row invariance, id
validation, bad inputs."""

import pytest
import torch

from detlora.ops import embedding as em

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _weight(v, h, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(v, h, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,v,h", [(1, 10, 64), (3, 50, 100), (17, 300, 2500), (130, 7, 33)])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_gathers_exact_rows(t, v, h, dtype, id_dtype):
    w = _weight(v, h, dtype, seed=t + v + h)
    ids = torch.randint(0, v, (t,), generator=torch.Generator().manual_seed(t), dtype=id_dtype)
    ids[0] = v - 1  # the last row is in range
    out = torch.full((t, h), float("nan"), dtype=dtype)
    assert em.embedding(ids, w, out=out) is out
    assert torch.equal(out, w.double()[ids.long()].to(dtype))
    assert torch.equal(em.embedding(ids, w, validate=False), em.embedding_ref(ids, w))


def test_strided_weight_rows():
    big = _weight(20, 96, torch.float16, seed=3)
    w = big[:, 16:80]  # row stride 96
    ids = torch.tensor([19, 0, 7, 7])
    assert torch.equal(em.embedding(ids, w), w[ids])


def test_rows_do_not_depend_on_batch_size():
    w = _weight(300, 2500, torch.bfloat16, seed=5)
    ids = torch.randint(0, 300, (130,), generator=torch.Generator().manual_seed(5))
    rows = [0, 2, 16, 129]
    alone = {i: em.embedding(ids[i:i + 1], w) for i in rows}
    for t in (3, 17, 130):
        y = em.embedding(ids[:t], w)
        for i in (i for i in rows if i < t):
            assert torch.equal(y[i], alone[i][0]), (t, i)


def test_bad_inputs_raise_value_error(monkeypatch):
    w = _weight(10, 16, torch.float32, seed=1)
    ids = torch.tensor([1, 2, 3])
    cases = [
        (lambda: em.embedding(torch.tensor([0, 10]), w), r"ids must be in \[0, 10\).*max 10"),
        (lambda: em.embedding(torch.tensor([-1, 3]), w), r"ids must be in \[0, 10\).*min -1"),
        (lambda: em.embedding(ids[:, None], w), "ids must have 1 dimensions"),
        (lambda: em.embedding(ids.float(), w), "ids must have dtype"),
        (lambda: em.embedding(ids.to(torch.int16), w), "ids must have dtype"),
        (lambda: em.embedding(torch.arange(6)[::2], w), "ids must be contiguous"),
        (lambda: em.embedding(ids[:0], w), "ids must hold at least one id"),
        (lambda: em.embedding(ids, w[0]), "weight must have 2 dimensions"),
        (lambda: em.embedding(ids, w.double()), "weight must have dtype"),
        (lambda: em.embedding(ids, w.t()), "weight must be contiguous"),
        (lambda: em.embedding(ids, w[:, :0]), "weight must have at least one row"),
        (lambda: em.embedding(ids, w, out=torch.empty(3, 15)), r"out must have shape \(3, 16\)"),
        (lambda: em.embedding(ids, w, out=torch.empty(3, 16, dtype=torch.half)),
         "out must have dtype"),
        (lambda: em.embedding(ids.to("meta"), w), "weight is on cpu but ids is on meta"),
        (lambda: em.embedding([1, 2], w), "ids must be a torch.Tensor"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="Triton kernels need CUDA tensors"):
        em.embedding(ids, w)
