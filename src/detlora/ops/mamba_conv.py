"""Mamba-2's causal depthwise convolution over xBC, with a per-sequence conv state.

Semantics:
    x: [T, C] bf16/fp16/fp32 (row stride free, unit column stride): the rows of B sequences,
    sequence b owning rows [query_start_loc[b], query_start_loc[b + 1]) at positions
    seq_start[b], seq_start[b] + 1, ...; weight: [C, K]; bias: [C] or None;
    conv_state: [S, K - 1, C] (x's dtype), row j of slot s = state_slots[b] holding the input
    of position seq_start[b] - (K - 1) + j (zeros for positions < 0).

        u(b, p) = x[row of position p]                       if p >= seq_start[b]
                = conv_state[slot, K - 1 - (seq_start[b] - p)] if 0 <= p < seq_start[b]
                = 0                                           if p < 0
        acc = bias.float()  (0 without bias)
        for k in range(K): acc = acc + weight[:, k].float() * u(b, p - (K - 1) + k).float()
        out[row of p] = silu(acc).to(x.dtype)        silu(v) = v / (1 + exp(-v))

    then conv_state[slot] holds the inputs of positions end - (K - 1) .. end - 1 (end =
    seq_start[b] + its row count). A sequence at position 0 reads nothing from its slot, so a
    reused slot needs no reset.

    Batch invariance: every output element is the same K products added in tap order, from
    values that do not depend on the other rows, so the bits of a position are the same in a
    prefill, a chunk of it or a decode step (prompt split anywhere).

Kernels: ``_conv_kernel`` over (4 rows, block of BLOCK_C channels) computes ``out`` with
explicit FMAs (``acc = fma(w, u, acc)``, one rounding per tap: the kernel's bits differ from
the reference's by the rounding of the products, the same in every call); then
``_conv_state_kernel`` over (sequence, channel block) writes each slot's new state, after
every read of the old one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv, next_power_of_2
from detlora.ops.checks import check_same_device, check_shape, check_tensor

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_BLOCK_C = 1024
_ROWS = 4  # rows per conv program (each row's sum is its own: the count changes no bits)


def silu_ref(v: torch.Tensor) -> torch.Tensor:
    """``v / (1 + exp(-v))``: torch's CPU silu computes vector lanes and the scalar tail
    with different code (other bits), so the references spell it out of exp, add and div,
    which give one value per element whatever its place in the tensor."""
    return v / (1.0 + torch.exp(-v))


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    seq_start: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    del token_seq  # the kernel's row -> sequence table; the sequences are walked here
    c, k = weight.shape
    out = torch.empty(x.shape[0], c, dtype=x.dtype, device=x.device)
    w = weight.float()
    b = bias.float() if bias is not None else torch.zeros(c, device=x.device)
    qsl = query_start_loc.tolist()
    for s, (slot, start) in enumerate(zip(state_slots.tolist(), seq_start.tolist(),
                                          strict=True)):
        lo, hi = qsl[s], qsl[s + 1]
        if hi == lo:
            continue
        past = (conv_state[slot] if start > 0
                else torch.zeros(k - 1, c, dtype=x.dtype, device=x.device))
        if 0 < start < k - 1:  # positions before 0 are zeros, whatever the slot held
            past = past.clone()
            past[: k - 1 - start] = 0
        u = torch.cat([past, x[lo:hi]]).float()  # positions start - (K-1) .. end - 1
        n = hi - lo
        acc = b.expand(n, c)
        for j in range(k):
            acc = acc + w[:, j] * u[j : j + n]
        out[lo:hi] = silu_ref(acc).to(x.dtype)
        conv_state[slot] = u[n:].to(conv_state.dtype)
    return out


# ----------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["n_rows"])
def _conv_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, out_ptr,
    token_seq_ptr, slots_ptr, start_ptr, qsl_ptr,
    n_rows, stride_x, stride_s, stride_sk, stride_o,
    C: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < n_rows
    ok = row_ok[:, None] & (cols < C)[None, :]
    seq = tl.load(token_seq_ptr + rows, mask=row_ok, other=0)
    slot = tl.load(slots_ptr + seq, mask=row_ok, other=0).to(tl.int64)
    start = tl.load(start_ptr + seq, mask=row_ok, other=0)
    pos = start + rows - tl.load(qsl_ptr + seq, mask=row_ok, other=0)
    if HAS_BIAS:
        acc = tl.load(b_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
        acc = tl.broadcast_to(acc, [ROWS, BLOCK_C])
    else:
        acc = tl.zeros([ROWS, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        p = pos - (K - 1) + j
        w = tl.load(w_ptr + cols * K + j, mask=cols < C, other=0.0).to(tl.float32)
        in_step = (p >= start)[:, None]
        src_row = (rows - (K - 1) + j).to(tl.int64)
        u_step = tl.load(x_ptr + src_row[:, None] * stride_x + cols[None, :],
                         mask=ok & in_step, other=0.0)
        past = ((p >= 0) & (p < start))[:, None]
        state_row = K - 1 - (start - p)
        u_past = tl.load(state_ptr + (slot * stride_s + state_row * stride_sk)[:, None]
                         + cols[None, :], mask=ok & past, other=0.0)
        u = tl.where(in_step, u_step.to(tl.float32), u_past.to(tl.float32))
        acc = tl.fma(w[None, :], u, acc)
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :],
             y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _conv_state_kernel(
    x_ptr, state_ptr, slots_ptr, start_ptr, qsl_ptr,
    stride_x, stride_s, stride_sk,
    C: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr,
):
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < C
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    start = tl.load(start_ptr + seq)
    first_row = tl.load(qsl_ptr + seq)
    n = tl.load(qsl_ptr + seq + 1) - first_row
    end = start + n
    j = tl.arange(0, KP)  # new state row j: position end - (K - 1) + j
    jok = j < K - 1
    p = end - (K - 1) + j
    in_step = (p >= start) & jok
    rows = (first_row + p - start).to(tl.int64)
    m_step = in_step[:, None] & ok[None, :]
    u_step = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m_step, other=0.0)
    past = (p >= 0) & (p < start) & jok
    old_row = K - 1 - (start - p)
    m_past = past[:, None] & ok[None, :]
    base = state_ptr + slot * stride_s
    u_past = tl.load(base + old_row[:, None] * stride_sk + cols[None, :], mask=m_past,
                     other=0.0)
    u = tl.where(in_step[:, None], u_step.to(state_ptr.dtype.element_ty),
                 u_past.to(state_ptr.dtype.element_ty))
    # Every lane loaded what it needs above: the rows it overwrites are its own.
    tl.debug_barrier()
    tl.store(base + j[:, None] * stride_sk + cols[None, :], u, mask=jok[:, None] & ok[None, :])


def conv_blocks(channels: int) -> tuple[int, int]:
    """(BLOCK_C, num_warps) for C channels: a function of C alone."""
    block = min(next_power_of_2(channels), _MAX_BLOCK_C)
    return block, min(8, max(1, _ROWS * block // 512))


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    seq_start: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_seq: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The convolution of every row of ``x`` (module docstring), ``conv_state`` updated in
    place; returns ``out`` ([T, C], x's dtype). ``token_seq`` (int32 [T]: each row's index
    into the sequences) is required here."""
    x = check_tensor("x", x, ndim=2, dtypes=_DTYPES, unit_last_stride=True)
    t, c = x.shape
    weight = check_tensor("weight", weight, ndim=2)
    if weight.shape[0] != c:
        raise ValueError(f"weight must have shape [{c}, K], got {tuple(weight.shape)}")
    k = weight.shape[1]
    weight = weight.contiguous()
    check_tensor("conv_state", conv_state, ndim=3, dtypes=(x.dtype,), unit_last_stride=True)
    if tuple(conv_state.shape[1:]) != (k - 1, c):
        raise ValueError(f"conv_state must have shape [S, {k - 1}, {c}], "
                         f"got {tuple(conv_state.shape)}")
    if bias is not None:
        check_shape("bias", bias, (c,))
    if token_seq is None:
        raise ValueError("token_seq (each row's sequence) is required by the kernel")
    num_seqs = state_slots.shape[0]
    for name, tensor, n in (("state_slots", state_slots, num_seqs),
                            ("seq_start", seq_start, num_seqs),
                            ("query_start_loc", query_start_loc, num_seqs + 1),
                            ("token_seq", token_seq, t)):
        check_tensor(name, tensor, ndim=1, dtypes=(torch.int32,))
        check_shape(name, tensor, (n,))
    if out is None:
        out = torch.empty(t, c, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, ndim=2, dtypes=(x.dtype,), unit_last_stride=True)
        check_shape("out", out, (t, c))
    check_same_device(x=x, weight=weight, conv_state=conv_state, state_slots=state_slots,
                      seq_start=seq_start, query_start_loc=query_start_loc,
                      token_seq=token_seq, out=out)
    if t == 0 or num_seqs == 0:
        return out
    block, num_warps = conv_blocks(c)
    bias_arg = bias if bias is not None else weight
    _conv_kernel[(cdiv(t, _ROWS), cdiv(c, block))](
        x, weight, bias_arg, conv_state, out, token_seq, state_slots, seq_start,
        query_start_loc, t, x.stride(0), conv_state.stride(0), conv_state.stride(1),
        out.stride(0), C=c, K=k, HAS_BIAS=bias is not None, ROWS=_ROWS, BLOCK_C=block,
        num_warps=num_warps,
    )
    _conv_state_kernel[(num_seqs, cdiv(c, block))](
        x, conv_state, state_slots, seq_start, query_start_loc, x.stride(0),
        conv_state.stride(0), conv_state.stride(1), C=c, K=k,
        KP=next_power_of_2(max(k - 1, 1)), BLOCK_C=block, num_warps=num_warps,
    )
    return out


__all__ = ["causal_conv1d", "causal_conv1d_ref", "conv_blocks", "silu_ref"]
