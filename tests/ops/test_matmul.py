"""Batch-invariant matmul, linear and bmm in Triton's interpreter (fp16 and fp32; the
interpreter computes bf16 dots wrongly, so bf16 is proven in tests/gpu): float64 oracle,
poisoned outputs, rows bitwise equal across M, across the split and persistent paths and across
TMA and pointer loads, self-resetting counters, bad inputs."""

import pytest
import torch

from detlora.ops import matmul as mm
from detlora.ops.matmul_workspace import MatmulWorkspace

DTYPES = [torch.float16, torch.float32]
TOL = {torch.float16: 2e-3, torch.float32: 1e-5}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def _inputs(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return x, w, bias


def _cfg(k, dtype, chunks, split, bm=16, bn=16, tma=True, flatten=True, in_cta=False):
    """Small tiles and BLOCK_K 16, so the interpreter walks several tiles and chunks."""
    return mm.MatmulConfig(mm.KSplit.for_chunks(k, 16, chunks), bm, bn, split_ctas=split,
                           tma=tma, flatten=flatten, chunks_in_cta=in_cta)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 37, 70), (3, 100, 129), (17, 48, 200), (130, 40, 72)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_fp64(m, n, k, dtype, with_bias):
    x, w, bias = _inputs(m, n, k, dtype, seed=m * 100 + n + k)
    bias = bias if with_bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype)
    got = mm.linear(x, w, bias, out=out)
    assert got is out
    assert not out.isnan().any()
    want = x.double() @ w.double().T + (bias.double() if with_bias else 0)
    assert _rel(out, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 37, 70), (17, 48, 200)])
def test_matmul_and_bmm_match_fp64(m, n, k, dtype):
    g = torch.Generator().manual_seed(m + n)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)  # [K, N], N contiguous
    out = torch.full((m, n), float("nan"), dtype=dtype)
    assert mm.matmul(a, b, out=out) is out
    assert not out.isnan().any()
    assert _rel(out, a.double() @ b.double()) < TOL[dtype]
    ab = torch.randn(3, m, k, generator=g).to(dtype)
    bb = torch.randn(3, k, n, generator=g).to(dtype)
    got = mm.bmm(ab, bb)
    assert _rel(got, ab.double() @ bb.double()) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("tma", [True, False])
def test_forced_paths_match_fp64(dtype, split, tma):
    # K = 72: TMA-eligible rows; K = 70 (fp16: 140-byte rows) falls back to pointer loads.
    for k in (72, 70):
        x, w, bias = _inputs(19, 40, k, dtype, seed=k)
        out = torch.full((19, 40), float("nan"), dtype=dtype)
        mm.linear(x, w, bias, out=out, config=_cfg(k, dtype, 3, split, tma=tma),
                  workspace=MatmulWorkspace("cpu"))
        assert not out.isnan().any()
        assert _rel(out, x.double() @ w.double().T + bias.double()) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_bitwise_equal_across_m(dtype):
    n, k = 40, 520
    x, w, bias = _inputs(130, n, k, dtype, seed=5)
    lin = lambda rows: mm.linear(rows, w, bias, out=torch.empty(rows.shape[0], n))  # fp32 out
    alone = [lin(x[i:i + 1]) for i in range(3)]
    for m in (2, 3, 17, 130):
        batch = lin(x[:m])
        for i in range(min(m, 3)):
            assert torch.equal(batch[i], alone[i][0]), (m, i)
    # The default configs above differ in tile and path but share one split of K in chunks.
    assert mm.k_split(n, k, dtype).num_chunks > 1
    assert len({mm.matmul_config(m, n, k, dtype, 1, 4).split_ctas for m in (1, 130)}) == 2


