"""Softmax and log-softmax over the last axis (the vocabulary), one reduction order per row.

Semantics:
    x: [T, V] bf16/fp16/fp32.
        log_softmax(x) = torch.log_softmax(x.float(), dim=-1).to(x.dtype)
        softmax(x)     = torch.softmax(x.float(), dim=-1).to(x.dtype)
    Computed as max, then sum of exp(x - max) in a fixed block order per row; the order
    depends on V alone, never on T.

Kernels: the row is cut into fixed chunks of CHUNK elements (CHUNK and the chunk count are
functions of V). With one chunk a single program per row holds it in registers: max, then
one ``tl.sum`` of exp(x - max), then the outputs. With several, a first launch writes each
chunk's (max m_c, sum s_c of exp(x - m_c)) and a second launch, one program per (row,
chunk), merges its row's chunk statistics in one fixed tree (M = max m_c, exact;
S = sum of s_c * exp(m_c - M)) and writes its chunk. Every program of a row computes the
same M and S bit for bit; nothing depends on T, and a decode step (T = 1, V = 128k) gets as
many CTAs as chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import next_power_of_2, row_chunks
from detlora.ops.checks import check_same_device, check_shape, check_tensor
from detlora.ops.reductions import canonical_out, canonical_rows, finish_out

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CHUNK = 4096  # elements of a row per program (or fewer for short rows)
_MAX_CHUNKS = 1024  # chunk statistics of a row merged in one register tile


def log_softmax_ref(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x.float(), dim=-1).to(x.dtype)


def softmax_ref(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _chunk_stats(x):
    """(max, sum of exp(x - max)) of an fp32 vector padded with -inf; (-inf, 0) if empty."""
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # keeps exp(-inf - -inf) out of the sum
    return m, tl.sum(tl.exp(x - m_safe), axis=0)


@triton.jit
def _softmax_stats_kernel(x_ptr, stats_ptr, stride_x, stats_plane, V: tl.constexpr,
                          CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    o = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + o, mask=o < V, other=float("-inf"))
    m, s = _chunk_stats(x.to(tl.float32))
    tl.store(stats_ptr + row * NUM_CHUNKS + chunk, m)
    tl.store(stats_ptr + stats_plane + row * NUM_CHUNKS + chunk, s)


@triton.jit
def _row_max_and_sum(x_ptr, y_ptr, stats_ptr, stride_x, stride_y, stats_plane, V: tl.constexpr,
                     CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr):
    """This program's chunk (fp32, -inf padded), its row's M and S, and the chunk's offsets."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    o = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + o, mask=o < V, other=float("-inf"),
                eviction_policy="evict_first").to(tl.float32)
    if NUM_CHUNKS == 1:
        m, s = _chunk_stats(x)
    else:
        c = tl.arange(0, CHUNKS_P2)
        ok = c < NUM_CHUNKS
        mc = tl.load(stats_ptr + row * NUM_CHUNKS + c, mask=ok, other=float("-inf"))
        sc = tl.load(stats_ptr + stats_plane + row * NUM_CHUNKS + c, mask=ok, other=0.0)
        m = tl.max(mc, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        s = tl.sum(sc * tl.exp(mc - m_safe), axis=0)
    return x, m, s, y_ptr + row * stride_y + o, o < V


@triton.jit
def _softmax_kernel(x_ptr, y_ptr, stats_ptr, stride_x, stride_y, stats_plane, V: tl.constexpr,
                    CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr):
    x, m, s, y, ok = _row_max_and_sum(x_ptr, y_ptr, stats_ptr, stride_x, stride_y, stats_plane,
                                      V, CHUNK, NUM_CHUNKS, CHUNKS_P2)
    tl.store(y, (tl.exp(x - m) / s).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _log_softmax_kernel(x_ptr, y_ptr, stats_ptr, stride_x, stride_y, stats_plane,
                        V: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                        CHUNKS_P2: tl.constexpr):
    x, m, s, y, ok = _row_max_and_sum(x_ptr, y_ptr, stats_ptr, stride_x, stride_y, stats_plane,
                                      V, CHUNK, NUM_CHUNKS, CHUNKS_P2)
    tl.store(y, ((x - m) - tl.log(s)).to(y_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- wrappers


def softmax_config(vocab: int) -> tuple[int, int, int]:
    """(CHUNK, NUM_CHUNKS, num_warps) for rows of ``vocab`` elements: a function of V only."""
    return row_chunks(vocab, _CHUNK, _MAX_CHUNKS)


def _launch(kernel, x: object, out: torch.Tensor | None) -> torch.Tensor:
    x = check_tensor("x", x, ndim=2, dtypes=_DTYPES, unit_last_stride=True)
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"x must have at least one row and column, got {tuple(x.shape)}")
    if out is None:
        check_same_device(x=x)
    else:
        check_tensor("out", out, ndim=2, dtypes=(x.dtype,), unit_last_stride=True)
        check_shape("out", out, x.shape)
        check_same_device(x=x, out=out)
    t, v = x.shape
    chunk, num_chunks, num_warps = softmax_config(v)
    x = canonical_rows(x)
    y = canonical_out(out, (t, v), x)
    consts = {"V": v, "CHUNK": chunk, "NUM_CHUNKS": num_chunks}
    if num_chunks == 1:
        stats = y  # unused
    else:
        stats = torch.empty(2, t, num_chunks, dtype=torch.float32, device=x.device)
        _softmax_stats_kernel[(t, num_chunks)](
            x, stats, x.stride(0), t * num_chunks, **consts, num_warps=num_warps
        )
    kernel[(t, num_chunks)](
        x, y, stats, x.stride(0), y.stride(0), t * num_chunks, **consts,
        CHUNKS_P2=next_power_of_2(num_chunks), num_warps=num_warps,
    )
    return finish_out(out, y)


def softmax(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last axis of ``x`` [T, V], fp32 inside, in x's dtype.

    ``out`` ([T, V], x's dtype) is written in full when given.
    """
    return _launch(_softmax_kernel, x, out)


def log_softmax(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Log-softmax over the last axis of ``x`` [T, V], fp32 inside, in x's dtype.

    ``out`` ([T, V], x's dtype) is written in full when given.
    """
    return _launch(_log_softmax_kernel, x, out)


__all__ = ["log_softmax", "log_softmax_ref", "softmax", "softmax_config", "softmax_ref"]
