"""Gemma's elementwise ops in the interpreter: GeGLU (gelu_tanh_and_mul, gelu_tanh_mul) and
the final logit soft-cap, against float64 oracles and their torch references, with tails
that overflow exp, poisoned outputs, row invariance and bad inputs."""

import math

import pytest
import torch

from detlora.ops import gelu_and_mul as gm
from detlora.ops import softcap as sc

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")
TOL = {torch.float32: 2e-6, torch.float16: 1e-3}


def _gelu64(g):
    g = g.double()
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gelu_and_mul_matches_fp64_and_ref(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 2 * 200, generator=g) * 4).to(dtype)
    x[0, :6] = torch.tensor([-60.0, -20.0, -1e-3, 0.0, 20.0, 60.0])
    out = torch.full((9, 200), float("nan"), dtype=dtype)
    assert gm.gelu_tanh_and_mul(x, out=out) is out
    want = _gelu64(x[:, :200]) * x[:, 200:].double()
    assert not out.isnan().any()
    assert float((out.double() - want).norm() / want.norm()) < TOL[dtype]
    ref = gm.gelu_tanh_and_mul_ref(x)
    assert float((ref.double() - want).norm() / want.norm()) < TOL[dtype]
    # Two tensors (a strided gate, a separate up) give the fused layout's bits.
    wide = torch.cat([x[:, :200], torch.zeros(9, 5, dtype=dtype)], dim=1)
    two = gm.gelu_tanh_mul(wide[:, :200], x[:, 200:].contiguous())
    assert torch.equal(two, out)
    assert torch.equal(gm.gelu_tanh_mul_ref(x[:, :200], x[:, 200:]), ref)


def test_gelu_rows_do_not_depend_on_batch_size():
    x = torch.randn(40, 2 * 96, generator=torch.Generator().manual_seed(5)).half()
    alone = [gm.gelu_tanh_and_mul(x[i:i + 1]) for i in (0, 17, 39)]
    full = gm.gelu_tanh_and_mul(x)
    for i, row in zip((0, 17, 39), alone, strict=True):
        assert torch.equal(full[i], row[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softcap_matches_fp64_and_ref_in_place(dtype):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 2500, generator=g) * 40).to(dtype)
    x[0, :4] = torch.tensor([-1e4, -300.0, 300.0, 6e4]).to(dtype)
    want = torch.tanh(x.double() / 30.0) * 30.0
    got = sc.softcap(x.clone(), 30.0)
    assert float((got.double() - want).abs().max()) < 30.0 * TOL[dtype]
    inplace = x.clone()
    assert sc.softcap(inplace, 30.0, out=inplace) is inplace
    assert torch.equal(inplace, got)
    assert float((sc.softcap_ref(x, 30.0).double() - want).abs().max()) < 30.0 * TOL[dtype]
    assert float(got.abs().max()) <= 30.0


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="cap must be a finite positive"):
        sc.softcap(torch.zeros(1, 4), 0.0)
    with pytest.raises(ValueError, match="cap must be a finite positive"):
        sc.softcap(torch.zeros(1, 4), float("inf"))
    with pytest.raises(ValueError, match="must be even"):
        gm.gelu_tanh_and_mul(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="u must have shape"):
        gm.gelu_tanh_mul(torch.zeros(2, 4), torch.zeros(2, 5))
