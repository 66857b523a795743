"""Mamba-2 ops: the chunked scan (SSD) on the fixed chunk grid, the causal conv with state,
the gated grouped RMSNorm and squared ReLU.

The references are checked against the math (a float64 token-by-token recurrence, torch's
conv1d, transformers' gated norm) and, bit for bit, against themselves however a sequence's
rows are split over steps or batched: a prompt in one step, in pieces at or off the chunk
grid, a token at a time (decode) and beside another sequence give the same bits. The kernels
(Triton's interpreter, fp32 and fp16) are checked against the references and keep the same
bits across the same splits.
"""

from __future__ import annotations

import math

import pytest
import torch

from detlora.ops._runtime import interpreting
from detlora.ops.chunk_plan import ChunkPlan
from detlora.ops.gated_rms_norm import gated_rms_norm_ref
from detlora.ops.mamba_conv import causal_conv1d_ref
from detlora.ops.mamba_ssd import mamba_chunk_scan_ref

H, P, G, N, CS = 6, 10, 2, 12, 8  # d_inner 60, conv 108: no power of two
CONV = H * P + 2 * G * N
SPLITS = ([19], [5, 1, 1, 7, 5], [8, 8, 3], [3, 13, 3], [1] * 19)
kernels = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")


def _inputs(length: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xbc = torch.randn(length, CONV, generator=g).to(dtype)
    dt = (torch.randn(length, H, generator=g) * 0.5).to(dtype)
    a = -torch.exp(torch.rand(H, generator=g) * 2)
    d = torch.randn(H, generator=g)
    dt_bias = torch.randn(H, generator=g) * 0.3
    return xbc, dt, a, d, dt_bias


def _scan(fn, inputs, splits, *, slot=1, slots=3):
    """Run one sequence through ``fn`` in steps of ``splits`` rows; (y, its slot's SSM
    state, the open chunk's rows in its buffer). Slots start as NaN: a fresh sequence must
    read nothing from them."""
    xbc, dt, a, d, dt_bias = inputs
    state = torch.full((slots, H, P, N), float("nan"))
    buf = torch.full((slots, CS, CONV + H), float("nan")).to(xbc.dtype)
    ys, pos = [], 0
    for n in splits:
        plan = ChunkPlan.build([0, n], [pos + n], [slot], CS)
        ys.append(fn(xbc[pos:pos + n], dt[pos:pos + n], a, d, dt_bias, state, buf, plan,
                     head_dim=P, n_groups=G))
        pos += n
    return torch.cat(ys), state[slot], buf[slot, : pos % CS]


def _recurrence(inputs) -> torch.Tensor:
    """y of the Mamba-2 recurrence, token by token in float64."""
    xbc, dt, a, d, dt_bias = (t.double() for t in inputs)
    x = xbc[:, :H * P].view(-1, H, P)
    b, c = xbc[:, H * P:H * P + G * N].view(-1, G, N), xbc[:, H * P + G * N:].view(-1, G, N)
    dtv = torch.nn.functional.softplus(dt + dt_bias)
    s = torch.zeros(H, P, N, dtype=torch.float64)
    ys = []
    for t in range(xbc.shape[0]):
        for h in range(H):
            grp = h // (H // G)
            s[h] = s[h] * math.exp(dtv[t, h] * a[h]) + dtv[t, h] * torch.outer(x[t, h], b[t, grp])
        ys.append(torch.stack([s[h] @ c[t, h // (H // G)] + d[h] * x[t, h]
                               for h in range(H)]).reshape(-1))
    return torch.stack(ys)


def test_chunk_plan_lists_each_sequence_chunk_on_the_grid():
    # seq 0: positions 5..17 (chunks 0, 1, 2); seq 1: position 8 (a decode closing nothing,
    # chunk 1 row 0); seq 2: positions 14..15 (closes chunk 1).
    plan = ChunkPlan.build([0, 13, 14, 16], [18, 9, 16], [4, 0, 2], CS)
    assert plan.items.tolist() == [
        [0, 4, 0, 0 - 5, 5, 8, -1], [0, 4, 1, 3, 0, 8, 0], [0, 4, 2, 11, 0, 2, 1],
        [1, 0, 1, 13, 0, 1, -1],
        [2, 2, 1, 14 - 6, 6, 8, -1]]
    assert plan.seq_items.tolist() == [0, 3, 4, 5]
    assert plan.first_tiles.tolist() == [[0, 0], [3, 0], [4, 0]]
    assert plan.rest_tiles.tolist() == [[1, 0], [2, 0]]
    assert plan.pass_seqs.tolist() == [0, 2] and plan.num_rest == 2
    assert plan.open_items.tolist() == [2, 3]
    with pytest.raises(ValueError, match="computes 0 rows"):
        ChunkPlan.build([0, 0], [3], [0], CS)


def test_ssd_reference_is_the_recurrence():
    inputs = _inputs(19, torch.float32)
    y, _, _ = _scan(mamba_chunk_scan_ref, inputs, [19])
    torch.testing.assert_close(y.double(), _recurrence(inputs), rtol=0, atol=2e-5)


def test_ssd_reference_bits_do_not_depend_on_the_split_or_the_batch():
    inputs = _inputs(19, torch.float32)
    ref = _scan(mamba_chunk_scan_ref, inputs, [19])
    for splits in SPLITS[1:]:
        got = _scan(mamba_chunk_scan_ref, inputs, splits, slot=0)
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)), splits
    # Beside another sequence (of its own slot), in one step.
    xbc, dt, a, d, dt_bias = inputs
    other = _inputs(11, torch.float32, seed=1)
    state = torch.zeros(3, H, P, N)
    buf = torch.zeros(3, CS, CONV + H)
    plan = ChunkPlan.build([0, 11, 30], [11, 19], [2, 0], CS)
    y = mamba_chunk_scan_ref(torch.cat([other[0], xbc]), torch.cat([other[1], dt]), a, d,
                             dt_bias, state, buf, plan, head_dim=P, n_groups=G)
    assert torch.equal(y[11:], ref[0]) and torch.equal(state[0], ref[1])


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ssd_kernel_matches_the_reference_and_keeps_its_bits(dtype):
    from detlora.ops.mamba_ssd import mamba_chunk_scan

    inputs = _inputs(19, dtype)
    ref = _scan(mamba_chunk_scan_ref, inputs, [19])
    got = _scan(mamba_chunk_scan, inputs, [19])
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    scale = ref[0].abs().max()
    assert (got[0] - ref[0]).abs().max() <= tol * scale
    torch.testing.assert_close(got[1], ref[1], rtol=tol, atol=tol)
    assert torch.equal(got[2], ref[2])  # the open chunk's rows are copies
    if dtype == torch.float16:  # the bits of the split (fp16 rounds where fp32 would not)
        again = _scan(mamba_chunk_scan, inputs, [5, 1, 1, 7, 5], slot=2)
        assert all(torch.equal(a, b) for a, b in zip(again, got, strict=True))


