"""The cut filter of detlora.ops.sampling in the interpreter against its torch reference bit
for bit: ties, -0.0, NaN and infinities at the cut, the IEEE division, strided rows, bad
inputs; and its sm_90 compilation (no spills, ``div.rn.f32``). The cut itself (rank_cut) is
tested in test_rank_cut.py."""

import pytest
import torch

from detlora.ops import sampling as sp

INF = float("inf")


def _x(n, v, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g) * 3).to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal on the fp32 bit patterns: NaN equals NaN, -0.0 differs from +0.0."""
    return a.dtype == b.dtype == torch.float32 and torch.equal(
        a.view(torch.int32), b.view(torch.int32))


def _sorted(x):
    return torch.sort(x, dim=-1, descending=True, stable=True)


def test_config_depends_on_the_vocabulary_only():
    assert sp.filter_block_config(128256) == (1024, 126, 4)
    assert sp.filter_block_config(3) == (4, 1, 1)


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
    if small:  # blocks of 32 tokens: V = 150 has 5
        monkeypatch.setattr(sp, "_FILTER_BLOCK", 32)
        assert sp.filter_block_config(150)[:2] == (32, 5)
    v = 150 if small else 1500
    logits = _cut_inputs(6, v, seed=7, dtype=dtype)
    temps = torch.tensor([0.7, 1.0, 1.3, 2.0, 0.5, 1.0])
    _, order = _sorted(logits)
    x = logits.float() / temps[:, None]
    for kept in ([1, 2, 3, 1, 4, 1], [v // 3, v // 2, v // 2 + 1, v - 1, 3, v],
                 [v, v, v - 1, v, 2, 7]):
        r = torch.tensor(kept)
        cut = order.gather(1, (r - 1)[:, None])[:, 0]
        got = sp.cut_filter(logits, temps, cut)
        assert _same_bits(got, sp.cut_filter_ref(logits, temps, cut))
        # The kept tokens are exactly order[:, :R] (the scatter the filter replaces).
        ranks = torch.arange(v)[None, :] < r[:, None]
        scattered = torch.empty_like(x).scatter_(
            1, order, x.gather(1, order).masked_fill(~ranks, -INF))
        assert _same_bits(got, scattered)
    assert _same_bits(sp.cut_filter(logits, temps, None), x)


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
    assert _same_bits(sp.cut_filter(logits, temps, None), logits / temps[:, None])


def test_cut_filter_takes_strided_rows_and_is_row_wise():
    logits = _x(4, 300, seed=5)[:, :250]  # row stride 300
    slots = torch.zeros(4, dtype=torch.int64)
    slots.view(torch.float32)[::2] = torch.tensor([0.5, 1.0, 2.0, 1.5])
    temps = slots.view(torch.float32)[::2]  # stride 2, as the sampler's
    cuts = torch.tensor([[9, 3], [200, 1], [249, 0], [0, 7]])
    for cut in (cuts[:, 0], cuts[:, 1], cuts.reshape(-1)[::2].clone()):
        assert cuts[:, 0].stride(0) == 2
        out = sp.cut_filter(logits, temps, cut)
        assert _same_bits(out, sp.cut_filter_ref(logits, temps, cut))
        for i in range(4):
            one = slice(i, i + 1)
            assert _same_bits(sp.cut_filter(logits[one], temps[one], cut[one]), out[one])


def test_empty_batch():
    z = torch.zeros(0, 9)
    assert sp.cut_filter(z, torch.zeros(0), torch.zeros(0, dtype=torch.int64)).shape == (0, 9)
    assert sp.cut_filter(z, torch.zeros(0), None).shape == (0, 9)


def test_bad_inputs_raise_value_error(monkeypatch):
    x = _x(3, 16, seed=1)
    t, c = torch.ones(3), torch.full((3,), 4)
    cases = [
        (lambda: sp.cut_filter(x, t, c.int()), "cut must have dtype"),
        (lambda: sp.cut_filter(x, t, c[:1]), r"cut must have shape \(3,\)"),
        (lambda: sp.cut_filter(x, t, c[:, None]), "cut must have 1 dimensions"),
        (lambda: sp.cut_filter(x, t[:2], c), r"temps must have shape \(3,\)"),
        (lambda: sp.cut_filter(x, t.half(), c), "temps must have dtype"),
        (lambda: sp.cut_filter(x.to(torch.int64), t, c), "logits must have dtype"),
        (lambda: sp.cut_filter(x[0], t, c), "logits must have 2 dimensions"),
        (lambda: sp.cut_filter(x[:, :0], t, c), "logits must have at least one"),
        (lambda: sp.cut_filter(x, t, c.to("meta")), "cut is on meta"),
        (lambda: sp.cut_filter(x, t, [1, 2, 3]), "cut must be a torch.Tensor"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="Triton kernels need CUDA tensors"):
        sp.cut_filter(x, t, c)


_SM90_SCRIPT = r"""
import json, re, sys
from tools.compile_sm90 import compile_kernel, ptx_summary, ptxas_spills
from detlora.ops import sampling as sp

base = {"temps_ptr": "*fp32", "cut_ptr": "*i64", "out_ptr": "*fp32"}

out = []
for vocab in json.loads(sys.argv[1]):
    block, _, warps = sp.filter_block_config(vocab)
    for dt in ("*fp32", "*bf16"):
        for flag in (False, True):
            k, _ = compile_kernel(sp._cut_filter_kernel, dict(V=vocab, BLOCK=block,
                                  HAS_CUT=flag), base | {"x_ptr": dt}, num_warps=warps,
                                  div16=("stride_x", "stride_out"))
            ptx = k.asm["ptx"]
            out.append({"spills": ptxas_spills(ptx), "div_rn": "div.rn.f32" in ptx,
                        "div_other": bool(re.search(r"div\.(full|approx)", ptx)),
                        "ptx": ptx_summary(ptx)})
print(json.dumps(out))
"""


def test_cut_filter_compiles_for_sm90_with_ieee_division(sm90_compile):
    """The GPU path, checked without a GPU: no spills, and the temperature division is
    ``div.rn.f32`` (torch's IEEE division), never ``div.full``/``div.approx``."""
    results = sm90_compile(_SM90_SCRIPT, [128256])
    assert len(results) == 4
    for r in results:
        assert r["spills"] == 0 and r["div_rn"] and not r["div_other"], r
