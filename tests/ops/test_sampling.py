"""Sampling kernels in the interpreter: Gumbel-max against its torch reference bit for bit
(odd shapes, one and many chunks, -inf, NaN and tied rows, row independence), the hash
helpers, and bad inputs."""

import numpy as np
import pytest
import torch

from detlora.ops import sampling as sp


def _keys(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**32, (n, 2), generator=g, dtype=torch.int64)


def _x(n, v, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 3


def _small_chunks(monkeypatch):
    """Blocks of 16 and at most 4 chunks: V = 150 walks 3 blocks per chunk in 4 chunks."""
    monkeypatch.setattr(sp, "_GUMBEL_BLOCK", 16)
    monkeypatch.setattr(sp, "_GUMBEL_MAX_CHUNKS", 4)
    assert sp.gumbel_argmax_config(150)[:3] == (16, 3, 4)


def test_hash_helpers():
    x = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1], dtype=torch.int64)
    mixed = sp._mix32(x)
    assert mixed.tolist() == [sp._mix32(int(v)) for v in x.tolist()]
    assert int(mixed.min()) >= 0 and int(mixed.max()) < 2**32
    th = sp.token_hash(1000)
    assert th.dtype == torch.int64 and th.shape == (1000,)
    assert th.tolist()[:3] == [sp._mix32(sp._mix32(i ^ 0x27D4EB2F) ^ 0x165667B1) for i in range(3)]
    u = sp.uniform_noise(_keys(3, 0), th)
    assert u.dtype == torch.float64 and float(u.min()) > 0 and float(u.max()) < 1
    assert torch.equal(sp.gumbel_noise(_keys(3, 0), th), -torch.log(-torch.log(u)))


def test_configs_depend_on_the_vocabulary_only():
    assert sp.gumbel_argmax_config(128256) == (1024, 1, 126, 4)
    assert sp.gumbel_argmax_config(5) == (8, 1, 1, 1)


