"""Ask the GPU's L2 to fetch part of a weight ahead of the GEMM that reads it.

Semantics:
    l2_prefetch(w, cols) -> None: no output and no effect on any value. A hint that rows of
    ``w`` ([N, K], contiguous rows) will be read soon: for each row, its first ``cols``
    elements (all of them when cols >= K) are requested into L2. Torch reference: nothing
    (``l2_prefetch_ref`` does nothing); on the CPU and in the interpreter the op is a no-op.

Why: a batch-1 decode step alternates weight-bound GEMMs with small kernels (norms, LoRA
expands, rotary, attention) that leave HBM almost idle for several microseconds each. Issued
right after a GEMM, this kernel lets the next GEMM's weight stream in during those small
kernels, so that GEMM then reads part of it from L2. A GEMM at decode gives every CTA a block
of rows and walks K in the same direction in all of them, so the head of every row (not the
head of the tensor) is what is read first.

Kernel: one thread per (row, chunk of at most ``_CHUNK_BYTES``) issues one
``cp.async.bulk.prefetch.L2`` (sm_90): fire and forget, no registers or shared memory held,
so the kernel ends as soon as its requests are out. Rows must start 16-byte aligned and the
prefetched length is rounded down to 16 bytes (a hint may fall short, never past the row).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv, interpreting, next_power_of_2
from detlora.ops.pdl import pdl_kwargs, pdl_start

_CHUNK_BYTES = 4096  # bytes per prefetch request
_THREADS = 128  # requests per program


def l2_prefetch_ref(w: torch.Tensor, cols: int) -> None:
    """The reference: a prefetch changes nothing."""
    del w, cols


@triton.jit
def _l2_prefetch_kernel(
    w_ptr,
    num_rows,
    row_stride_bytes,
    row_bytes,  # bytes to prefetch per row, a multiple of 16
    CHUNKS_PER_ROW: tl.constexpr,
    CHUNK_BYTES: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)  # ops/pdl.py: keeps "previous kernel completed" transitive along the chain
    req = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = req // CHUNKS_PER_ROW
    start = (req % CHUNKS_PER_ROW) * CHUNK_BYTES
    size = tl.minimum(row_bytes - start, CHUNK_BYTES)
    live = (row < num_rows) & (size > 0)
    base = w_ptr.to(tl.pointer_type(tl.uint8))
    ptr = base + row.to(tl.int64) * row_stride_bytes + tl.where(live, start, 0)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r",
        [ptr, tl.where(live, size, 16), live.to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1,
    )


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


_scopes = 0  # open ``l2_prefetches`` blocks


@contextlib.contextmanager
def l2_prefetches() -> Iterator[None]:
    """``l2_prefetch`` calls inside this block issue their hint; outside it they do nothing.
    The engine opens it around its decode graphs' warm-up and capture only: prefill GEMMs
    have many rows and little idle HBM time between them."""
    global _scopes
    _scopes += 1
    try:
        yield
    finally:
        _scopes -= 1


def prefetch_supported(w: torch.Tensor) -> bool:
    """True where the hint can be issued: a CUDA sm_90+ tensor outside the interpreter."""
    if not w.is_cuda or interpreting():
        return False
    index = w.device.index
    return _capable(index if index is not None else torch.cuda.current_device())


def l2_prefetch(w: torch.Tensor, cols: int) -> None:
    """Request the first ``cols`` elements of every row of ``w`` into L2 (see the module
    docstring) when inside ``l2_prefetches``; a no-op elsewhere and where unsupported.
    ValueError for a non-2-D weight or bad cols."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"w must be a 2-D tensor, got {getattr(w, 'shape', type(w))}")
    if isinstance(cols, bool) or not isinstance(cols, int) or cols < 0:
        raise ValueError(f"cols must be a non-negative int, got {cols!r}")
    if not _scopes or w.shape[0] == 0 or cols == 0 or not prefetch_supported(w):
        return
    if w.stride(1) != 1:
        raise ValueError(f"w rows must be contiguous (stride(1) == 1), got strides {w.stride()}")
    elt = w.element_size()
    row_bytes = min(cols, w.shape[1]) * elt // 16 * 16
    stride_bytes = w.stride(0) * elt
    if row_bytes == 0 or w.data_ptr() % 16 or stride_bytes % 16:
        return  # too short or unaligned for bulk prefetch: skipping a hint loses nothing
    chunks = next_power_of_2(cdiv(row_bytes, _CHUNK_BYTES))
    requests = w.shape[0] * chunks
    _l2_prefetch_kernel[(cdiv(requests, _THREADS),)](
        w, w.shape[0], stride_bytes, row_bytes,
        CHUNKS_PER_ROW=chunks, CHUNK_BYTES=_CHUNK_BYTES, BLOCK=_THREADS,
        num_warps=_THREADS // 32, **pdl_kwargs(w),
    )


__all__ = ["l2_prefetch", "l2_prefetch_ref", "l2_prefetches", "prefetch_supported"]