def _linear32(x, w, bias, cfg, ws):
    """The fp32 sum before rounding: far more sensitive to the order than fp16 output."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    return mm.linear(x, w, bias, out=out, config=cfg, workspace=ws)


@pytest.mark.parametrize("dtype", DTYPES)
# 5 chunks of 2 blocks: the split path's fold takes two rounds of four partials.
@pytest.mark.parametrize("chunks,k", [(3, 72), (5, 160)])
def test_rows_bitwise_equal_across_paths_and_tiles(dtype, chunks, k):
    x, w, bias = _inputs(33, 24, k, dtype, seed=9)
    ws = MatmulWorkspace("cpu")
    ref = _linear32(x, w, bias, _cfg(k, dtype, chunks, True), ws)
    assert torch.equal(mm.linear(x, w, bias, config=_cfg(k, dtype, chunks, True), workspace=ws),
                       ref.to(dtype))  # one rounding of the same fp32 sum
    variants = [
        _cfg(k, dtype, chunks, False),  # persistent, chunks summed in one CTA
        _cfg(k, dtype, chunks, True, tma=False),  # pointer loads
        _cfg(k, dtype, chunks, False, tma=False),
        _cfg(k, dtype, chunks, False, flatten=False),
        _cfg(k, dtype, chunks, True, bm=32, bn=32),
        _cfg(k, dtype, chunks, False, bm=64, bn=32),
        _cfg(k, dtype, chunks, True, in_cta=True),  # one CTA per tile walks the chunks
        _cfg(k, dtype, chunks, True, tma=False, in_cta=True),
        _cfg(k, dtype, chunks, True, bm=32, bn=32, in_cta=True),
    ]
    for cfg in variants:
        assert torch.equal(_linear32(x, w, bias, cfg, ws), ref), cfg
        assert torch.equal(_linear32(x[:1], w, bias, cfg, ws), ref[:1]), cfg
    # A different split is a different sum, so the fp32 bits move: the check above can fail.
    other = _linear32(x, w, bias, _cfg(k, dtype, 1, True), ws)
    assert not torch.equal(other, ref)
    assert _rel(other, x.double() @ w.double().T + bias.double()) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_equals_matmul_bitwise(dtype):
    x, w, _ = _inputs(5, 24, 72, dtype, seed=3)
    y = mm.linear(x, w)
    assert torch.equal(y, mm.matmul(x, w.t()))  # weight layout, K contiguous
    assert torch.equal(y, mm.matmul(x, w.t().contiguous()))  # [K, N], N contiguous


def test_bmm_rows_do_not_depend_on_batch():
    g = torch.Generator().manual_seed(11)
    a = torch.randn(4, 9, 48, generator=g).to(torch.float16)
    b = torch.randn(4, 48, 20, generator=g).to(torch.float16)
    full = mm.bmm(a, b)
    for i in range(4):
        assert torch.equal(mm.bmm(a[i:i + 1], b[i:i + 1])[0], full[i])
        assert torch.equal(mm.bmm(a[i:i + 1, :1], b[i:i + 1])[0, 0], full[i, 0])
        assert torch.equal(mm.matmul(a[i], b[i]), full[i])


@pytest.mark.parametrize("shape", [(24,), (1, 24), (7, 1), (7, 24)])
def test_add_bias_mm_broadcasts_bias(shape):
    g = torch.Generator().manual_seed(2)
    a = torch.randn(7, 40, generator=g)
    b = torch.randn(40, 24, generator=g)
    bias = torch.randn(shape, generator=g)
    got = mm.add_bias_mm(bias, a, b)
    want = bias.double() + a.double() @ b.double()
    assert _rel(got, want) < TOL[torch.float32]
    if shape == (24,):
        assert torch.equal(got, mm.linear(a, b.t().contiguous(), bias))


def test_split_path_counters_reset_and_repeat_bitwise():
    ws = MatmulWorkspace("cpu")
    x, w, bias = _inputs(20, 40, 72, torch.float16, seed=4)
    cfg = _cfg(72, torch.float16, 3, True)
    first = mm.linear(x, w, bias, config=cfg, workspace=ws)
    assert ws.counter_capacity > 0
    assert torch.count_nonzero(ws.counters(ws.counter_capacity)) == 0
    for _ in range(3):
        assert torch.equal(mm.linear(x, w, bias, config=cfg, workspace=ws), first)
    assert torch.count_nonzero(ws.counters(ws.counter_capacity)) == 0


def test_reserve_workspace_allocates_what_a_call_needs():
    ws = MatmulWorkspace("cpu")
    cfg = _cfg(72, torch.float16, 3, True)
    mm.reserve_workspace(20, 40, 72, torch.float16, workspace=ws, config=cfg)
    scratch, counters = ws.scratch_capacity, ws.counter_capacity
    assert scratch >= 2 * 3 * 3 * 16 * 16 and counters >= 6
    x, w, _ = _inputs(20, 40, 72, torch.float16, seed=6)
    mm.linear(x, w, config=cfg, workspace=ws)
    assert (ws.scratch_capacity, ws.counter_capacity) == (scratch, counters)


@pytest.mark.parametrize("n,k", [(3072, 3072), (5120, 3072), (3072, 8192), (128256, 3072),
                                 (1024, 1024), (1024, 3072), (37, 70)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_is_a_function_of_n_and_k_only(n, k, dtype):
    splits = {mm.matmul_config(m, n, k, dtype, batch).k_split
              for m in (1, 2, 7, 16, 64, 65, 257, 1024, 4096) for batch in (1, 3)}
    assert splits == {mm.k_split(n, k, dtype)}
    ks = mm.k_split(n, k, dtype)
    assert ks.fits(k)
    assert (ks.num_chunks - 1) * ks.chunk_blocks < -(-k // ks.block_k)  # every chunk has work


def test_two_part_tiles_are_picked_only_where_they_fill_one_wave():
    # Llama o_proj at 1024 rows: 128x256 tiles fill 96 of 132 SMs; 128 x (128 + 64) fill 128.
    cfg = mm.matmul_config(1024, 3072, 3072, num_sms=132)
    assert (cfg.split_ctas, cfg.block_m, cfg.block_n, cfg.block_n2) == (True, 128, 128, 64)
    qkv = mm.matmul_config(1024, 5120, 3072, num_sms=132)  # 128 x (256 + 64): 128 tiles
    assert (qkv.block_n, qkv.block_n2) == (256, 64)
    for m, n, k in ((4096, 3072, 3072), (256, 5120, 3072), (64, 3072, 3072),
                    (1024, 512, 4096)):  # many waves, too few tiles, decode, S > 1
        assert mm.matmul_config(m, n, k, num_sms=132).block_n2 == 0, (m, n, k)
    assert mm.matmul_config(1024, 3072, 3072, batch=2, num_sms=132).block_n2 == 0  # bmm


def test_narrow_outputs_split_k_and_wide_ones_do_not():
    # bf16/fp16: 64 decode tiles of 16 columns (N >= 1024) need no split.
    assert mm.k_split(512, 4096).num_chunks > 1
    assert mm.k_split(1000, 1001).num_chunks > 1
    for n, k in ((1024, 1024), (3072, 3072), (3072, 8192), (16384, 3072), (128256, 3072)):
        assert mm.k_split(n, k).num_chunks == 1, (n, k)
        assert mm.k_split(n, k, torch.float16).num_chunks == 1, (n, k)
    # fp32 (FMA dots, 64-wide tiles) keeps the split below N = 4096.
    assert mm.k_split(3072, 3072, torch.float32).num_chunks > 1
    assert mm.k_split(16384, 3072, torch.float32).num_chunks == 1


def test_decode_configs_load_wide_k_blocks_that_divide_k_and_the_chunks():
    cfg = mm.matmul_config(1, 3072, 3072)
    assert (cfg.block_n, cfg.block_k, cfg.split_ctas) == (32, 256, True)
    assert mm.matmul_config(64, 5120, 3072).block_k == 128
    narrow = mm.matmul_config(1, 512, 4096)  # 8 chunks of 512: 256-wide loads fit
    assert narrow.k_split.num_chunks > 1 and narrow.block_k == 256
    assert mm.matmul_config(1, 1000, 1001).block_k == 64  # K not a multiple of 128
    assert mm.matmul_config(4096, 3072, 3072).block_k == 64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [True, False])
def test_wide_loads_match_fp64(dtype, split):
    # KSplit blocks of 16 loaded 32 or 64 at a time, 2 chunks of 64: same sum, other tiling.
    k = 128
    x, w, bias = _inputs(19, 40, k, dtype, seed=3)
    want = x.double() @ w.double().T + bias.double()
    for load_k in (32, 64):
        cfg = mm.MatmulConfig(mm.KSplit.for_chunks(k, 16, 2), 16, 16, split_ctas=split,
                              load_k=load_k)
        out = torch.full((19, 40), float("nan"), dtype=dtype)
        mm.linear(x, w, bias, out=out, config=cfg, workspace=MatmulWorkspace("cpu"))
        assert not out.isnan().any()
        assert _rel(out, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tma", [True, False])
def test_two_part_tiles_match_fp64_and_give_the_one_part_bits(dtype, tma):
    """16 + 32, 32 + 16 and 64 + 64 column tiles: two dots side by side; N = 100 is not a
    multiple of a tile, so the last tile's second part lies partly or wholly past N."""
    n, k = 100, 72
    x, w, bias = _inputs(37, n, k, dtype, seed=21)
    ws = MatmulWorkspace("cpu")
    ks = mm.KSplit.for_chunks(k, 16, 1)
    plain = mm.MatmulConfig(ks, 16, 16)
    ref = _linear32(x, w, bias, plain, ws)
    assert _rel(ref, x.double() @ w.double().T + bias.double()) < 1e-5
    wt = w.t().contiguous()  # [K, N]: B boxes of [BLOCK_K, width]
    for bm, bn, bn2 in ((16, 16, 32), (32, 32, 16), (16, 64, 64)):
        cfg = mm.MatmulConfig(ks, bm, bn, block_n2=bn2, tma=tma)
        got = torch.full_like(ref, float("nan"))
        mm.linear(x, w, bias, out=got, config=cfg, workspace=ws)
        assert torch.equal(got, ref), cfg
        assert torch.equal(mm.linear(x, w, bias, config=cfg, workspace=ws), ref.to(dtype)), cfg
        assert torch.equal(mm.matmul(x, wt, config=cfg, workspace=ws),
                           mm.matmul(x, wt, config=plain, workspace=ws)), cfg


