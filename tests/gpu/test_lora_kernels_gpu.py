"""LoRA shrink/expand on the GPU: bf16 correctness, bitwise repeatability, batch invariance,
CUDA-graph safety of the ordered reduction's self-resetting counters."""

import itertools

import pytest
import torch

from detlora.ops.adapter_groups import group_tokens
from detlora.ops.lora_expand import lora_expand, lora_expand_ref
from detlora.ops.lora_shrink import lora_shrink, lora_shrink_ref
from detlora.ops.lora_workspace import LoRAWorkspace

pytestmark = pytest.mark.gpu

REDUCTIONS = ("atomic", "unsplit", "ordered", "ordered_bi", "tree")
DEV = "cuda"


def _inputs(m, h, r, s, adapters, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, h, device=DEV, generator=g).to(dtype)
    a = (torch.randn(adapters, s, r, h, device=DEV, generator=g) / h**0.5).to(dtype)
    ids = torch.randint(-1, adapters, (m,), device=DEV, generator=g, dtype=torch.int32)
    ids[0] = 0  # at least one row with an adapter
    scale = torch.rand(adapters, device=DEV, generator=g) + 0.5
    return x, a, ids, scale


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("m,h,r,s", [(1, 3072, 16, 3), (3, 1000, 24, 1), (17, 4096, 64, 3),
                                     (130, 2048, 1, 2), (2048, 3072, 128, 1), (4096, 576, 16, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shrink_matches_fp64(reduction, m, h, r, s, dtype):
    x, a, ids, scale = _inputs(m, h, r, s, 4, dtype)
    out = torch.full((s, m, r), float("nan"), device=DEV)
    lora_shrink(x, a, ids, scale, reduction=reduction, out=out)
    ref = lora_shrink_ref(x, a, ids, scale, compute_dtype=torch.float64)
    assert not out.isnan().any()
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5
    assert torch.all(out[:, ids < 0] == 0)


@pytest.mark.parametrize("m,r,offsets", [(1, 16, [0, 3072, 4096, 5120]), (77, 24, [0, 128]),
                                         (1030, 64, [0, 2048, 2560, 3072])])
def test_expand_matches_ref(m, r, offsets):
    s = len(offsets) - 1
    n = offsets[-1]
    g = torch.Generator(device=DEV).manual_seed(1)
    h = torch.randn(s, m, r, device=DEV, generator=g)
    b = (torch.randn(3, n, r, device=DEV, generator=g) / r**0.5).to(torch.bfloat16)
    ids = torch.randint(-1, 3, (m,), device=DEV, generator=g, dtype=torch.int32)
    y = torch.randn(m, n, device=DEV, generator=g).to(torch.bfloat16)
    got = lora_expand(y.clone(), h, b, ids, offsets)
    want = lora_expand_ref(y.clone(), h, b, ids, offsets)
    # The same fp32 sums in another order, then two bf16 roundings (t, then y + t): at most
    # a couple of bf16 ulps apart wherever a rounding boundary falls between the two orders.
    # Measure in ulps of the largest operand: y + t can cancel to near zero.
    size = torch.maximum(torch.maximum(want.float().abs(), y.float().abs()),
                         (want.float() - y.float()).abs())
    ulp = torch.ldexp(torch.ones_like(size), torch.frexp(size.clamp_min(1e-30)).exponent - 8)
    err_ulps = (got.float() - want.float()).abs() / ulp
    worst = int(err_ulps.flatten().argmax())
    assert float(err_ulps.max()) <= 2.0, (
        f"{int((err_ulps > 2).sum())} elements beyond 2 ulps; worst {float(err_ulps.max())} "
        f"at {divmod(worst, n)}: got {got.flatten()[worst]}, want {want.flatten()[worst]}, "
        f"y {y.flatten()[worst]}, ids {ids[worst // n]}")
    oracle = lora_expand_ref(y.double(), h.double(), b.double(), ids, offsets)
    assert float((got.double() - oracle).norm() / oracle.norm()) < 1e-2
    assert torch.equal(got[ids < 0], y[ids < 0])


@pytest.mark.parametrize("reduction", ["unsplit", "ordered", "ordered_bi", "tree"])
@pytest.mark.parametrize("m", [1, 8, 64, 256, 2048])
def test_deterministic_reductions_repeat_bitwise(reduction, m):
    x, a, ids, scale = _inputs(m, 3072, 16, 3, 2, seed=m)
    groups = group_tokens(ids, 2)
    first = lora_shrink(x, a, groups, scale, reduction=reduction)
    for _ in range(100):
        assert torch.equal(lora_shrink(x, a, groups, scale, reduction=reduction), first)


@pytest.mark.parametrize("h,r,s", [(3072, 16, 3), (2048, 64, 1), (4096, 32, 2)])
def test_ordered_bi_rows_do_not_depend_on_batch(h, r, s):
    m_max = 4096
    x, a, ids, scale = _inputs(m_max, h, r, s, 4, seed=h + r)
    alone = [lora_shrink(x[i:i + 1], a, ids[i:i + 1], scale, reduction="ordered_bi")
             for i in range(40)]
    for m in (2, 3, 7, 16, 64, 128, 257, 1024, 4096):
        batch = lora_shrink(x[:m], a, ids[:m], scale, reduction="ordered_bi")
        for i in range(min(m, 40)):
            assert torch.equal(batch[:, i], alone[i][:, 0]), (m, i)


def test_expand_rows_do_not_depend_on_batch():
    g = torch.Generator(device=DEV).manual_seed(3)
    m_max, r, offsets = 4096, 16, [0, 3072, 4096, 5120]
    h = torch.randn(3, m_max, r, device=DEV, generator=g)
    b = (torch.randn(2, 5120, r, device=DEV, generator=g) / 4).to(torch.bfloat16)
    ids = torch.randint(-1, 2, (m_max,), device=DEV, generator=g, dtype=torch.int32)
    y = torch.randn(m_max, 5120, device=DEV, generator=g).to(torch.bfloat16)
    alone = [lora_expand(y[i:i + 1].clone(), h[:, i:i + 1].contiguous(), b, ids[i:i + 1],
                         offsets) for i in range(20)]
    for m in (2, 16, 257, 4096):
        batch = lora_expand(y[:m].clone(), h[:, :m].contiguous(), b, ids[:m], offsets)
        for i in range(min(m, 20)):
            assert torch.equal(batch[i], alone[i][0])


def test_ordered_in_cuda_graph_self_resets():
    x, a, ids, scale = _inputs(64, 3072, 16, 3, 2)
    ws = LoRAWorkspace(DEV)
    groups = group_tokens(ids, 2)
    out = torch.empty(3, 64, 16, device=DEV)
    eager = lora_shrink(x, a, groups, scale, reduction="ordered", workspace=ws).clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        lora_shrink(x, a, groups, scale, reduction="ordered", out=out, workspace=ws)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        lora_shrink(x, a, groups, scale, reduction="ordered", out=out, workspace=ws)
    for _ in range(20):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert int(ws.counters(1).numel()) == 1
    assert int(ws._counters.abs().sum()) == 0  # every counter back at zero


def test_growing_workspace_during_capture_is_refused():
    x, a, ids, scale = _inputs(64, 3072, 16, 3, 2)
    ws = LoRAWorkspace(DEV)
    groups = group_tokens(ids, 2)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="during CUDA-graph capture"), \
            torch.cuda.graph(graph):
        lora_shrink(x, a, groups, scale, reduction="ordered", workspace=ws)


@pytest.mark.parametrize("covers", ["chunk", "group", "all"])
@pytest.mark.parametrize("block_m,block_n,warps", [(16, 16, 4), (64, 16, 4), (128, 64, 8)])
@pytest.mark.parametrize("h", [3072, 1000])
def test_ordered_bi_every_path_matches_single_rows(covers, block_m, block_n, warps, h):
    from detlora.ops.lora_configs import BI_BLOCK_K, BI_GROUP_CHUNKS, ShrinkConfig, ordered_bi_split

    r, s = 16, 3
    x, a, ids, scale = _inputs(2048, h, r, s, 4, seed=5)
    alone = [lora_shrink(x[i:i + 1], a, ids[i:i + 1], scale, reduction="ordered_bi")
             for i in range(24)]
    cfg = ShrinkConfig(ordered_bi_split(h), block_m, block_n, BI_BLOCK_K, warps, 3,
                       BI_GROUP_CHUNKS, covers)
    for m in (5, 300, 2048):
        batch = lora_shrink(x[:m], a, ids[:m], scale, reduction="ordered_bi", config=cfg)
        for i in range(min(m, 24)):
            assert torch.equal(batch[:, i], alone[i][:, 0]), (m, i)


@pytest.mark.parametrize("reduction", ["unsplit", "ordered", "ordered_bi"])
@pytest.mark.parametrize("m", [1, 7, 64, 257, 4096])
@pytest.mark.parametrize("h,offsets", [(3072, [0, 3072, 4096, 5120]), (8192, [0, 3072])])
def test_deferred_shrink_expands_to_the_same_bits(reduction, m, h, offsets):
    """Partials summed in the expand (what the engine runs) equal the shrink's own sum."""
    s, r = len(offsets) - 1, 16
    x, a, ids, scale = _inputs(m, h, r, s, 2, seed=m + h)
    g = torch.Generator(device=DEV).manual_seed(m)
    b = (torch.randn(2, offsets[-1], r, device=DEV, generator=g) / 4).to(torch.bfloat16)
    y = torch.randn(m, offsets[-1], device=DEV, generator=g).to(torch.bfloat16)
    groups = group_tokens(ids, 2)
    reduced = lora_shrink(x, a, groups, scale, reduction=reduction)
    want = lora_expand(y.clone(), reduced, b, groups, offsets)
    for _ in range(3):
        sp = lora_shrink(x, a, groups, scale, reduction=reduction, defer=True)
        assert torch.equal(lora_expand(y.clone(), sp, b, groups, offsets), want)


@pytest.mark.parametrize("m", [1, 16, 64, 257, 4096])
@pytest.mark.parametrize("in_gemm", [False, True])
def test_expand_fused_into_silu_and_mul_has_the_unfused_bits(m, in_gemm):
    """The MLP's fused gate|up expand + SwiGLU equals the expand kernel then the silu_and_mul
    kernel, bit for bit (Llama-3.2-3B widths, bf16), and a row's bits do not depend on M."""
    from detlora.ops.lora_expand_silu_and_mul import lora_expand_silu_and_mul
    from detlora.ops.lora_partials import ShrinkPartials
    from detlora.ops.silu_and_mul import silu_and_mul

    inter, r, slots = 8192, 16, 4
    x, a, ids, scale = _inputs(m, 3072, r, 2, slots, seed=m)
    g = torch.Generator(device=DEV).manual_seed(m + 1)
    b = (torch.randn(slots, 2 * inter, r, device=DEV, generator=g) / 4).to(torch.bfloat16)
    y_cat = torch.randn(m, 2 * inter + slots * 2 * r, device=DEV, generator=g).to(torch.bfloat16)
    y = y_cat[:, :2 * inter]
    if in_gemm:
        h = ShrinkPartials(y_cat[:, 2 * inter:].unsqueeze(0), 2, r, tail_group=1, scale=scale,
                           adapter_stride=2 * r)
    else:
        h = lora_shrink(x, a, ids, scale, reduction="ordered")
    groups = group_tokens(ids, slots)
    got = lora_expand_silu_and_mul(y, h, b, groups)
    assert torch.equal(got, silu_and_mul(lora_expand(y.clone(), h, b, groups)))
    if in_gemm:  # row 0 alone (its own columns of y_cat) against row 0 inside M rows
        h0 = ShrinkPartials(y_cat[:1, 2 * inter:].unsqueeze(0), 2, r, tail_group=1, scale=scale,
                            adapter_stride=2 * r)
        alone = lora_expand_silu_and_mul(y[:1], h0, b, group_tokens(ids[:1], slots))
        assert torch.equal(alone[0], got[0])


@pytest.mark.parametrize("m", [1, 16, 64, 257, 4096])
@pytest.mark.parametrize("in_gemm", [False, True])
@pytest.mark.parametrize("rank", [16, 64])
def test_expand_fused_into_rotary_write_kv_has_the_unfused_bits(m, in_gemm, rank):
    """Attention's fused q|k|v expand + rotary + KV write equals the expand kernel then
    rotary_write_kv (q, k pages, v pages), bit for bit (Llama-3.2-3B widths, bf16, padding
    slots), and a row's bits do not depend on M."""
    from detlora.ops.lora_expand_rotary_write_kv import lora_expand_rotary_write_kv
    from detlora.ops.lora_partials import ShrinkPartials
    from detlora.ops.rotary import rope_cos_sin_cache
    from detlora.ops.rotary_write_kv import rotary_write_kv

    hq, hk, d, slots = 24, 8, 128, 4
    offsets = [0, hq * d, (hq + hk) * d, (hq + 2 * hk) * d]
    n = offsets[-1]
    x, a, ids, scale = _inputs(m, 3072, rank, 3, slots, seed=m + rank)
    g = torch.Generator(device=DEV).manual_seed(m + 1)
    b = (torch.randn(slots, n, rank, device=DEV, generator=g) / 4).to(torch.bfloat16)
    y_cat = torch.randn(m, n + slots * 3 * rank, device=DEV, generator=g).to(torch.bfloat16)
    y = y_cat[:, :n]
    if in_gemm:
        h = ShrinkPartials(y_cat[:, n:].unsqueeze(0), 3, rank, tail_group=1, scale=scale,
                           adapter_stride=3 * rank)
    else:
        h = lora_shrink(x, a, ids, scale, reduction="ordered")
    groups = group_tokens(ids, slots)
    cos_sin = rope_cos_sin_cache(d, 8192, 500000.0).to(DEV)
    pos = torch.randint(0, 8192, (m,), device=DEV, generator=g)
    pages = m // 16 + 4
    slot_mapping = torch.randperm(pages * 16, device=DEV, generator=g)[:m]
    slot_mapping[1::5] = -1
    cache = torch.randn(2, pages, 16, hk, d, device=DEV, generator=g).to(torch.bfloat16)
    y2 = lora_expand(y.clone(), h, b, groups, offsets)
    q, k, v = (y2[:, lo:hi].view(m, -1, d) for lo, hi in itertools.pairwise(offsets))
    want_kc, want_vc = cache[0].clone(), cache[1].clone()
    want_q = rotary_write_kv(q, k, v, pos, cos_sin, want_kc, want_vc, slot_mapping)
    kc, vc = cache[0].clone(), cache[1].clone()
    got_q = lora_expand_rotary_write_kv(y, h, b, groups, offsets, pos, cos_sin, kc, vc,
                                        slot_mapping)
    assert torch.equal(got_q, want_q)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    if in_gemm:  # row 0 alone (its own columns of y_cat) against row 0 inside M rows
        h0 = ShrinkPartials(y_cat[:1, n:].unsqueeze(0), 3, rank, tail_group=1, scale=scale,
                            adapter_stride=3 * rank)
        alone = lora_expand_rotary_write_kv(y[:1], h0, b, group_tokens(ids[:1], slots),
                                            offsets, pos[:1], cos_sin, cache[0].clone(),
                                            cache[1].clone(), slot_mapping[:1])
        assert torch.equal(alone[0], got_q[0])


@pytest.mark.parametrize("m", [1, 16, 64, 257, 4096])
@pytest.mark.parametrize("hidden", [3072, 1024])
@pytest.mark.parametrize("in_gemm", [False, True])
def test_expand_fused_into_add_rms_norm(m, hidden, in_gemm):
    """o/down's expand inside the residual add + RMSNorm (bf16): close to the reference; rows
    without adapter bit-equal to fused_add_rms_norm; a row's bits independent of M."""
    from detlora.ops.lora_expand_add_rms_norm import (
        lora_expand_add_rms_norm,
        lora_expand_add_rms_norm_ref,
    )
    from detlora.ops.lora_partials import ShrinkPartials, reduce_partials_ref
    from detlora.ops.rms_norm import fused_add_rms_norm

    r, slots = 16, 4
    x_in, a, ids, scale = _inputs(m, 2048, r, 1, slots, seed=m + hidden)
    g = torch.Generator(device=DEV).manual_seed(m)
    b = (torch.randn(slots, hidden, r, device=DEV, generator=g) / 4).to(torch.bfloat16)
    y_cat = torch.randn(m, hidden + slots * r, device=DEV, generator=g).to(torch.bfloat16)
    x = y_cat[:, :hidden]  # the engine's strided in_gemm view
    res = torch.randn(m, hidden, device=DEV, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, device=DEV, generator=g)).to(torch.bfloat16)
    if in_gemm:
        h = ShrinkPartials(y_cat[:, hidden:].unsqueeze(0), 1, r, tail_group=1, scale=scale,
                           adapter_stride=r)
    else:
        h = lora_shrink(x_in, a, ids, scale, reduction="ordered")
    groups = group_tokens(ids, slots)
    y, new_res = lora_expand_add_rms_norm(x, res, w, 1e-5, h, b, groups)
    h_ref = reduce_partials_ref(h, ids) if in_gemm else h
    want_y, want_res = lora_expand_add_rms_norm_ref(x.double(), res.double(), w.double(), 1e-5,
                                                    h_ref.double(), b.double(), ids)
    assert float((y.double() - want_y).norm() / want_y.norm()) < 1e-2
    assert float((new_res.double() - want_res).norm() / want_res.norm()) < 1e-2
    plain_y, plain_res = fused_add_rms_norm(x, res, w, 1e-5)
    base = ids < 0
    assert torch.equal(y[base], plain_y[base]) and torch.equal(new_res[base], plain_res[base])
    for i in {0, m // 2, m - 1}:
        hi = (ShrinkPartials(y_cat[i:i + 1, hidden:].unsqueeze(0), 1, r, tail_group=1,
                             scale=scale, adapter_stride=r)
              if in_gemm else h[:, i:i + 1].contiguous())
        ya, ra = lora_expand_add_rms_norm(x[i:i + 1], res[i:i + 1], w, 1e-5, hi, b,
                                          group_tokens(ids[i:i + 1], slots))
        assert torch.equal(ya[0], y[i]) and torch.equal(ra[0], new_res[i])


@pytest.mark.parametrize("m", [1, 16, 64, 257])
def test_slot_ranks_give_the_unfused_bits_and_rows_alone(m):
    """Slots of rank 8, 16, 40 and 64 below a full rank of 64, and untargeted slices (rank 0,
    garbage in their columns), in bf16 with in_gemm's partials: the SwiGLU and q|k|v kernels
    with slot ranks give the bits of the expand with the same ranks followed by the plain
    op, close to the float reference; rows of a rank-0 slice stay untouched; row 0 has the
    same bits alone as in the batch."""
    from detlora.ops.lora_expand_rotary_write_kv import lora_expand_rotary_write_kv
    from detlora.ops.lora_expand_silu_and_mul import lora_expand_silu_and_mul
    from detlora.ops.lora_partials import ShrinkPartials
    from detlora.ops.rotary import rope_cos_sin_cache
    from detlora.ops.rotary_write_kv import rotary_write_kv
    from detlora.ops.silu_and_mul import silu_and_mul

    full, slots, d = 64, 4, 128
    g = torch.Generator(device=DEV).manual_seed(m)
    ids = torch.randint(-1, slots, (m,), device=DEV, generator=g, dtype=torch.int32)
    ids[: min(m, slots)] = torch.arange(min(m, slots), device=DEV, dtype=torch.int32)
    groups = group_tokens(ids, slots)
    scale = torch.rand(slots, device=DEV, generator=g) + 0.5

    def slot_data(n, offsets, ranks):
        """y [m, n], in_gemm partials and B, zero past each slot's rank per slice."""
        slices = len(offsets) - 1
        b = (torch.randn(slots, n, full, device=DEV, generator=g) / 4).to(torch.bfloat16)
        y_cat = torch.randn(m, n + slots * slices * full, device=DEV,
                            generator=g).to(torch.bfloat16)
        cols = y_cat[:, n:].view(m, slots, slices, full)
        for a in range(slots):
            for s in range(slices):
                r = int(ranks[a, s])
                if r:  # a rank-0 slice keeps its garbage: it must not be read
                    cols[:, a, s, r:] = 0
                    b[a, offsets[s]:offsets[s + 1], r:] = 0
        def partials(rows):
            return ShrinkPartials(y_cat[rows, n:].unsqueeze(0), slices, full, tail_group=1,
                                  scale=scale, adapter_stride=slices * full)
        return y_cat[:, :n], partials, b

    ranks2 = torch.tensor([[8, 0], [16, 16], [40, 64], [0, 8]], dtype=torch.int32, device=DEV)
    inter = 8192
    y, partials, b = slot_data(2 * inter, [0, inter, 2 * inter], ranks2)
    h = partials(slice(None))
    got = lora_expand_silu_and_mul(y, h, b, groups, slot_ranks=ranks2)
    expanded = lora_expand(y.clone(), h, b, groups, slot_ranks=ranks2)
    assert torch.equal(got, silu_and_mul(expanded))
    assert torch.equal(expanded[ids == 0, inter:], y[ids == 0, inter:])  # rank 0: untouched
    want = lora_expand_ref(y.clone(), h, b, ids, None, ranks2)
    assert float((expanded.float() - want.float()).norm() / want.float().norm()) < 1e-2
    alone = lora_expand_silu_and_mul(y[:1], partials(slice(0, 1)), b,
                                     group_tokens(ids[:1], slots), slot_ranks=ranks2)
    assert torch.equal(alone[0], got[0])

    ranks3 = torch.tensor([[8, 0, 8], [16, 16, 16], [64, 0, 40], [0, 0, 0]], dtype=torch.int32,
                          device=DEV)
    offsets = [0, 24 * d, 32 * d, 40 * d]
    y, partials, b = slot_data(40 * d, offsets, ranks3)
    h = partials(slice(None))
    cos_sin = rope_cos_sin_cache(d, 8192, 500000.0).to(DEV)
    pos = torch.randint(0, 8192, (m,), device=DEV, generator=g)
    pages = m // 16 + 4
    slot_mapping = torch.randperm(pages * 16, device=DEV, generator=g)[:m]
    cache = torch.randn(2, pages, 16, 8, d, device=DEV, generator=g).to(torch.bfloat16)
    kc, vc = cache[0].clone(), cache[1].clone()
    got_q = lora_expand_rotary_write_kv(y, h, b, groups, offsets, pos, cos_sin, kc, vc,
                                        slot_mapping, slot_ranks=ranks3)
    y2 = lora_expand(y.clone(), h, b, groups, offsets, slot_ranks=ranks3)
    q, k, v = (y2[:, lo:hi].view(m, -1, d) for lo, hi in itertools.pairwise(offsets))
    want_kc, want_vc = cache[0].clone(), cache[1].clone()
    want_q = rotary_write_kv(q, k, v, pos, cos_sin, want_kc, want_vc, slot_mapping)
    assert torch.equal(got_q, want_q)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    alone = lora_expand_rotary_write_kv(y[:1], partials(slice(0, 1)), b,
                                        group_tokens(ids[:1], slots), offsets, pos[:1],
                                        cos_sin, cache[0].clone(), cache[1].clone(),
                                        slot_mapping[:1], slot_ranks=ranks3)
    assert torch.equal(alone[0], got_q[0])
