"""rank_cut in the interpreter against its torch reference (a stable sort) bit for bit: fp32,
bf16 and fp16 keys; unit weights (top-k) and fixed-point probabilities (top-p); one and many
chunks; limits exactly on a rank's start; ties across chunks, -0.0, NaN, infinities; the
``within`` bound; rows independent of the batch; strided rows; bad inputs; and the sm_90
compilation of every launch (no spills)."""

import pytest
import torch

from detlora.ops import rank_cut as rc

INF = float("inf")
NO_LIMIT = 1 << 62


def _small(monkeypatch):
    """Chunks of 32 tokens walked in blocks of 16: V = 150 has 5 chunks."""
    monkeypatch.setattr(rc, "_CHUNK", 32)
    monkeypatch.setattr(rc, "_BLOCK", 16)
    assert rc.rank_cut_config(150)[:4] == (32, 5, 8, 16)


def _logits(n, v, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(n, 6), v, generator=g) * 3
    x[1] = torch.round(x[1])  # ties everywhere, across chunks
    x[2, ::2] = 0.0
    x[2, 1::2] = -0.0
    x[3, : v // 2] = -INF
    x[4, [5, 9 % v]] = INF
    x[4, [3 % v, 11 % v]] = float("nan")
    x[5] = 1.0  # one tie of the whole row
    return x[:n].to(dtype)


def _probs(logits):
    p = torch.softmax(logits.float().nan_to_num(nan=0.0), -1)
    p[0, :3] = float("nan")  # no mass
    return p


def _limits(v, unit):
    if unit:  # top-k
        return torch.tensor([1, 2, 0, v // 3, v, v + 9, -4, 17])
    return torch.tensor([int(p * 2**40) for p in (0.9, 0.5, 0.0, 0.3, 1e-9, 0.999)]
                        + [NO_LIMIT, -4])


def test_config_depends_on_the_vocabulary_only():
    assert rc.rank_cut_config(128256) == (2048, 63, 64, 128, 4)
    assert rc.rank_cut_config(151936) == (2048, 75, 128, 128, 4)
    assert rc.rank_cut_config(5) == (8, 1, 1, 8, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("unit", [True, False])
@pytest.mark.parametrize("small", [False, True])
def test_matches_the_sorting_reference(monkeypatch, dtype, unit, small):
    if small:
        _small(monkeypatch)
    v = 150 if small else 700
    logits = _logits(8, v, seed=v + unit, dtype=dtype)
    logits = torch.cat([logits, logits[:2]])[:8]
    probs = None if unit else _probs(logits)
    limit = _limits(v, unit)
    got = rc.rank_cut(logits, probs, limit)
    assert got.dtype == torch.int64 and got.shape == (8,)
    assert torch.equal(got, rc.rank_cut_ref(logits, probs, limit))
    within = torch.tensor([0, 5, 149, 3, 9, 77, 1, 140])
    assert torch.equal(rc.rank_cut(logits, probs, limit, within),
                       rc.rank_cut_ref(logits, probs, limit, within))


def test_the_reference_is_top_k_and_top_p():
    logits = torch.tensor([[2.0, 3.0, 3.0, 1.0, 3.0, -INF],
                           [0.0, -0.0, 0.0, 5.0, -0.0, -1.0],
                           [float("nan"), 1.0, INF, float("nan"), -INF, 1.0]])
    k = torch.tensor([2, 3, 4])
    # Ranks: ties to the lower id, -0.0 == +0.0, NaN above +inf.
    assert rc.rank_cut_ref(logits, None, k).tolist() == [2, 1, 1]
    assert torch.equal(rc.rank_cut(logits, None, k), rc.rank_cut_ref(logits, None, k))
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25, 0.0, 0.0]] * 3)
    # Rank r is kept while the mass before it is below the limit: 2^39 = half the mass.
    limit = torch.tensor([2**39, 2**39 + 1, 0])
    want = [[1, 2], [3, 0, 1], [0]]  # the kept ranks' first ids, last one is the cut
    got = rc.rank_cut(logits, probs, limit)
    assert got.tolist() == [w[-1] for w in want]
    assert torch.equal(got, rc.rank_cut_ref(logits, probs, limit))


def test_limits_on_a_rank_start_and_one_unit_above(monkeypatch):
    _small(monkeypatch)
    v = 150
    logits = _logits(2, v, seed=4, dtype=torch.bfloat16)[1:2].repeat(10, 1)  # ties
    probs = torch.softmax(logits.float(), -1)
    order = torch.sort(logits[0], descending=True, stable=True).indices
    mass = rc.fixed_point_weights(probs[0])[order]
    before = torch.cumsum(mass, 0) - mass
    ranks = [31, 32, 40, 100, 149]  # chunk edges, inside chunks, the last rank
    limit = torch.tensor([int(before[r]) for r in ranks] + [int(before[r]) + 1 for r in ranks])
    want = [order[r - 1] for r in ranks] + [order[r] for r in ranks]
    got = rc.rank_cut(logits, probs, limit)
    assert got.tolist() == [int(w) for w in want]
    assert torch.equal(got, rc.rank_cut_ref(logits, probs, limit))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_batch(monkeypatch, dtype):
    _small(monkeypatch)
    v = 100
    logits = _logits(8, v, seed=8, dtype=dtype)
    probs = _probs(logits)
    for p, limit in ((None, _limits(v, True)), (probs, _limits(v, False))):
        within = torch.tensor([3, 0, 99, 7, 8, 20, 1, 2])
        full = rc.rank_cut(logits, p, limit, within)
        for i in range(8):
            one = slice(i, i + 1)
            got = rc.rank_cut(logits[one], None if p is None else p[one], limit[one],
                              within[one])
            assert torch.equal(got, full[one])


def test_strided_rows_and_parameters():
    big = _logits(6, 260, seed=5, dtype=torch.float32)
    logits = big[:, :250]  # row stride 260
    probs = torch.softmax(torch.randn(6, 300), -1)[:, :250]  # row stride 300
    limit = torch.tensor([[2**39, 0], [7, 0], [2**30, 0], [NO_LIMIT, 0], [1, 0], [-1, 0]])[:, 0]
    within = torch.tensor([[1, 9], [2, 9], [3, 9], [4, 9], [5, 9], [6, 9]])[:, 0]
    assert limit.stride(0) == within.stride(0) == 2
    for p in (None, probs):
        assert torch.equal(rc.rank_cut(logits, p, limit, within),
                           rc.rank_cut_ref(logits, p, limit, within))


def test_empty_batch():
    none = torch.zeros(0, dtype=torch.int64)
    assert rc.rank_cut(torch.zeros(0, 9), None, none).shape == (0,)


def test_bad_inputs_raise_value_error(monkeypatch):
    x = torch.randn(3, 16)
    p, lim, w = torch.softmax(x, -1), torch.full((3,), 4), torch.zeros(3, dtype=torch.int64)
    cases = [
        (lambda: rc.rank_cut(x.double(), p, lim), "logits must have dtype"),
        (lambda: rc.rank_cut(x[0], p, lim), "logits must have 2 dimensions"),
        (lambda: rc.rank_cut(x.t(), None, lim.repeat(6)[:16]), "logits must be contig"),
        (lambda: rc.rank_cut(x[:, :0], None, lim), "logits must have at least one column"),
        (lambda: rc.rank_cut(x, p.half(), lim), "probs must have dtype"),
        (lambda: rc.rank_cut(x, p[:, :8], lim), r"probs must have shape \(3, 16\)"),
        (lambda: rc.rank_cut(x, p, lim.int()), "limit must have dtype"),
        (lambda: rc.rank_cut(x, p, lim[:2]), r"limit must have shape \(3,\)"),
        (lambda: rc.rank_cut(x, p, [4, 4, 4]), "limit must be a torch.Tensor"),
        (lambda: rc.rank_cut(x, p, lim, w.int()), "within must have dtype"),
        (lambda: rc.rank_cut(x, p, lim, w[:1]), r"within must have shape \(3,\)"),
        (lambda: rc.rank_cut(x, p.to("meta"), lim), "probs is on meta"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="Triton kernels need CUDA tensors"):
        rc.rank_cut(x, p, lim)


_SM90_SCRIPT = r"""
import json, sys
from tools.compile_sm90 import compile_kernel, ptxas_spills
from detlora.ops import rank_cut as rc

ptrs = {"probs_ptr": "*fp32", "limit_ptr": "*i64", "within_ptr": "*i64", "state_ptr": "*i64",
        "cnt_ptr": "*i32", "wsum_ptr": "*i64", "tie_cnt_ptr": "*i32", "tie_w_ptr": "*i64",
        "out_ptr": "*i64"}
out = []
for vocab in json.loads(sys.argv[1]):
    chunk, chunks, p2, block, warps = rc.rank_cut_config(vocab)
    for dt, bits in (("*bf16", 16), ("*fp32", 32)):
        common = dict(V=vocab, CHUNK=chunk, BLOCK=block, NUM_CHUNKS=chunks, CHUNKS_P2=p2,
                      KEY_BITS=bits, NUM_PASSES=bits // 4)
        for unit in (True, False):
            for pass_ in (0, 1, bits // 4):
                k, _ = compile_kernel(rc._rank_cut_pass_kernel, common | dict(
                    PASS=pass_, UNIT=unit), ptrs | {"logits_ptr": dt}, num_warps=warps)
                out.append({"kernel": f"pass {pass_} {dt} unit={unit}",
                            "spills": ptxas_spills(k.asm["ptx"])})
            k, _ = compile_kernel(rc._rank_cut_final_kernel, common | dict(
                UNIT=unit, HAS_WITHIN=True), ptrs | {"logits_ptr": dt}, num_warps=warps)
            out.append({"kernel": f"final {dt} unit={unit}", "spills": ptxas_spills(k.asm["ptx"])})
print(json.dumps(out))
"""


def test_kernels_compile_for_sm90_without_spills(sm90_compile):
    results = sm90_compile(_SM90_SCRIPT, [128256])
    assert len(results) == 16
    for r in results:
        assert r["spills"] == 0, r
