"""Batch-invariant matmul on the GPU: bf16/fp16/fp32 correctness, rows bitwise equal across M
and across every path, tile, load style and B layout, repeatability, CUDA graphs, and the
torch.library mode (routing bit for bit, nesting, a Hugging Face Llama forward)."""

import pytest
import torch
import torch.nn.functional as F

from benchmarks.suites.matmul import path_variants
from detlora.batch_invariant import (
    batch_invariant,
    disable_batch_invariant_mode,
    is_batch_invariant_mode_enabled,
)
from detlora.ops import matmul as mm
from detlora.ops.matmul_workspace import MatmulWorkspace

pytestmark = pytest.mark.gpu

DEV = "cuda"
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
M_VALUES = (2, 3, 7, 16, 64, 128, 257, 1024, 4096)
# (N, K) of Llama-3.2-3B (qkv fused, o, gate_up fused, down, lm_head) and Qwen3-0.6B
# (q, k/v, qkv fused, o, gate_up fused, down, lm_head).
SHAPES = [(5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192), (128256, 3072),
          (2048, 1024), (1024, 1024), (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
          (151936, 1024)]
ROWS = 8


def _rel(got, want):
    return float((got.double() - want).norm() / want.norm())


def _weights(n, k, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = (torch.randn(n, k, device=DEV, generator=g) / k**0.5).to(dtype)
    bias = torch.randn(n, device=DEV, generator=g).to(dtype)
    return w, bias


def _x(m, k, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(m, k, device=DEV, generator=g).to(dtype)


def _lin32(x, w, bias=None, config=None):
    """fp32 output: the unrounded sum, the most sensitive witness of the reduction order."""
    out = torch.empty(x.shape[0], w.shape[0], device=DEV)
    return mm.linear(x, w, bias, out=out, config=config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(1, 37, 70), (3, 1000, 1001), (17, 3072, 3072),
                                   (130, 1024, 3072), (257, 5120, 3072), (1030, 3072, 8192)])
def test_linear_and_matmul_match_fp64(m, n, k, dtype):
    w, bias = _weights(n, k, dtype, seed=n + k)
    x = _x(m, k, dtype, seed=m)
    want = x.double() @ w.double().T + bias.double()
    out = torch.full((m, n), float("nan"), device=DEV, dtype=dtype)
    assert mm.linear(x, w, bias, out=out) is out
    assert not out.isnan().any()
    assert _rel(out, want) < TOL[dtype]
    got = mm.matmul(x, w.t().contiguous())
    assert not got.isnan().any()
    assert _rel(got, want - bias.double()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bmm_matches_fp64_and_is_batch_invariant(dtype):
    g = torch.Generator(device=DEV).manual_seed(4)
    a = torch.randn(12, 33, 64, device=DEV, generator=g).to(dtype)
    b = torch.randn(12, 64, 33, device=DEV, generator=g).to(dtype)
    full = mm.bmm(a, b)
    assert _rel(full, a.double() @ b.double()) < TOL[dtype]
    for i in (0, 5, 11):
        assert torch.equal(mm.bmm(a[i:i + 1], b[i:i + 1])[0], full[i])
        assert torch.equal(mm.bmm(a[i:i + 1, :1], b[i:i + 1])[0, 0], full[i, 0])


@pytest.mark.parametrize("n,k", SHAPES)
def test_rows_do_not_depend_on_m_bf16(n, k):
    w, bias = _weights(n, k, torch.bfloat16, seed=n + k)
    x = _x(max(M_VALUES), k, torch.bfloat16, seed=k)
    alone32 = [_lin32(x[i:i + 1], w, bias) for i in range(ROWS)]
    alone16 = [mm.linear(x[i:i + 1], w, bias) for i in range(ROWS)]
    for m in M_VALUES:
        batch32 = _lin32(x[:m], w, bias)
        batch16 = mm.linear(x[:m], w, bias)
        for i in range(min(m, ROWS)):
            assert torch.equal(batch32[i], alone32[i][0]), (m, i)
            assert torch.equal(batch16[i], alone16[i][0]), (m, i)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(3072, 3072), (16384, 3072), (1024, 3072)])
def test_rows_do_not_depend_on_m_fp16_fp32(n, k, dtype):
    w, _ = _weights(n, k, dtype, seed=n)
    x = _x(1024, k, dtype, seed=k)
    alone = [mm.linear(x[i:i + 1], w) for i in range(4)]
    for m in (2, 7, 64, 257, 1024):
        batch = mm.linear(x[:m], w)
        for i in range(min(m, 4)):
            assert torch.equal(batch[i], alone[i][0]), (m, i)


@pytest.mark.parametrize("n,k", [(3072, 3072), (5120, 3072), (3072, 8192), (1024, 3072),
                                 (512, 4096), (1000, 1001)])
def test_paths_tiles_loads_and_layouts_give_identical_bits(n, k):
    w, bias = _weights(n, k, torch.bfloat16, seed=7)
    x = _x(300, k, torch.bfloat16, seed=8)
    ref = _lin32(x, w, bias)
    for cfg in path_variants(n, k):
        for m in (1, 64, 300):
            assert torch.equal(_lin32(x[:m], w, bias, config=cfg), ref[:m]), (m, cfg)
    # The B layout does not change bits either: [N, K] weight vs a [K, N] copy.
    wt = w.t().contiguous()
    assert torch.equal(mm.matmul(x, wt), mm.linear(x, w))
    out = torch.empty(300, n, device=DEV)
    assert torch.equal(mm.matmul(x, wt, out=out), _lin32(x, w))


@pytest.mark.parametrize("m", [1, 8, 64, 300, 2048])
def test_repeated_runs_are_bitwise_equal(m):
    w, bias = _weights(3072, 3072, torch.bfloat16, seed=1)
    x = _x(m, 3072, torch.bfloat16, seed=2)
    first = _lin32(x, w, bias)
    for _ in range(50):
        assert torch.equal(_lin32(x, w, bias), first)


def test_cuda_graph_capture_replays_bitwise_and_keeps_counters_zero():
    ws = MatmulWorkspace(DEV)
    w, bias = _weights(512, 4096, torch.bfloat16, seed=3)
    xs = {m: _x(m, 4096, torch.bfloat16, seed=m) for m in (1, 16, 300, 2048)}
    outs = {m: torch.empty(m, 512, device=DEV, dtype=torch.bfloat16) for m in xs}
    eager = {m: mm.linear(x, w, bias, workspace=ws) for m, x in xs.items()}  # grows ws
    assert mm.matmul_config(1, 512, 4096).k_split.num_chunks > 1  # counters in use
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for m, x in xs.items():
            mm.linear(x, w, bias, out=outs[m], workspace=ws)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        for m, x in xs.items():
            mm.linear(x, w, bias, out=outs[m], workspace=ws)
    for _ in range(20):
        for o in outs.values():
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for m in xs:
            assert torch.equal(outs[m], eager[m]), m
    assert torch.count_nonzero(ws.counters(ws.counter_capacity)) == 0
    # New inputs in the captured buffers: the graph computes them, bit for bit.
    for m, x in xs.items():
        x.copy_(_x(m, 4096, torch.bfloat16, seed=100 + m))
    graph.replay()
    torch.cuda.synchronize()
    for m, x in xs.items():
        assert torch.equal(outs[m], mm.linear(x, w, bias, workspace=ws)), m


def test_workspace_growth_is_refused_during_capture():
    w, _ = _weights(512, 4096, torch.bfloat16, seed=5)
    x = _x(1, 4096, torch.bfloat16, seed=6)
    mm.linear(x, w)  # compile outside the capture
    fresh = MatmulWorkspace(DEV)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="during CUDA-graph capture"), torch.cuda.graph(graph):
        mm.linear(x, w, workspace=fresh)
    mm.reserve_workspace(1, 512, 4096, workspace=fresh, device=DEV)
    graph = torch.cuda.CUDAGraph()
    out = torch.empty(1, 512, device=DEV, dtype=torch.bfloat16)
    with torch.cuda.graph(graph):
        mm.linear(x, w, out=out, workspace=fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, mm.linear(x, w))


