"""Row reductions: mean over the last axis, and argmax with ties to the lowest index.

Semantics:
    x: [T, N] bf16/fp16/fp32.
        mean(x)   = x.float().mean(dim=-1).to(x.dtype)                       # [T]
        argmax(x) = index of the largest x[t, :]; among equal maxima the lowest index  # [T]
    One fixed block order per row, depending on N alone.

    For rows holding a NaN, the kernel's argmax is the first NaN's index, as torch.argmax
    gives (argmax_ref, which compares with ==, returns N there).

Kernels:
    mean: one program per row; the row is walked in fixed blocks of BLOCK (a function of N),
    an fp32 vector adds them elementwise in block order, then one ``tl.sum``.
    argmax: the row is cut into fixed chunks of CHUNK (a function of N); one program per
    (row, chunk) finds the chunk's maximum and its lowest index, a second launch merges the
    chunks of each row in chunk order (one launch when there is one chunk). Max and min are
    exact, so argmax does not depend on any order at all; the chunks give a decode step
    (T = 1, vocabulary 128k) many CTAs instead of one.

Alignment: Triton specializes a kernel on whether pointers are 16-byte aligned and integer
arguments divisible by 16, and the register layout it then chooses decides the tree of a
``tl.sum``. ``canonical_rows`` copies an operand whose rows do not align the way a fresh
contiguous tensor's do, so every call with the same row length compiles to the same tree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv, next_power_of_2, row_chunks
from detlora.ops.checks import check_same_device, check_shape, check_tensor

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MEAN_MAX_BLOCK = 4096  # a mean row is walked in blocks of at most this many elements
_ARGMAX_CHUNK = 4096  # argmax splits a row into chunks of this many elements (or fewer)
_ARGMAX_MAX_CHUNKS = 1024  # chunks per row merged in one register tile


def mean_ref(x: torch.Tensor) -> torch.Tensor:
    return x.float().mean(dim=-1).to(x.dtype)


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    # torch.argmax documents "the first maximal value" for ties; make it explicit anyway.
    xf = x.float()
    is_max = xf == xf.max(dim=-1, keepdim=True).values
    idx = torch.arange(x.shape[-1], device=x.device).expand_as(xf)
    return torch.where(is_max, idx, x.shape[-1]).min(dim=-1).values


# ----------------------------------------------------------------------------- alignment


def is_canonical_rows(t: torch.Tensor) -> bool:
    """Whether ``t`` gets the same Triton specialization as a fresh contiguous tensor.

    That is: its data pointer is 16-byte aligned, and (for 2-D tensors) its row stride is 1
    and divisible by 16 exactly when its row length is.
    """
    if t.data_ptr() % 16:
        return False
    if t.dim() < 2:
        return True
    n, stride = t.shape[-1], t.stride(0)
    return (stride == 1) == (n == 1) and (stride % 16 == 0) == (n % 16 == 0)


def canonical_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when :func:`is_canonical_rows`, else a fresh contiguous copy."""
    if is_canonical_rows(t):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def canonical_out(
    out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor
) -> torch.Tensor:
    """Where a kernel writes: ``out`` when given and canonical, else a fresh tensor of
    ``shape`` (like's dtype and device). Pass the result to :func:`finish_out`."""
    if out is not None and is_canonical_rows(out):
        return out
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def finish_out(out: torch.Tensor | None, written: torch.Tensor) -> torch.Tensor:
    """``written``, copied into ``out`` when the kernel could not write ``out`` directly."""
    if out is None or written is out:
        return written
    return out.copy_(written)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _mean_kernel(x_ptr, y_ptr, stride_x, stride_y, N: tl.constexpr, BLOCK: tl.constexpr,
                 NUM_BLOCKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for b in range(NUM_BLOCKS):
        o = b * BLOCK + offs
        acc += tl.load(x_row + o, mask=o < N, other=0.0).to(tl.float32)
    mean = tl.div_rn(tl.sum(acc, axis=0), N)  # correctly rounded, as torch
    tl.store(y_ptr + row * stride_y, mean.to(y_ptr.dtype.element_ty))


@triton.jit
def max_and_first_index(v, idx, ok, BIG: tl.constexpr):
    """(max, lowest index of the max) of a vector; a NaN counts as the largest value.

    Entries where ``ok`` is false are ignored; the index of an empty vector is BIG. The max
    keeps v's dtype (NaN when there is one). Shared with ``detlora.ops.sampling``.
    """
    is_nan = v != v
    first_nan = tl.min(tl.where(is_nan & ok, idx, BIG), axis=0)
    finite = tl.where(is_nan | ~ok, float("-inf"), v)
    best = tl.max(finite, axis=0)
    first_best = tl.min(tl.where((finite == best) & ok, idx, BIG), axis=0)
    has_nan = first_nan < BIG
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, first_nan, first_best)


