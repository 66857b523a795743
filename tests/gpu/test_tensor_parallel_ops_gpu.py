"""The GEMMs of tensor parallelism on one GPU, bf16, Llama-3.2-3B and Llama-3.1-8B shapes:
what 1, 2, 4 and 8 ranks would compute, bit for bit equal to one device.

Row-parallel (o, down): the ranks' group partials (``linear_partials`` over their K shard,
G / ranks groups each, batched) added in group order equal the one-launch grouped linear.
Column-parallel (q|k|v, gate|up, LM head): a shard's columns with the layer's K split equal
the layer's columns. Every M from decode to prefill, both kernel paths (split, persistent).
"""

import pytest
import torch

from detlora.ops import grouped_linear as gl
from detlora.ops import matmul as mm

pytestmark = pytest.mark.gpu

DEV = "cuda"
M_VALUES = (1, 7, 64, 200, 2048)
# (N, K): o and down of Llama-3.2-3B and Llama-3.1-8B.
ROW_SHAPES = [(3072, 3072), (3072, 8192), (4096, 4096), (4096, 14336)]
# q|k|v, gate|up, LM head of the same models.
COLUMN_SHAPES = [(5120, 3072), (16384, 3072), (128256, 3072), (6144, 4096), (28672, 4096)]


def _data(m, n, k, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device=DEV, generator=g) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, device=DEV, generator=g).to(torch.bfloat16)
    return x, w, b


@pytest.mark.parametrize("n,k", ROW_SHAPES)
@pytest.mark.parametrize("m", M_VALUES)
def test_row_parallel_partials_give_the_grouped_linear(n, k, m):
    x, w, b = _data(m, n, k, seed=n + k + m)
    groups = gl.k_groups(k)
    assert groups == 8 and mm.KSplit.equal_groups(k, groups) is not None
    one = gl.linear_grouped(x, w, b, groups)
    ref = x.double() @ w.double().T + b.double()
    assert float((one.double() - ref).norm() / ref.norm()) < 1e-2
    for ranks in (1, 2, 4, 8):
        kr = k // ranks
        parts = [gl.linear_partials(x[:, r * kr:(r + 1) * kr], w[:, r * kr:(r + 1) * kr],
                                    groups // ranks) for r in range(ranks)]
        got = gl.sum_partials(torch.cat(parts), b, torch.bfloat16)
        assert torch.equal(got, one), f"{ranks} ranks"


@pytest.mark.parametrize("n,k", COLUMN_SHAPES)
@pytest.mark.parametrize("m", M_VALUES)
def test_column_shards_give_the_layers_columns(n, k, m):
    x, w, _ = _data(m, n, k, seed=n + k + m)
    split = mm.k_split(n, k)
    full = mm.linear(x, w)
    for ranks in (2, 4, 8):
        width = -(-n // ranks)
        for r in (0, ranks - 1):
            rows = slice(r * width, min(n, (r + 1) * width))
            assert torch.equal(mm.linear(x, w[rows], split=split), full[:, rows]), \
                f"{ranks} ranks, rank {r}"


def test_narrow_column_shard_needs_the_layers_split():
    """Where a shard's own width would split K differently (Llama-8B's KV slice at 8 ranks),
    the layer's split is what keeps the bits."""
    n, k = 6144, 4096
    assert mm.k_split(n // 8, k) != mm.k_split(n, k)
    x, w, _ = _data(64, n, k, seed=1)
    full = mm.linear(x, w)
    assert torch.equal(mm.linear(x, w[: n // 8], split=mm.k_split(n, k)), full[:, : n // 8])