@pytest.fixture
def mode_off():
    disable_batch_invariant_mode()
    yield
    disable_batch_invariant_mode()


def test_mode_routes_torch_ops_bit_for_bit_and_nests(mode_off):
    w, bias = _weights(3072, 3072, torch.bfloat16, seed=9)
    x = _x(37, 3072, torch.bfloat16, seed=10)
    x3 = x.reshape(1, 37, 3072)
    a = _x(8 * 16, 64, torch.bfloat16, seed=11).reshape(8, 16, 64)
    b = _x(8 * 64, 16, torch.bfloat16, seed=12).reshape(8, 64, 16)
    with batch_invariant():
        with batch_invariant():
            inner = torch.mm(x, w.t())
        assert is_batch_invariant_mode_enabled()
        outer = {
            "mm": torch.mm(x, w.t()),
            "linear": F.linear(x, w, bias),
            "linear3d": F.linear(x3, w),
            "bmm": torch.bmm(a, b),
            "matmul4d": a[None] @ b[None],
        }
    assert not is_batch_invariant_mode_enabled()
    assert torch.equal(inner, mm.matmul(x, w.t()))
    assert torch.equal(outer["mm"], mm.matmul(x, w.t()))
    assert torch.equal(outer["mm"], mm.linear(x, w))
    assert torch.equal(outer["linear"], mm.linear(x, w, bias))
    assert torch.equal(outer["linear3d"][0], mm.linear(x, w))
    assert torch.equal(outer["bmm"], mm.bmm(a, b))
    assert torch.equal(outer["matmul4d"][0], mm.bmm(a, b))
    # Row 0 inside the mode does not depend on the batch; fp64 still falls back to ATen.
    with batch_invariant():
        assert torch.equal(torch.mm(x[:1], w.t())[0], torch.mm(x, w.t())[0])
        xd = x.double()
        assert torch.equal(torch.mm(xd, xd.t()), xd @ xd.t())


