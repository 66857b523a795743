"""The grouped linear (K summed as ordered group partials) and the column-shard linear: the
torch reference, the CPU batch-invariant ops and the Triton kernels (in the interpreter).

What tensor parallelism needs from them, checked with torch.equal: the partials of a K shard
are the matching groups of the whole layer's partials, their ordered sum is the one-device
grouped linear, and a column shard reduces every column as the whole layer does."""

from __future__ import annotations

import pytest
import torch

from detlora.ops import cpu_invariant
from detlora.ops.grouped_linear import (
    k_groups,
    linear_grouped_ref,
    linear_partials_ref,
    sum_partials,
)
from detlora.ops.matmul import linear_ref


def test_k_groups_is_the_largest_power_of_two_up_to_eight_dividing_k():
    assert [k_groups(k) for k in (4096, 14336, 3072, 96, 12, 6, 7)] == [8, 8, 8, 8, 4, 2, 1]
    with pytest.raises(ValueError, match="positive"):
        k_groups(0)


def test_sum_partials_adds_in_group_order_from_an_fp32_zero():
    g = torch.Generator().manual_seed(0)
    parts = torch.randn(8, 3, 5, generator=g) * torch.logspace(0, 7, 8)[:, None, None]
    bias = torch.randn(5, generator=g).to(torch.bfloat16)
    total = torch.zeros(3, 5)
    for p in parts:
        total = total + p
    assert torch.equal(sum_partials(parts, bias, torch.bfloat16),
                       (total + bias.float()).to(torch.bfloat16))
    # Another order rounds differently: the order is the contract.
    assert not torch.equal(sum_partials(parts.flip(0), None, torch.float32),
                           sum_partials(parts, None, torch.float32))
    # -0 partials sum to +0, as the kernels' running total (which starts at +0) does.
    zeros = torch.full((2, 1, 1), -0.0)
    assert torch.signbit(sum_partials(zeros, None, torch.float32)).sum() == 0