@triton.jit
def _argmax_kernel(
    x_ptr,
    out_ptr,
    part_val_ptr,
    part_idx_ptr,
    stride_x,
    stride_out,
    N: tl.constexpr,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    o = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = o < N
    v = tl.load(x_ptr + row * stride_x + o, mask=ok, other=float("-inf")).to(tl.float32)
    value, index = max_and_first_index(v, o, ok, N)
    if NUM_CHUNKS == 1:
        tl.store(out_ptr + row * stride_out, index.to(tl.int64))
    else:
        tl.store(part_val_ptr + row * NUM_CHUNKS + chunk, value)
        tl.store(part_idx_ptr + row * NUM_CHUNKS + chunk, index)


def merge_num_warps(num_chunks: int) -> int:
    """Warps of a chunk-merge launch: a power of 2, as Triton requires (from the padded count;
    ``num_chunks // 32`` would give 3 for 96 to 127 chunks)."""
    return min(4, max(1, next_power_of_2(num_chunks) // 32))


@triton.jit
def argmax_merge_kernel(
    part_val_ptr,
    part_idx_ptr,
    out_ptr,
    stride_out,
    N: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_P2)
    ok = c < NUM_CHUNKS
    v = tl.load(part_val_ptr + row * NUM_CHUNKS + c, mask=ok, other=float("-inf"))
    i = tl.load(part_idx_ptr + row * NUM_CHUNKS + c, mask=ok, other=N)
    # Chunks hold increasing index ranges, so the lowest index among tied chunks is the
    # lowest index of the row.
    _, index = max_and_first_index(v, i, ok, N)
    tl.store(out_ptr + row * stride_out, index.to(tl.int64))


# ----------------------------------------------------------------------------- wrappers


def _check(x: object, out: object, out_dtype: torch.dtype | None) -> torch.Tensor:
    x = check_tensor("x", x, ndim=2, dtypes=_DTYPES, unit_last_stride=True)
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"x must have at least one row and column, got {tuple(x.shape)}")
    if out is None:
        check_same_device(x=x)
    else:
        check_tensor("out", out, ndim=1, dtypes=(out_dtype or x.dtype,))
        check_shape("out", out, (x.shape[0],))
        check_same_device(x=x, out=out)
    return x


def mean_config(n: int) -> tuple[int, int, int]:
    """(BLOCK, NUM_BLOCKS, num_warps) for rows of ``n`` elements: a function of N only."""
    block = min(next_power_of_2(n), _MEAN_MAX_BLOCK)
    return block, cdiv(n, block), min(8, max(1, block // 512))


def argmax_config(n: int) -> tuple[int, int, int]:
    """(CHUNK, NUM_CHUNKS, num_warps) for rows of ``n`` elements: a function of N only."""
    return row_chunks(n, _ARGMAX_CHUNK, _ARGMAX_MAX_CHUNKS)


def mean(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of every row of ``x`` [T, N], fp32 accumulation, in x's dtype: [T] (or ``out``)."""
    x = canonical_rows(_check(x, out, None))
    t, n = x.shape
    block, num_blocks, num_warps = mean_config(n)
    y = canonical_out(out, (t,), x)
    _mean_kernel[(t,)](x, y, x.stride(0), y.stride(0), N=n, BLOCK=block, NUM_BLOCKS=num_blocks,
                       num_warps=num_warps)
    return finish_out(out, y)


def argmax(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Index of each row's largest element, ties to the lowest index: int64 [T] (or ``out``).

    A NaN counts as larger than everything (torch.argmax's convention).
    """
    x = _check(x, out, torch.int64)  # max and min are exact: no alignment copy needed
    t, n = x.shape
    chunk, num_chunks, num_warps = argmax_config(n)
    if out is None:
        out = torch.empty(t, dtype=torch.int64, device=x.device)
    if num_chunks == 1:
        part_val, part_idx = out, out  # unused
    else:
        part_val = torch.empty(t, num_chunks, dtype=torch.float32, device=x.device)
        part_idx = torch.empty(t, num_chunks, dtype=torch.int32, device=x.device)
    _argmax_kernel[(t, num_chunks)](
        x, out, part_val, part_idx, x.stride(0), out.stride(0),
        N=n, CHUNK=chunk, NUM_CHUNKS=num_chunks, num_warps=num_warps,
    )
    if num_chunks > 1:
        argmax_merge_kernel[(t,)](
            part_val, part_idx, out, out.stride(0),
            N=n, NUM_CHUNKS=num_chunks, CHUNKS_P2=next_power_of_2(num_chunks),
            num_warps=merge_num_warps(num_chunks),
        )
    return out


__all__ = [
    "argmax",
    "argmax_config",
    "argmax_ref",
    "canonical_out",
    "canonical_rows",
    "finish_out",
    "is_canonical_rows",
    "mean",
    "mean_config",
    "mean_ref",
]
