"""Softmax and log-softmax over the last axis (the vocabulary), one reduction order per row.

Semantics:
    x: [T, V] bf16/fp16/fp32.
        log_softmax(x) = torch.log_softmax(x.float(), dim=-1).to(x.dtype)
        softmax(x)     = torch.softmax(x.float(), dim=-1).to(x.dtype)
    Computed as max, then sum of exp(x - max) in a fixed block order per row; the order
    depends on V alone, never on T.

    index: int64 [T], values in [0, V):
        chosen_logprob(x, index)
            = torch.log_softmax(x.float(), dim=-1).gather(1, index[:, None])[:, 0]  # fp32 [T]
    One column of the log-softmax per row, without writing the other V - 1: bit for bit
    ``log_softmax(x.float())[t, index[t]]`` of the kernel above, for every dtype of x (a
    16-bit x gives the bits of its fp32 upcast).

Kernels: the row is cut into fixed chunks of CHUNK elements (CHUNK and the chunk count are
functions of V). With one chunk a single program per row holds it in registers: max, then
one ``tl.sum`` of exp(x - max), then the outputs. With several, a first launch writes each
chunk's (max m_c, sum s_c of exp(x - m_c)) and a second launch, one program per (row,
chunk), merges its row's chunk statistics in one fixed tree (M = max m_c, exact;
S = sum of s_c * exp(m_c - M)) and writes its chunk. Every program of a row computes the
same M and S bit for bit, thread by thread; nothing depends on T, and a decode step (T = 1,
V = 128k) gets as many CTAs as chunks. Thread by thread: on the GPU the merge's first
butterfly step is contracted to an FMA (s_c * exp(...) + the other lane's rounded product),
so lanes 0-15 and 16-31 of a warp may hold S an ulp apart, and each element uses the S of
the thread that holds it (seen on the GPU).

chosen_logprob: the same chunk statistics (several chunks), then one program per row does
what the log-softmax kernel's program for the chunk holding index[t] does (the same chunk
load and layout, M and S by the same code, ``(x - M) - log(S)``) and keeps that one element:
no [T, V] output is written, and each row reads one chunk after the statistics. The layout
thus fixes the sums' trees and which thread's S element i gets. For a 16-bit x every chunk
load keeps 4 elements per thread, as for fp32 (Triton would vectorise 16-bit loads 8 wide):
the layout, trees and threads of ``x.float()``, so its bits.
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


def chosen_logprob_ref(
    x: torch.Tensor, index: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``log_softmax(x.float())[t, index[t]]`` per row: fp32 [T] (or written into ``out``)."""
    x, index = _check_chosen(x, index, out)
    if index.device.type == "cpu":
        _check_index_range(index, x.shape[1])
    lp = torch.log_softmax(x.float(), dim=-1).gather(1, index[:, None])[:, 0]
    return lp if out is None else out.copy_(lp)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _chunk_stats(x):
    """(max, sum of exp(x - max)) of an fp32 vector padded with -inf; (-inf, 0) if empty."""
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # keeps exp(-inf - -inf) out of the sum
    return m, tl.sum(tl.exp(x - m_safe), axis=0)


@triton.jit
def _chunk_offsets(CHUNK: tl.constexpr, FP32_VEC: tl.constexpr):
    """arange(CHUNK); with FP32_VEC, hinted contiguous in runs of 4 only: Triton then lays out
    a 16-bit row as an fp32 one (4 elements per thread, not 8): the same registers, so the
    same sum tree and the same thread per element as for x.float()."""
    if FP32_VEC:
        return tl.max_contiguous(tl.arange(0, CHUNK), 4)
    return tl.arange(0, CHUNK)