def test_mode_routes_log_softmax_and_mean_when_their_kernels_exist(mode_off):
    softmax = pytest.importorskip("detlora.ops.softmax")
    reductions = pytest.importorskip("detlora.ops.reductions")
    x = _x(5, 4096, torch.bfloat16, seed=13)
    with batch_invariant():
        ls = torch.log_softmax(x, dim=-1)
        mn = x.float().mean(-1)
    if hasattr(softmax, "log_softmax"):
        assert torch.equal(ls, softmax.log_softmax(x))
    else:
        assert torch.equal(ls, torch.log_softmax(x, dim=-1))
    if hasattr(reductions, "mean"):
        assert torch.equal(mn, reductions.mean(x.float()))
    else:
        assert torch.equal(mn, x.float().mean(-1))


def test_hf_llama_logits_do_not_depend_on_the_batch_under_the_mode(mode_off):
    pytest.importorskip("transformers")
    from benchmarks.suites.matmul import hf_llama_invariance

    result = hf_llama_invariance(batch=32)
    assert result["cases"] > 0
    assert result["mismatches"] == 0, result


@pytest.mark.parametrize(("n", "k"), [(576, 576), (3136, 12544), (576, 1536)])
def test_grouped_linear_on_ragged_groups_is_the_reference_sum_bf16(n, k):
    """A row-parallel linear whose K groups are not whole BLOCK_K blocks (SmolLM2's o_proj:
    576 / 8 = 72; Nemotron-H's down: 12544 / 8 = 1568) runs the partials and the one-kernel
    sum: the torch sum of the same partials bit for bit, in bf16, and rows that do not depend
    on M."""
    from detlora.ops.grouped_linear import (
        k_groups,
        linear_grouped,
        linear_partials,
        sum_partials_ref,
    )

    w, bias = _weights(n, k, torch.bfloat16, seed=n + k)
    groups = k_groups(k)
    x = _x(257, k, torch.bfloat16, seed=k)
    want = sum_partials_ref(linear_partials(x, w, groups), bias, torch.bfloat16)
    got = linear_grouped(x, w, bias, groups)
    assert torch.equal(got, want)
    for m in (1, 3, 64):
        assert torch.equal(linear_grouped(x[:m], w, bias, groups), want[:m]), m
