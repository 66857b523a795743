"""Embedding lookup.

Semantics:
    ids: [T] ints in [0, V), weight: [V, H]  ->  weight[ids]  ([T, H], weight's dtype).
    A gather: batch-invariant by construction. Out-of-range ids are an error, never a read
    out of bounds.

Kernel: programs over (token, block of BLOCK columns), BLOCK fixed per H; ids are checked on
the host (one sync) unless the caller passes ``validate=False``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv, next_power_of_2
from detlora.ops.checks import check_same_device, check_shape, check_tensor

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_BLOCK = 2048


def embedding_ref(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight[ids.long()]


@triton.jit
def _embedding_kernel(ids_ptr, w_ptr, out_ptr, stride_w, stride_out, hidden,
                      BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = o < hidden
    row = tl.load(ids_ptr + t).to(tl.int64)
    v = tl.load(w_ptr + row * stride_w + o, mask=ok, other=0.0)
    tl.store(out_ptr + t * stride_out + o, v, mask=ok)


def embedding_config(hidden: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of ``hidden`` elements."""
    block = min(next_power_of_2(hidden), _MAX_BLOCK)
    return block, min(8, max(1, block // 256))


def check_ids(ids: torch.Tensor, num_rows: int) -> None:
    """Raise ValueError unless every id is in [0, num_rows) (one host sync)."""
    lo, hi = torch.stack(torch.aminmax(ids)).tolist()
    if lo < 0 or hi >= num_rows:
        raise ValueError(f"ids must be in [0, {num_rows}) (weight rows), got min {lo}, max {hi}")


def embedding(
    ids: torch.Tensor,
    weight: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """``weight[ids]`` for ``ids`` [T] and ``weight`` [V, H]: [T, H] in weight's dtype.

    ``validate`` checks the ids on the host (one sync); a hot loop whose ids were checked
    already (the tokenizer's, or the sampler's, which are < V by construction) passes
    ``validate=False``.
    """
    ids = check_tensor("ids", ids, ndim=1, dtypes=_INDEX_DTYPES, unit_last_stride=True)
    weight = check_tensor("weight", weight, ndim=2, dtypes=_DTYPES, unit_last_stride=True)
    t = ids.shape[0]
    v, h = weight.shape
    if t == 0:
        raise ValueError("ids must hold at least one id, got 0")
    if v == 0 or h == 0:
        raise ValueError(f"weight must have at least one row and column, got {(v, h)}")
    if out is None:
        out = torch.empty(t, h, dtype=weight.dtype, device=weight.device)
    else:
        check_tensor("out", out, ndim=2, dtypes=(weight.dtype,), unit_last_stride=True)
        check_shape("out", out, (t, h))
    check_same_device(ids=ids, weight=weight, out=out)
    if validate:
        check_ids(ids, v)
    block, num_warps = embedding_config(h)
    _embedding_kernel[(t, cdiv(h, block))](
        ids, weight, out, weight.stride(0), out.stride(0), h, BLOCK=block, num_warps=num_warps
    )
    return out


__all__ = ["check_ids", "embedding", "embedding_config", "embedding_ref"]
