"""The Triton kernel of ``grouped_linear.sum_partials`` (imported on first use, so that
importing the engine does not load Triton).

Semantics: see ``detlora.ops.grouped_linear.sum_partials_ref``.
"""

from __future__ import annotations

import triton
import triton.language as tl

SUM_BLOCK = 1024  # output columns per program


@triton.jit(do_not_specialize=["groups", "m"])
def sum_partials_kernel_(p_ptr, bias_ptr, out_ptr, groups, m, n, stride_pg, stride_pm,
                         stride_om, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for g in range(0, groups):
        total += tl.load(p_ptr + g * stride_pg + row * stride_pm + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, total.to(out_ptr.dtype.element_ty), mask=ok)