@triton.jit(do_not_specialize=["stats_plane"])  # rows x chunks: changes with the batch
def _softmax_stats_kernel(x_ptr, stats_ptr, stride_x, stats_plane, V: tl.constexpr,
                          CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                          FP32_VEC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    o = chunk * CHUNK + _chunk_offsets(CHUNK, FP32_VEC)
    x = tl.load(x_ptr + row * stride_x + o, mask=o < V, other=float("-inf"))
    m, s = _chunk_stats(x.to(tl.float32))
    tl.store(stats_ptr + row * NUM_CHUNKS + chunk, m)
    tl.store(stats_ptr + stats_plane + row * NUM_CHUNKS + chunk, s)


@triton.jit
def _merged_stats(stats_ptr, row, stats_plane, NUM_CHUNKS: tl.constexpr,
                  CHUNKS_P2: tl.constexpr):
    """A row's M = max m_c (exact) and S = sum of s_c * exp(m_c - M), in one fixed tree."""
    c = tl.arange(0, CHUNKS_P2)
    ok = c < NUM_CHUNKS
    mc = tl.load(stats_ptr + row * NUM_CHUNKS + c, mask=ok, other=float("-inf"))
    sc = tl.load(stats_ptr + stats_plane + row * NUM_CHUNKS + c, mask=ok, other=0.0)
    m = tl.max(mc, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(sc * tl.exp(mc - m_safe), axis=0)
    return m, s


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
        m, s = _merged_stats(stats_ptr, row, stats_plane, NUM_CHUNKS, CHUNKS_P2)
    return x, m, s, y_ptr + row * stride_y + o, o < V


@triton.jit(do_not_specialize=["stats_plane"])
def _softmax_kernel(x_ptr, y_ptr, stats_ptr, stride_x, stride_y, stats_plane, V: tl.constexpr,
                    CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr):
    x, m, s, y, ok = _row_max_and_sum(x_ptr, y_ptr, stats_ptr, stride_x, stride_y, stats_plane,
                                      V, CHUNK, NUM_CHUNKS, CHUNKS_P2)
    tl.store(y, (tl.exp(x - m) / s).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["stats_plane"])
def _log_softmax_kernel(x_ptr, y_ptr, stats_ptr, stride_x, stride_y, stats_plane,
                        V: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                        CHUNKS_P2: tl.constexpr):
    x, m, s, y, ok = _row_max_and_sum(x_ptr, y_ptr, stats_ptr, stride_x, stride_y, stats_plane,
                                      V, CHUNK, NUM_CHUNKS, CHUNKS_P2)
    tl.store(y, ((x - m) - tl.log(s)).to(y_ptr.dtype.element_ty), mask=ok)


# The index and output are one scalar a row, read and written through views whose strides
# and offsets follow the caller (a column of the sampler's [T, 3] head, or a slice): a
# specialization on them would compile another variant in the middle of serving (the stats
# pointer is the output itself when one chunk holds the row).
@triton.jit(do_not_specialize=["stats_plane", "stride_index", "stride_out"],
            do_not_specialize_on_alignment=["index_ptr", "out_ptr", "stats_ptr"])
def _chosen_logprob_kernel(x_ptr, index_ptr, out_ptr, stats_ptr, stride_x, stride_index,
                           stride_out, stats_plane, V: tl.constexpr, CHUNK: tl.constexpr,
                           NUM_CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
                           FP32_VEC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.load(index_ptr + row * stride_index)
    in_row = (i >= 0) & (i < V)  # unchecked on CUDA (a host sync): outside the row, NaN
    # The chunk holding i, loaded and computed as the log-softmax kernel's program for it
    # does: the same layout puts element i in the same thread, with that thread's S (lanes
    # may hold S an ulp apart: see the module doc).
    o = (tl.where(in_row, i, 0) // CHUNK) * CHUNK + _chunk_offsets(CHUNK, FP32_VEC)
    x = tl.load(x_ptr + row * stride_x + o, mask=o < V, other=float("-inf")).to(tl.float32)
    if NUM_CHUNKS == 1:
        m, s = _chunk_stats(x)
    else:
        m, s = _merged_stats(stats_ptr, row, stats_plane, NUM_CHUNKS, CHUNKS_P2)
    y = (x - m) - tl.log(s)
    # Picked by a sum: y_i + 0.0 + ... is y_i (-inf and NaN too; y_i is never -0.0).
    lp = tl.sum(tl.where(o == i, y, 0.0), axis=0)
    tl.store(out_ptr + row * stride_out,
             tl.where(in_row, lp, float("nan")).to(out_ptr.dtype.element_ty))


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
            x, stats, x.stride(0), t * num_chunks, **consts, FP32_VEC=False,
            num_warps=num_warps,
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


def _check_chosen(
    x: object, index: object, out: object
) -> tuple[torch.Tensor, torch.Tensor]:
    x = check_tensor("x", x, ndim=2, dtypes=_DTYPES, unit_last_stride=True)
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"x must have at least one row and column, got {tuple(x.shape)}")
    index = check_tensor("index", index, ndim=1, dtypes=(torch.int64,))
    check_shape("index", index, (x.shape[0],))
    if out is not None:
        out = check_tensor("out", out, ndim=1, dtypes=(torch.float32, torch.float64))
        check_shape("out", out, (x.shape[0],))
    for name, t in (("index", index), ("out", out)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}: "
                             "all tensors must share a device")
    return x, index


def _check_index_range(index: torch.Tensor, vocab: int) -> None:
    bad = (index < 0) | (index >= vocab)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"index must be in [0, {vocab}), got {int(index[row])} at row {row}")


def chosen_logprob(
    x: torch.Tensor, index: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``log_softmax(x.float())[t, index[t]]`` of every row of ``x`` [T, V]: fp32 [T].

    The log-softmax kernel's bits (its chunk statistics and merge), for any dtype of x.
    ``out`` ([T], fp32 or float64, any stride) receives the fp32 values when given (float64
    holds them exactly). ``index`` is range-checked on CPU tensors only: on CUDA that would
    sync the host, and an index outside [0, V) gives NaN there.
    """
    x, index = _check_chosen(x, index, out)
    check_same_device(x=x)  # the others share it: checked above
    if index.device.type == "cpu":
        _check_index_range(index, x.shape[1])
    t, v = x.shape
    chunk, num_chunks, num_warps = softmax_config(v)
    x = canonical_rows(x)
    if out is None:
        out = torch.empty(t, dtype=torch.float32, device=x.device)
    consts = {"V": v, "CHUNK": chunk, "NUM_CHUNKS": num_chunks,
              "FP32_VEC": x.dtype != torch.float32}
    if num_chunks == 1:
        stats = out  # unused: the one chunk's statistics are computed with it
    else:
        stats = torch.empty(2, t, num_chunks, dtype=torch.float32, device=x.device)
        _softmax_stats_kernel[(t, num_chunks)](
            x, stats, x.stride(0), t * num_chunks, **consts, num_warps=num_warps
        )
    # num_warps as the log-softmax kernel's: the same layouts, so the same trees.
    _chosen_logprob_kernel[(t,)](
        x, index, out, stats, x.stride(0), index.stride(0), out.stride(0), t * num_chunks,
        **consts, CHUNKS_P2=next_power_of_2(num_chunks), num_warps=num_warps,
    )
    return out


__all__ = [
    "chosen_logprob",
    "chosen_logprob_ref",
    "log_softmax",
    "log_softmax_ref",
    "softmax",
    "softmax_config",
    "softmax_ref",
]
