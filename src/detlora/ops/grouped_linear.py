"""A linear whose K axis is summed as a fixed number of ordered group partials.

Semantics (x [M, K], weight [N, K], bias [N] or None, G groups with K % G == 0, Kg = K / G):
    partials[g] = x[:, g*Kg:(g+1)*Kg].float() @ weight[:, g*Kg:(g+1)*Kg].float().T   # fp32
    linear_partials(x, weight, G) = partials                                           # [G, M, N]
    sum_partials(partials, bias, dtype) = ((((0 + partials[0]) + partials[1]) + ...
                                           + partials[G-1]) + bias.float()).to(dtype)
    linear_grouped(x, weight, bias, G) = sum_partials(linear_partials(x, weight, G), bias,
                                                      x.dtype)

Why: a row-parallel layer of tensor parallelism (o_proj, down_proj) splits K over the ranks.
With the shard boundaries on group boundaries, a rank computes the partials of its groups,
the ranks gather them, and every rank adds all G in group order: the same fp32 operations,
in the same order, as ``linear_grouped`` on one device. So the bits do not depend on how
many ranks share the layer, as long as G is a multiple of that number (``k_groups``).

In the kernels every partial is one reduction chain from zero (``KSplit.one_chain``), and
``linear_grouped`` is one launch of the batch-invariant linear whose chunks are the groups
(``KSplit.equal_groups``) when the groups are whole BLOCK_K blocks: its last CTA (or the
persistent CTA) adds the chunk sums in chunk order, which is ``sum_partials``. Otherwise
(SmolLM2's o_proj: K = 576, groups of 72) it is two launches: the partials (one bmm) and
``sum_partials``, itself one kernel on CUDA. Row bits never depend on M.
"""

from __future__ import annotations

import torch

from detlora.ops._runtime import cdiv, kernels_available_for, next_power_of_2
from detlora.ops.checks import check_tensor
from detlora.ops.slot_columns import SlotColumns

# Most groups a layer's K is cut into: the largest tensor-parallel size whose bits match one
# device's. Sizes 1, 2, 4 and 8 all put their shard boundaries on group boundaries.
MAX_K_GROUPS = 8

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def k_groups(k: int) -> int:
    """G for a K axis of ``k``: the largest power of two <= ``MAX_K_GROUPS`` dividing it."""
    if k < 1:
        raise ValueError(f"K must be positive, got {k}")
    g = MAX_K_GROUPS
    while k % g:
        g //= 2
    return g


def _check(x: torch.Tensor, weight: torch.Tensor, groups: int) -> tuple[int, int, int]:
    check_tensor("x", x, ndim=2, dtypes=_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,))
    m, k = x.shape
    if weight.shape[1] != k:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match x shape "
                         f"{tuple(x.shape)}: K must agree")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or k % groups:
        raise ValueError(f"groups must be a positive int dividing K = {k}, got {groups!r}")
    return m, weight.shape[0], k // groups


def sum_partials_ref(
    partials: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Torch reference of ``sum_partials``."""
    check_tensor("partials", partials, ndim=3, dtypes=(torch.float32,))
    # From an fp32 zero, as the kernels' running total starts: 0 + (-0) is +0.
    total = torch.zeros(partials.shape[1:], dtype=torch.float32, device=partials.device)
    for g in range(partials.shape[0]):
        total += partials[g]
    if bias is not None:
        total += bias.float()
    return total.to(dtype)


def sum_partials(
    partials: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """fp32 partials [G, M, N] added in group order from zero, plus the bias, rounded once:
    one kernel on CUDA (``sum_partials_kernel``), the torch reference elsewhere."""
    if partials.is_cuda:
        return sum_partials_kernel(partials, bias, dtype)
    return sum_partials_ref(partials, bias, dtype)


def sum_partials_kernel(
    partials: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``sum_partials`` as one launch: the same fp32 additions in the same order as the
    reference, so the same bits (where kernels run: CUDA or the interpreter)."""
    check_tensor("partials", partials, ndim=3, dtypes=(torch.float32,))
    if not kernels_available_for(partials):
        raise ValueError("sum_partials_kernel needs CUDA tensors (or TRITON_INTERPRET=1)")
    g, m, n = partials.shape
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != n:
            raise ValueError(f"bias has {bias.shape[0]} elements, the partials {n} columns")
        bias = bias.contiguous()
    partials = partials if partials.stride(2) == 1 else partials.contiguous()
    out = torch.empty(m, n, dtype=dtype, device=partials.device)
    if m == 0 or n == 0:
        return out
    from detlora.ops.sum_partials_kernel import SUM_BLOCK, sum_partials_kernel_

    block = min(SUM_BLOCK, next_power_of_2(n))
    sum_partials_kernel_[(m, cdiv(n, block))](
        partials, partials if bias is None else bias, out, g, m, n, partials.stride(0),
        partials.stride(1), out.stride(0), HAS_BIAS=bias is not None, BLOCK=block,
        num_warps=4)
    return out


def linear_partials_ref(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Torch reference of ``linear_partials``: fp32 [G, M, N]."""
    m, n, kg = _check(x, weight, groups)
    out = torch.empty(groups, m, n, dtype=torch.float32, device=x.device)
    for g in range(groups):
        cols = slice(g * kg, (g + 1) * kg)
        out[g] = x[:, cols].float() @ weight[:, cols].float().T
    return out


def linear_grouped_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, groups: int,
    *, slot_columns: SlotColumns | None = None,
) -> torch.Tensor:
    """Torch reference of ``linear_grouped`` (every column computed)."""
    del slot_columns
    return sum_partials_ref(linear_partials_ref(x, weight, groups), bias, x.dtype)


def linear_partials(
    x: torch.Tensor, weight: torch.Tensor, groups: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The G partials with the batch-invariant kernel, one chain each: fp32 [G, M, N]."""
    from detlora.ops.matmul import KSplit, bmm

    m, n, kg = _check(x, weight, groups)
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must have unit stride along K")
    # Group g of x and of W^T as batch g of a bmm: views, no copies.
    a = x.as_strided((groups, m, kg), (kg, x.stride(0), 1))
    b = weight.as_strided((groups, kg, n), (kg, 1, weight.stride(0)))
    if out is None:
        out = torch.empty(groups, m, n, dtype=torch.float32, device=x.device)
    return bmm(a, b, out, split=KSplit.one_chain(kg, x.dtype))


def linear_grouped(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, groups: int,
    *, slot_columns: SlotColumns | None = None,
) -> torch.Tensor:
    """``linear_grouped`` with the batch-invariant kernel: one launch when every group is
    whole BLOCK_K blocks (which may skip the columns of adapter slots no row uses, see
    ``SlotColumns``), else the partials and ``sum_partials``."""
    from detlora.ops.matmul import KSplit, linear

    _check(x, weight, groups)
    split = KSplit.equal_groups(x.shape[1], groups, x.dtype)
    if split is None:
        return sum_partials(linear_partials(x, weight, groups), bias, x.dtype)
    return linear(x, weight, bias, split=split, slot_columns=slot_columns)


__all__ = [
    "MAX_K_GROUPS", "k_groups", "linear_grouped", "linear_grouped_ref", "linear_partials",
    "linear_partials_ref", "sum_partials", "sum_partials_kernel", "sum_partials_ref",
]