def _bad_calls():
    f16 = torch.float16
    a = torch.randn(4, 8).to(f16)
    b = torch.randn(8, 6).to(f16)
    w = torch.randn(6, 8).to(f16)
    return [
        (lambda: mm.matmul(a[None], b), "a must have 2 dimensions"),
        (lambda: mm.matmul(a.to(torch.int32), b), "a must have dtype"),
        (lambda: mm.matmul(a, b.float()), "b dtype"),
        (lambda: mm.matmul(a, b[:7]), "b shape"),
        (lambda: mm.matmul(a, b, out=torch.empty(4, 5, dtype=f16)), "out must have shape"),
        (lambda: mm.matmul(a, b, out=torch.empty(4, 6, dtype=torch.float64)),
         "out must have dtype"),
        (lambda: mm.matmul(a[:0], b), "empty"),
        (lambda: mm.linear(a, w[:, :7]), "weight shape"),
        (lambda: mm.linear(a, "w"), "weight must be a torch.Tensor"),
        (lambda: mm.linear(a, w, torch.randn(5).to(f16)), "bias must have shape"),
        (lambda: mm.linear(a, w, torch.randn(6)), "bias must have dtype"),
        (lambda: mm.bmm(a[None], b[None].expand(2, 8, 6)), "b has batch"),
        (lambda: mm.add_bias_mm(torch.randn(3).to(f16), a, b), "bias of shape"),
        (lambda: mm.matmul(a, b, config="fast"), "config must be a MatmulConfig"),
        (lambda: mm.matmul(a, b, config=_cfg(64, f16, 2, True)), "config.k_split"),
        (lambda: mm.matmul(a, b, config=mm.MatmulConfig(mm.KSplit.for_chunks(8, 16, 1), 24, 16)),
         "config.block_m"),
        (lambda: mm.matmul(a, b, config=mm.MatmulConfig(mm.KSplit.for_chunks(8, 16, 1), 16, 16,
                                                        load_k=24)), "config.load_k"),
        (lambda: mm.matmul(a, b, config=mm.MatmulConfig(mm.KSplit.for_chunks(8, 16, 1), 16, 16,
                                                        load_k=32)), "must divide K = 8"),
        (lambda: mm.matmul(a, b, config=mm.MatmulConfig(mm.KSplit.for_chunks(8, 16, 1), 16, 16,
                                                        block_n2=24)), "config.block_n2"),
        (lambda: mm.matmul(a, b, config=mm.MatmulConfig(mm.KSplit.for_chunks(8, 16, 1), 16, 16,
                                                        block_n2=16, split_ctas=False)),
         "block_n2 needs split_ctas"),
        (lambda: mm.matmul(a, b, config=mm.MatmulConfig(mm.KSplit.for_chunks(8, 16, 1), 16, 16,
                                                        split_ctas=False, chunks_in_cta=True)),
         "chunks_in_cta needs split_ctas"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_inputs_raise_value_error_naming_the_argument(case):
    call, message = _bad_calls()[case]
    with pytest.raises(ValueError, match=message):
        call()


_SM90_SCRIPT = r"""
import json, sys
from compile_sm90 import compile_kernel, ptx_summary, ptxas_spills
from detlora.ops import matmul as mm

out = []
for m, n, k, *extra in json.loads(sys.argv[1]):
    skip = bool(extra and extra[0])
    groups = extra[1] if len(extra) > 1 else 0
    cfg = mm.matmul_config(m, n, k, split=mm.KSplit.equal_groups(k, groups) if groups else None)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, MULTI_CHUNK=cfg.k_split.num_chunks > 1,
                  TMA=True, B_KMAJOR=True, EVEN_K=True, BIAS=1, INPUT_PRECISION=None,
                  stride_ak=1, stride_bk=1, stride_cn=1, stride_biasn=1)
    if not cfg.split_ctas:
        consts.update(GROUP_M=cfg.group_m, FLATTEN=cfg.flatten)
    else:
        consts.update(BLOCK_N2=cfg.block_n2, SLOT_SKIP=skip, GROUPS_P2=64 if skip else 2,
                      CHUNKS_IN_CTA=cfg.chunks_in_cta)
    fn = mm._mm_split_kernel if cfg.split_ctas else mm._mm_persistent_kernel
    types = {"a": f"tensordesc<bf16[{bm}, {bk}]>", "b": f"tensordesc<bf16[{bn}, {bk}]>",
             "b2": f"tensordesc<bf16[{cfg.block_n2 or bn}, {bk}]>"}
    ptrs = {"scratch_ptr": "*fp32", "counter_ptr": "*i32", "group_adapter_ptr": "*i32",
            "group_size_ptr": "*i32"}
    kernel, _ = compile_kernel(fn, consts, ptrs, num_warps=cfg.num_warps,
                               num_stages=cfg.num_stages, int_types=types,
                               div16=("K", "N", "stride_am", "stride_bn", "stride_cm",
                                      "stride_ab", "stride_bb", "stride_cb"))
    ptx = kernel.asm["ptx"]
    spills = ptxas_spills(ptx)
    out.append({"shape": [m, n, k], "block_m": bm, "block_n2": cfg.block_n2,
                "split": cfg.split_ctas,
                "multi": cfg.k_split.num_chunks > 1, "in_cta": cfg.chunks_in_cta,
                "ptx": ptx_summary(ptx),
                "spills": spills, "smem": kernel.metadata.shared})
print(json.dumps(out))
"""


def test_default_configs_compile_for_sm90_with_wgmma_tma_and_no_spills(sm90_compile):
    """The GPU path, checked without a GPU: Triton compiles the kernels for sm_90 (H100/H200)."""
    # Decode of a narrow output (split over CTAs, ordered reduce, 256-wide loads), its
    # prefill (S > 1: 128x128, two accumulators), decode of o_proj (S = 1, 256-wide loads)
    # prefill of qkv (S = 1: 128x256) and batch-64 decode of qkv (6 stages of 64x128 + 64x128).
    # A 1024-row o_proj call runs a two-part tile (128 x (128 + 64), one CTA each).
    # The in_gemm qkv of Llama-3.1-8B with 64 rank-16 slots, skipping unused slots' tiles, at
    # batch 1 and 64.
    # The 8-group K tree of Llama-3.2-3B's o (batch 64) and down (batch 1) walks its groups in
    # one CTA per tile.
    shapes = [[1, 512, 4096], [4096, 512, 4096], [1, 3072, 3072], [4096, 5120, 3072],
              [64, 5120, 3072], [1024, 3072, 3072], [1, 9216, 4096, True],
              [64, 9216, 4096, True], [64, 3072, 3072, False, 8], [1, 3072, 8192, False, 8]]
    (decode, prefill_multi, decode_single, prefill_single, decode_wide, two_part, skip_1,
     skip_64, groups_64, groups_1) = sm90_compile(_SM90_SCRIPT, shapes)
    for r in (groups_64, groups_1):
        assert r["split"] and r["multi"] and r["in_cta"], r
        assert r["ptx"].get("atom.global.gpu.acq_rel.add.u32", 0) == 0, r  # no cross-CTA sum
    for r in (decode, prefill_multi, decode_single, prefill_single, decode_wide, two_part,
              skip_1, skip_64, groups_64, groups_1):
        assert r["spills"] == 0, r
        assert r["ptx"].get("cp.async.bulk", 0) > 0, r  # TMA loads
        assert r["smem"] <= 227 * 1024, r
    assert decode["split"] and decode["multi"] and decode["ptx"].get("mma.sync", 0) > 0
    assert decode["ptx"].get("atom.global.gpu.acq_rel.add.u32", 0) == 1
    assert decode["ptx"].get("ld.global.cg", 0) > 0  # the last CTA reads partials from L2
    for r in (prefill_multi, prefill_single):
        assert not r["split"] and r["ptx"].get("wgmma.mma_async", 0) > 0, r
    assert prefill_single["block_m"] * 256 == 128 * 256 and not prefill_single["multi"]
    assert two_part["split"] and two_part["block_n2"] == 64 and not two_part["multi"]
    assert two_part["ptx"].get("wgmma.mma_async", 0) > 0


def test_outgrown_workspace_buffers_stay_alive():
    """A graph captured before a workspace grows keeps pointing at the old buffers: growing
    must not free them (they would be handed out again while the graph still writes them)."""
    import gc
    import weakref

    ws = MatmulWorkspace("cpu")
    old_scratch, old_counters = ws.scratch(100), ws.counters(10)
    refs = [weakref.ref(old_scratch._base), weakref.ref(old_counters._base)]
    del old_scratch, old_counters
    ws.scratch(ws.scratch_capacity + 1)
    ws.counters(ws.counter_capacity + 1)
    gc.collect()
    assert all(r() is not None for r in refs)
    assert len(ws.retired) == 2
    ws.scratch(10)  # no growth, nothing retired
    assert len(ws.retired) == 2