def test_conv_reference_is_torch_conv_and_keeps_its_bits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, CONV, generator=g)
    w, bias = torch.randn(CONV, 4, generator=g), torch.randn(CONV, generator=g)
    want = torch.nn.functional.silu(torch.nn.functional.conv1d(
        x.t()[None], w[:, None, :], bias, padding=3, groups=CONV)[0, :, :11].t())
    runs = [_conv(causal_conv1d_ref, x, w, bias, s) for s in ([11], [2, 1, 5, 3], [1] * 11)]
    torch.testing.assert_close(runs[0][0], want, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for r in runs[1:] for a, b in zip(r, runs[0], strict=True))


@kernels
def test_conv_kernel_matches_the_reference_and_keeps_its_bits():
    from detlora.ops.mamba_conv import causal_conv1d

    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, CONV, generator=g).half()
    w, bias = torch.randn(CONV, 4, generator=g).half(), torch.randn(CONV, generator=g).half()
    ref = _conv(causal_conv1d_ref, x, w, bias, [11])
    got = _conv(causal_conv1d, x, w, bias, [11])
    torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=2e-3, atol=2e-3)
    assert torch.equal(got[1], ref[1])
    again = _conv(causal_conv1d, x, w, bias, [2, 1, 5, 3])
    assert all(torch.equal(a, b) for a, b in zip(again, got, strict=True))


def _conv(fn, x, w, bias, splits):
    state = torch.full((3, 3, CONV), float("nan")).to(x.dtype)
    outs, pos = [], 0
    for n in splits:
        i32 = dict(dtype=torch.int32)
        outs.append(fn(x[pos:pos + n], w, bias, state, torch.tensor([1], **i32),
                       torch.tensor([pos], **i32), torch.tensor([0, n], **i32),
                       torch.zeros(n, **i32)))
        pos += n
    return torch.cat(outs), state[1]


def test_gated_norm_reference_is_transformers():
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated

    g = torch.Generator().manual_seed(0)
    y, z = torch.randn(5, 60, generator=g), torch.randn(5, 60, generator=g)
    hf = NemotronHRMSNormGated(60, group_size=30, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(60, generator=g) + 0.5)
        torch.testing.assert_close(gated_rms_norm_ref(y, z, hf.weight, 30, 1e-5),
                                   hf(y, z), rtol=1e-6, atol=1e-6)