@pytest.mark.parametrize("n,v", [(1, 1), (3, 5), (5, 1000), (1, 1024), (3, 1500), (1, 3000)])
def test_gumbel_argmax_matches_reference(n, v):
    x = _x(n, v, seed=n * v)
    x[0, : v // 3] = float("-inf")
    keys, th = _keys(n, seed=v), sp.token_hash(v)
    got = sp.gumbel_argmax(x, keys, th)
    assert got.dtype == torch.int64 and got.shape == (n,)
    assert torch.equal(got, sp.gumbel_argmax_ref(x, keys, th))


@pytest.mark.parametrize("v", [37, 1500])
def test_gumbel_scores_are_the_reference_bits(v):
    x = _x(3, v, seed=v)
    x[1, 5:30] = float("-inf")
    keys, th = _keys(3, seed=1), sp.token_hash(v)
    scores = sp.gumbel_scores(x, keys, th)
    # The interpreter's float64 log is numpy's: with it, the bits are the reference's exactly
    # (hash, 53-bit uniform, -log(-log(u)), + x). torch's CPU log may differ in the last bit.
    u = sp.uniform_noise(keys, th).numpy()
    assert torch.equal(scores, x.double() + torch.from_numpy(-np.log(-np.log(u))))
    ref = x.double() + sp.gumbel_noise(keys, th)
    assert torch.allclose(scores, ref, rtol=0, atol=1e-13)


def test_gumbel_argmax_multi_block_chunks(monkeypatch):
    _small_chunks(monkeypatch)
    x = _x(5, 150, seed=3)
    x[1, :140] = float("-inf")  # only the last, partial block is finite
    x[2] = float("-inf")  # all -inf: index 0, as torch.argmax
    keys, th = _keys(5, seed=3), sp.token_hash(150)
    got = sp.gumbel_argmax(x, keys, th)
    assert torch.equal(got, sp.gumbel_argmax_ref(x, keys, th))
    assert 140 <= got[1] < 150 and got[2] == 0


@pytest.mark.parametrize("small", [False, True])
def test_gumbel_argmax_ties_nan_and_inf(monkeypatch, small):
    if small:
        _small_chunks(monkeypatch)
    v = 150
    x = _x(7, v, seed=5)
    x[0, [130, 40, 41]] = float("inf")  # score ties across chunks: the lowest index wins
    x[1, 60:64] = float("inf")  # ties inside a block
    x[2] = 3.0  # x tied everywhere: the noise decides
    x[3] = float("-inf")
    x[4, [120, 90]] = float("nan")  # NaN outranks +inf: the first NaN
    x[4, 10] = float("inf")
    x[5, 149] = 100.0  # the maximum in the last, partial block
    x[6, 0] = 100.0
    keys, th = _keys(7, seed=6), sp.token_hash(v)
    got = sp.gumbel_argmax(x, keys, th)
    assert torch.equal(got, sp.gumbel_argmax_ref(x, keys, th))
    assert [got[i].item() for i in (0, 1, 3, 4, 5, 6)] == [40, 60, 0, 90, 149, 0]


@pytest.mark.parametrize("small", [False, True])
def test_gumbel_argmax_rows_do_not_depend_on_the_batch(monkeypatch, small):
    if small:
        _small_chunks(monkeypatch)
    v = 150 if small else 1100
    x, keys, th = _x(5, v, seed=8), _keys(5, seed=8), sp.token_hash(v)
    x[::2, 7] = x[::2, 99] = float("inf")
    full = sp.gumbel_argmax(x, keys, th)
    for t in (1, 3, 5):
        assert torch.equal(sp.gumbel_argmax(x[:t], keys[:t], th), full[:t])
    for i in range(5):
        assert torch.equal(sp.gumbel_argmax(x[i : i + 1], keys[i : i + 1], th), full[i : i + 1])
    flip = sp.gumbel_argmax(x.flip(0), keys.flip(0), th)
    assert torch.equal(flip.flip(0), full)
    # Another key (seed or position) draws differently somewhere.
    assert not torch.equal(sp.gumbel_argmax(x, keys + 1, th), full)


def test_gumbel_argmax_strided_rows_and_empty_batch():
    x = _x(3, 200, seed=9)[:, :150]  # row stride 200
    keys, th = _keys(3, seed=9), sp.token_hash(150)
    assert torch.equal(sp.gumbel_argmax(x, keys, th), sp.gumbel_argmax_ref(x, keys, th))
    assert sp.gumbel_argmax(x[:0], keys[:0], th).shape == (0,)


def test_bad_inputs_raise_value_error(monkeypatch):
    x, keys, th = _x(3, 16, seed=1), _keys(3, seed=1), sp.token_hash(16)
    cases = [
        (lambda: sp.gumbel_argmax(None, keys, th), "x must be a torch.Tensor"),
        (lambda: sp.gumbel_argmax(x[0], keys, th), "x must have 2 dimensions"),
        (lambda: sp.gumbel_argmax(x.double(), keys, th), "x must have dtype"),
        (lambda: sp.gumbel_argmax(x.bfloat16(), keys, th), "x must have dtype"),
        (lambda: sp.gumbel_argmax(x.t(), keys, th), "x must be contiguous in its last"),
        (lambda: sp.gumbel_argmax(x[:, :0], keys, th[:0]), "x must have at least one column"),
        (lambda: sp.gumbel_argmax(x, keys.int(), th), "keys must have dtype"),
        (lambda: sp.gumbel_argmax(x, keys[:2], th), r"keys must have shape \(3, 2\)"),
        (lambda: sp.gumbel_argmax(x, keys[:, :1], th), r"keys must have shape \(3, 2\)"),
        (lambda: sp.gumbel_argmax(x, keys.t().contiguous().t(), th), "keys must be contiguous"),
        (lambda: sp.gumbel_argmax(x, keys, th[:15]), r"token_hash must have shape \(16,\)"),
        (lambda: sp.gumbel_argmax(x, keys, th.int()), "token_hash must have dtype"),
        (lambda: sp.gumbel_argmax(x, keys, th.to("meta")), "token_hash is on meta"),
        (lambda: sp.gumbel_scores(x, keys.to("meta"), th), "keys is on meta"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for call in (lambda: sp.gumbel_argmax(x, keys, th),):
        with pytest.raises(ValueError, match="Triton kernels need CUDA tensors"):
            call()


_SM90_SCRIPT = r"""
import json, sys
from compile_sm90 import compile_kernel, ptx_summary, ptxas_spills
from detlora.ops import sampling as sp
from detlora.ops._runtime import next_power_of_2

ptrs = {"x_ptr": "*fp32", "keys_ptr": "*i64", "hash_ptr": "*i64", "out_ptr": "*i64",
        "part_val_ptr": "*fp64", "part_idx_ptr": "*i32", "scores_ptr": "*fp64",
        "mass_ptr": "*i64", "limit_ptr": "*i64"}

def build(fn, consts, num_warps, ptr_types=ptrs):
    k, _ = compile_kernel(fn, consts, ptr_types, num_warps=num_warps,
                          div16=("stride_x", "stride_keys", "stride_mass", "stride_out"))
    ptx = k.asm["ptx"]
    spills = ptxas_spills(ptx)
    return {"spills": spills, "lg2_approx": "lg2.approx" in ptx, "ptx": ptx_summary(ptx)}

out = []
for vocab in json.loads(sys.argv[1]):
    block, per_chunk, chunks, warps = sp.gumbel_argmax_config(vocab)
    for scores in (False, True):
        out.append(build(sp._gumbel_argmax_kernel, dict(
            V=vocab, BLOCK=block, BLOCKS_PER_CHUNK=per_chunk, NUM_CHUNKS=chunks,
            WRITE_SCORES=scores), warps))
    out.append(build(sp.argmax_merge_kernel, dict(
        N=vocab, NUM_CHUNKS=chunks, CHUNKS_P2=next_power_of_2(chunks)),
        sp.merge_num_warps(chunks)))
print(json.dumps(out))
"""


def test_kernels_compile_for_sm90_without_spills(sm90_compile):
    """The GPU path, checked without a GPU: Triton compiles the kernels for sm_90 (H200)."""
    vocabs = [128256, 151936]  # Llama 3, Qwen: 126 and 149 chunks (merge in 4 warps)
    results = sm90_compile(_SM90_SCRIPT, vocabs)
    assert len(results) == 3 * len(vocabs)
    for r in results:
        # No spills; float64 log is libdevice's, never the fp32 lg2.approx.
        assert r["spills"] == 0 and not r["lg2_approx"], r