def test_reference_matches_linear():
    g = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(7, 64, generator=g), torch.randn(24, 64, generator=g),
               torch.randn(24, generator=g))
    torch.testing.assert_close(linear_grouped_ref(x, w, b, 8), linear_ref(x, w, b),
                               rtol=1e-5, atol=1e-5)
    parts = linear_partials_ref(x, w, 4)
    assert parts.shape == (4, 7, 24) and parts.dtype == torch.float32
    with pytest.raises(ValueError, match="dividing K"):
        linear_partials_ref(x, w, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_partials_of_a_k_shard_are_the_layers_groups(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, 96, generator=g).to(dtype)
    w = torch.randn(40, 96, generator=g).to(dtype)  # 40 columns: a padded column tile
    b = torch.randn(40, generator=g).to(dtype)
    full = cpu_invariant.linear_partials(x, w, 8)
    torch.testing.assert_close(full, linear_partials_ref(x, w, 8), rtol=1e-4, atol=1e-4)
    one = cpu_invariant.linear_grouped(x, w, b, 8)
    assert torch.equal(one, sum_partials(full, b, dtype))
    for ranks in (2, 4, 8):
        kr = 96 // ranks
        parts = [cpu_invariant.linear_partials(x[:, r * kr:(r + 1) * kr],
                                               w[:, r * kr:(r + 1) * kr], 8 // ranks)
                 for r in range(ranks)]
        assert torch.equal(torch.cat(parts), full)
    # Rows do not depend on the batch.
    for rows in ([0], [5, 6, 7], list(range(17, 37))):
        assert torch.equal(cpu_invariant.linear_grouped(x[rows], w, b, 8), one[rows])


def test_cpu_column_shards_keep_the_layers_bits():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(21, 64, generator=g)
    w = torch.randn(192, 64, generator=g)
    full = cpu_invariant.linear(x, w)
    for ranks in (2, 4, 8, 12):
        n = 192 // ranks
        for r in range(ranks):
            assert torch.equal(cpu_invariant.linear(x, w[r * n:(r + 1) * n]),
                               full[:, r * n:(r + 1) * n])
    # An output column's bits do not depend on the call's other columns either.
    assert torch.equal(cpu_invariant.linear(x, torch.cat([w[:16], w[80:112]]))[:, 16:],
                       full[:, 80:112])


@pytest.fixture(scope="module")
def kernels():
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernels need CUDA or TRITON_INTERPRET=1")
    from detlora.ops import grouped_linear, matmul

    return grouped_linear, matmul


def _fp16_inputs(m: int, n: int, k: int, seed: int):
    """x [m, k], w [n, k] * 0.05 and b [n], fp16 on the kernels' device."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dev, torch.float16)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dev, torch.float16)
    b = torch.randn(n, generator=g).to(dev, torch.float16)
    return dev, x, w, b


@pytest.mark.parametrize("m", [1, 5])
def test_kernel_grouped_linear_is_the_ordered_sum_of_its_partials(kernels, m):
    """fp16: the interpreter computes bf16 dots wrongly (bf16 runs in tests/gpu)."""
    grouped_linear, matmul = kernels
    dtype = torch.float16
    _, x, w, b = _fp16_inputs(m, 48, 512, seed=4)
    split = matmul.KSplit.equal_groups(512, 8, dtype)
    assert split is not None and split.num_chunks == 8  # one launch, the groups as chunks
    parts = grouped_linear.linear_partials(x, w, 8)
    torch.testing.assert_close(parts.cpu(), linear_partials_ref(x.cpu(), w.cpu(), 8),
                               rtol=1e-3, atol=1e-3)
    one = grouped_linear.linear_grouped(x, w, b, 8)
    assert torch.equal(one, sum_partials(parts, b, dtype))
    torch.testing.assert_close(one.float().cpu(), linear_ref(x, w, b).float().cpu(),
                               rtol=2e-2, atol=2e-2)
    # Groups narrower than BLOCK_K: the partials and the torch sum.
    assert matmul.KSplit.equal_groups(128, 8, dtype) is None
    small = grouped_linear.linear_grouped(x[:, :128], w[:, :128], b, 8)
    assert torch.equal(small, sum_partials(
        grouped_linear.linear_partials(x[:, :128], w[:, :128], 8), b, dtype))


@pytest.mark.parametrize("m", [1, 20])
def test_kernel_groups_of_a_wide_layer_run_in_one_cta_with_the_same_sum(kernels, m):
    """A layer wide enough for one chain per tile walks its groups in one CTA per tile
    (``chunks_in_cta``): the ordered sum of the partials, bit for bit, at decode and
    prefill row counts. Groups of two BLOCK_K blocks: one chain over all of K would differ."""
    grouped_linear, matmul = kernels
    dtype = torch.float16
    dev, x, w, b = _fp16_inputs(m, 1024, 1024, seed=6)
    split = matmul.KSplit.equal_groups(1024, 8, dtype)
    cfg = matmul.matmul_config(m, 1024, 1024, dtype, split=split)
    assert cfg.chunks_in_cta
    one = grouped_linear.linear_grouped(x, w, b, 8)
    parts = grouped_linear.linear_partials(x, w, 8)
    assert torch.equal(one, sum_partials(parts, b, dtype))

    def fp32(**how):  # fp32 outputs: no rounding hides a different sum
        out = torch.empty(m, 1024, dtype=torch.float32, device=dev)
        return matmul.linear(x, w, b, out=out, **how)

    assert torch.equal(fp32(split=split), sum_partials(parts, b, torch.float32))
    # The cross-CTA sum of the same split gives the same bits, at the default load width and
    # at one BLOCK_K (the width changes the interpreter's dots, not the GPU's MMA steps).
    for load_k in (cfg.load_k, 0):
        in_cta = matmul.MatmulConfig(split, 16, 64, load_k=load_k, chunks_in_cta=True)
        across = matmul.MatmulConfig(split, 16, 64, load_k=load_k)
        assert torch.equal(fp32(config=in_cta), fp32(config=across)), load_k
    # With two loads a group, one chain over all of K is another sum: the checks can fail.
    chain = matmul.MatmulConfig(matmul.KSplit.one_chain(1024, dtype), 16, 64)
    assert not torch.equal(fp32(config=in_cta), fp32(config=chain))


def test_kernel_column_shards_keep_the_layers_k_split(kernels):
    """A quarter of a 1024-wide layer would split K in 4 chunks by its own width; with the
    layer's split (one chunk) its columns are the layer's, bit for bit."""
    _, matmul = kernels
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 1024, generator=g).to(dev, torch.float16)
    w = (torch.randn(1024, 1024, generator=g) * 0.05).to(dev, torch.float16)
    split = matmul.k_split(1024, 1024, torch.float16)
    assert split != matmul.k_split(256, 1024, torch.float16)
    full = matmul.linear(x, w)
    for r in range(4):
        rows = slice(r * 256, (r + 1) * 256)
        assert torch.equal(matmul.linear(x, w[rows], split=split), full[:, rows])


@pytest.mark.parametrize(("groups", "m", "n", "dtype", "with_bias"),
                         [(8, 3, 576, torch.float16, True), (4, 1, 1000, torch.float16, False),
                          (2, 5, 2500, torch.float32, True), (1, 2, 7, torch.float32, False)])
def test_the_sum_kernel_gives_the_references_bits(groups, m, n, dtype, with_bias):
    """One launch adds the partials in group order: the reference's fp32 additions exactly
    (partials of widely different magnitudes, so another order would round differently).
    The interpreter truncates bf16 roundings: bf16 is proved on the GPU."""
    from detlora.ops.grouped_linear import sum_partials_kernel, sum_partials_ref

    g = torch.Generator().manual_seed(groups * 100 + n)
    scale = torch.logspace(0, 3 if dtype == torch.float16 else 6, groups)
    parts = torch.randn(groups, m, n, generator=g) * scale[:, None, None]
    parts[0, 0, :3] = -0.0
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    want = sum_partials_ref(parts, bias, dtype)
    got = sum_partials_kernel(parts, bias, dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    # A strided view of partials (a rank's all-gathered [G, M, N] slice) reads the same.
    wide = torch.zeros(groups, m + 2, n)
    wide[:, 1:m + 1] = parts
    assert torch.equal(sum_partials_kernel(wide[:, 1:m + 1], bias, dtype), want)