@kernels
def test_gated_norm_and_relu_squared_kernels():
    from detlora.ops.gated_rms_norm import gated_rms_norm
    from detlora.ops.relu_squared import relu_squared, relu_squared_ref

    g = torch.Generator().manual_seed(0)
    y, z = torch.randn(5, 60, generator=g), torch.randn(5, 60, generator=g).half()
    w = (torch.rand(60, generator=g) + 0.5).half()
    torch.testing.assert_close(gated_rms_norm(y, z, w, 30, 1e-5).float(),
                               gated_rms_norm_ref(y, z, w, 30, 1e-5).float(),
                               rtol=2e-3, atol=2e-3)
    x = torch.randn(7, 120, generator=g).half()
    assert torch.equal(relu_squared(x), relu_squared_ref(x))
    with pytest.raises(ValueError, match="group_size 7 must divide 60"):
        gated_rms_norm(y, z, w, 7, 1e-5)


@kernels
def test_scan_refuses_a_mismatched_state_cache():
    from detlora.ops.mamba_ssd import mamba_chunk_scan

    xbc, dt, a, d, dt_bias = _inputs(5, torch.float32)
    plan = ChunkPlan.build([0, 5], [5], [0], CS)
    with pytest.raises(ValueError, match="chunk_buf"):
        mamba_chunk_scan(xbc, dt, a, d, dt_bias, torch.zeros(1, H, P, N),
                         torch.zeros(1, CS, CONV), plan, head_dim=P, n_groups=G)
    with pytest.raises(ValueError, match="does not hold x"):
        mamba_chunk_scan(xbc, dt, a, d, dt_bias, torch.zeros(1, H, P, N),
                         torch.zeros(1, CS, CONV + H), plan, head_dim=P, n_groups=5)


_SM90_SCRIPT = r"""
import json, sys
from compile_sm90 import compile_kernel, ptx_summary, ptxas_spills
from detlora.ops import gated_rms_norm as gn, mamba_conv as mc, mamba_ssd as ms

h, p, g, n, cs = json.loads(sys.argv[1])
conv = h * p + 2 * g * n
bm, bn, bp = ms.scan_blocks(cs, n, p)
f32 = {k: "*fp32" for k in ("y_ptr", "state_ptr", "cum_ptr", "dtp_ptr", "d_ptr",
                            "dt_bias_ptr", "a_ptr", "cb_ptr")}
i32 = {k: "*i32" for k in ("items_ptr", "tiles_ptr", "seq_items_ptr", "pass_ptr", "open_ptr",
                           "token_seq_ptr", "slots_ptr", "start_ptr", "qsl_ptr")}
floats = {"dt_lo": "fp32", "dt_hi": "fp32", "eps": "fp32"}
out = []
for fn, consts, warps in [
    (ms._chunk_scan_kernel, dict(H=h, P=p, G=g, N=n, CSP=cs, CBW=cs, BM=bm, BN=bn, BP=bp,
                                 FROM_SLOT=True), 4),
    (ms._chunk_scan_kernel, dict(H=h, P=p, G=g, N=n, CSP=cs, CBW=cs, BM=bm, BN=bn, BP=bp,
                                 FROM_SLOT=False), 4),
    (ms._chunk_cb_kernel, dict(H=h, P=p, G=g, N=n, CBW=cs, BM=bm, BN=bn), 4),
    (ms._state_pass_kernel, dict(H=h, P=p, G=g, N=n, CS=cs, CSP=cs, TILES=cs // 32, BM=32,
                                 BN=bn, BP=min(bp, 32)), 8),
    (ms._dt_cumsum_kernel, dict(H=h, CONV=conv, CSP=cs, HB=16), 4),
    (ms._chunk_buf_kernel, dict(CONV=conv, H=h, BM=bm, BC=128), 4),
    (mc._conv_kernel, dict(C=conv, K=4, HAS_BIAS=True, ROWS=4, BLOCK_C=1024), 8),
    (gn._gated_rms_norm_kernel, dict(G=g, GS=h * p // g, GP=g, BLOCK=1024), 8),
]:
    k, _ = compile_kernel(fn, consts, {**f32, **i32}, num_warps=warps, int_types=floats)
    ptx = k.asm["ptx"]
    out.append({"kernel": fn.__name__, "spills": ptxas_spills(ptx), "ptx": ptx_summary(ptx)})
print(json.dumps(out))
"""


def test_kernels_compile_for_sm90_at_the_4b_shape_without_spills(sm90_compile):
    """The GPU path without a GPU: every Mamba kernel compiles for sm_90 at the
    Nemotron-3-Nano-4B layer (96 heads of 80, 8 groups of 128, chunks of 256), the scans on
    tensor cores, nothing spilled."""
    results = sm90_compile(_SM90_SCRIPT, [96, 80, 8, 128, 256])
    assert len(results) == 8
    for r in results:
        assert r["spills"] == 0, r
    assert all(r["ptx"].get("mma.sync") for r in results[:4])
