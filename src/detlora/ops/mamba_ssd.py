"""Mamba-2's selective scan (SSD) on a fixed chunk grid, one arithmetic for prefill and decode.

Semantics:
    Every sequence is cut into chunks of ``cs = chunk_size`` positions at absolute multiples of
    cs (chunk c holds positions [c * cs, (c + 1) * cs)). The state S_c [H, P, N] (fp32) is the
    state at the start of chunk c (S_0 = 0), and chunk c alone maps (S_c, its rows) to its
    outputs and to S_{c+1}:

        rows r < n of the chunk (n: its positions computed so far), each [x | B | C | dt]:
        x [H, P], B and C [G, N] (head h reads group g = h // (H // G)), dt raw [H]
        dt  = clamp(softplus(dt.float() + dt_bias), *dt_limit)  (0 for r >= n)
              softplus(v) = v if v > 20 else log1p(exp(v))
        cum = cumsum(dt * A) over r              A = -exp(A_log), fp32 [H]
        M[h, l, s] = ((C_l . B_s)[g] * exp(cum[l,h] - cum[s,h]) * dt[s,h]).to(dtype) for s <= l
        y[l, h]   = exp(cum[l,h]) * (C_l . S_c[h].to(dtype))            (sums over N, fp32)
                    + sum_s M[h, l, s] * x[s, h]                          (fp32)
                    + D[h] * x[l, h]
        S_{c+1}   = exp(cum[cs-1]) * S_c
                    + sum_l x[l]^T (B_l * exp(cum[cs-1] - cum[l]) * dt[l]).to(dtype)

    where ``dtype`` is x's (the model's): the products that feed the sums are rounded to it,
    as mamba_ssm's kernels do (no rounding at all in fp32). A row's output depends on rows
    <= it of its chunk and on S_c only, so it is the same whether the chunk is computed in
    one step, a row at a time (decode) or in pieces split anywhere: **decode is the chunk
    formula, replayed over the open chunk** (vLLM's "exact replay").

    What a sequence keeps between steps (per layer, in its state slot):
        ssm_state [S, H, P, N] fp32: S_c of its open chunk c (written when a chunk closes;
            a sequence whose open chunk is chunk 0 reads zeros, whatever the slot holds);
        chunk_buf [S, cs, conv_dim + H] (dtype): the open chunk's rows computed so far,
            [xBC after the conv | raw dt], read back for the rows before this step's first.

    The op: ``y [T, H*P] fp32`` for every row of the step; ``ssm_state`` and ``chunk_buf``
    updated in place. The step's rows are described by a ``ChunkPlan``: one *item* per
    (sequence, chunk the step touches), with ``off`` (the chunk's first row computed now,
    earlier rows from chunk_buf) and ``n`` (rows computed after the step).

    Batch invariance: a chunk's arithmetic is a function of its rows and S_c alone; the
    kernels' tiles are fixed by (cs, N, P) and row tiles are aligned to the chunk start, so
    a row's bits never depend on the other sequences, the step split or the batch.

Kernels (in this order):
    ``_dt_cumsum_kernel`` (item, block of heads): dt and cum of the chunk's cs rows
        (``tl.cumsum`` down a [cs, heads] tile of fixed shape, so a row's prefix depends on
        the rows before it alone);
    ``_chunk_cb_kernel`` (item row tile, group): C.B of the tile's rows against every
        s-block up to it, fp32, to a scratch the group's heads share;
    ``_chunk_scan_kernel`` (item row tile, head, P tile) for each sequence's first item, S_c
        from the slot: y of the rows computed now. C.S, then per s-block the causal mask and
        M @ x on tensor cores; s-blocks 0..tile in order whatever the step;
    ``_state_pass_kernel`` (sequence, head, P tile): S along the sequence's items, the
        S_c of its later items to scratch (dtype), each closed chunk's S_{c+1} (the decayed
        S_c, then the rows' products added onto it in fixed row tiles), the last S to the
        slot;
    ``_chunk_scan_kernel`` again for the later items, S_c from the scratch;
    ``_chunk_buf_kernel``: the open chunk's new rows into chunk_buf.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import next_power_of_2
from detlora.ops.checks import check_same_device, check_shape, check_tensor
from detlora.ops.chunk_plan import ITEM_FIELDS, ChunkPlan, row_tile

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BUF_COLS = 128  # chunk_buf copy: columns per program


# ----------------------------------------------------------------------------- reference


def softplus_ref(v: torch.Tensor) -> torch.Tensor:
    """torch's softplus (threshold 20) out of exp and log1p, whose CPU bits do not depend on
    an element's place in the tensor (F.softplus's vector lanes and tail differ)."""
    return torch.where(v > 20.0, v, torch.log1p(torch.exp(v)))


def _chunk_ref(rows: torch.Tensor, n: int, state: torch.Tensor, a: torch.Tensor,
               d: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float],
               heads: int, head_dim: int, groups: int, d_state: int,
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: (y [cs, H*P] fp32, S_{c+1} or None while the chunk is open). Every
    operand has the chunk's fixed shape whatever n, and every sum runs over the innermost
    axis of a broadcast product (no BLAS call, whose kernel choice follows sizes), so a
    row's bits depend on its chunk's rows up to it and S_c alone."""
    dtype = rows.dtype
    cs = rows.shape[0]
    d_inner, gn = heads * head_dim, groups * d_state
    hpg = heads // groups
    xt = rows[:, :d_inner].float().view(cs, heads, head_dim).permute(1, 2, 0)  # [H, P, cs]
    b = rows[:, d_inner:d_inner + gn].float().view(cs, groups, d_state).transpose(0, 1)
    c = rows[:, d_inner + gn:d_inner + 2 * gn].float().view(cs, groups, d_state)
    c = c.transpose(0, 1)  # [G, cs, N], as b
    dt = softplus_ref(rows[:, d_inner + 2 * gn:].float() + dt_bias)
    dt = dt.clamp(dt_limit[0], dt_limit[1])
    valid = torch.arange(cs, device=rows.device) < n
    dt = torch.where(valid[:, None], dt, torch.zeros_like(dt)).t().contiguous()  # [H, cs]
    cum = torch.cumsum(dt * a[:, None], dim=1)  # [H, cs]
    cb = (c[:, :, None, :] * b[:, None, :, :]).sum(-1)  # [G, cs(l), cs(s)]
    cb = cb.repeat_interleave(hpg, dim=0)  # [H, cs, cs]
    causal = torch.ones(cs, cs, dtype=torch.bool, device=rows.device).tril()
    decay = torch.where(causal, torch.exp(cum[:, :, None] - cum[:, None, :]),
                        torch.zeros((), device=rows.device))
    m = (cb * decay * dt[:, None, :]).to(dtype).float()  # [H, l, s]
    ch = c.repeat_interleave(hpg, dim=0)  # [H, cs, N]
    s_in = state.to(dtype).float()  # [H, P, N]
    y = (ch[:, :, None, :] * s_in[:, None, :, :]).sum(-1) * torch.exp(cum)[:, :, None]
    y = y + (m[:, :, None, :] * xt[:, None, :, :]).sum(-1)  # [H, l, P]
    y = y + d[:, None, None] * xt.transpose(1, 2)
    y = y.transpose(0, 1).reshape(cs, d_inner)
    if n < cs:
        return y, None
    last = cum[:, -1]  # [H]
    scale = torch.exp(last[:, None] - cum) * dt  # [H, cs]
    bh = b.repeat_interleave(hpg, dim=0)  # [H, cs, N]
    bs = (bh * scale[:, :, None]).to(dtype).float().transpose(1, 2)  # [H, N, cs]
    states = (xt[:, :, None, :] * bs[:, None, :, :]).sum(-1)  # [H, P, N]
    return y, torch.exp(last)[:, None, None] * state + states


def mamba_chunk_scan_ref(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    d: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    chunk_buf: torch.Tensor,
    plan: ChunkPlan,
    *,
    head_dim: int,
    n_groups: int,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> torch.Tensor:
    t, conv_dim = xbc.shape
    heads = dt.shape[1]
    d_inner = heads * head_dim
    d_state = (conv_dim - d_inner) // (2 * n_groups)
    cs = chunk_buf.shape[1]
    a, d, dt_bias = a.float(), d.float(), dt_bias.float()
    y = torch.zeros(t, d_inner, dtype=torch.float32, device=xbc.device)
    items = plan.items.tolist()
    bounds = plan.seq_items.tolist()
    for b in range(len(bounds) - 1):
        state: torch.Tensor | None = None
        closed = False
        rows = None
        for _, slot, c, row0, off, n, _rest in items[bounds[b]:bounds[b + 1]]:
            rows = torch.zeros(cs, conv_dim + heads, dtype=xbc.dtype, device=xbc.device)
            rows[:off] = chunk_buf[slot, :off]
            rows[off:n, :conv_dim] = xbc[row0 + off:row0 + n]
            rows[off:n, conv_dim:] = dt[row0 + off:row0 + n]
            if state is None:
                state = (ssm_state[slot].clone() if c > 0 else
                         torch.zeros(heads, head_dim, d_state, device=xbc.device))
            out, nxt = _chunk_ref(rows, n, state, a, d, dt_bias, dt_limit, heads, head_dim,
                                  n_groups, d_state)
            y[row0 + off:row0 + n] = out[off:n]
            if nxt is not None:
                state, closed = nxt, True
        if closed:
            ssm_state[slot] = state
        if n < cs and rows is not None:
            chunk_buf[slot, off:n] = rows[off:n]
    return y


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _load_rows(step_ptr, stride_step, buf_ptr, stride_buf, row0, off, n, r, cols, col_ok):
    """[R, len(cols)] values of chunk rows ``r``: chunk_buf for r < off, the step's rows for
    off <= r < n, zeros past n."""
    from_buf = r < off
    in_step = (r >= off) & (r < n)
    step_rows = (row0 + r).to(tl.int64)
    a = tl.load(step_ptr + step_rows[:, None] * stride_step + cols[None, :],
                mask=in_step[:, None] & col_ok[None, :], other=0.0)
    b = tl.load(buf_ptr + r[:, None].to(tl.int64) * stride_buf + cols[None, :],
                mask=from_buf[:, None] & col_ok[None, :], other=0.0)
    return tl.where(from_buf[:, None], b, a)


@triton.jit
def _dt_cumsum_kernel(
    dt_ptr, buf_ptr, items_ptr, dt_bias_ptr, a_ptr, dtp_ptr, cum_ptr,
    stride_dt, stride_buf_slot, stride_buf_row, dt_lo, dt_hi,
    H: tl.constexpr, CONV: tl.constexpr, CSP: tl.constexpr, HB: tl.constexpr,
):
    w = tl.program_id(0)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    h_ok = heads < H
    item = items_ptr + w * 7
    slot = tl.load(item + 1).to(tl.int64)
    row0 = tl.load(item + 3)
    off = tl.load(item + 4)
    n = tl.load(item + 5)
    r = tl.arange(0, CSP)
    raw = _load_rows(dt_ptr, stride_dt, buf_ptr + slot * stride_buf_slot + CONV,
                     stride_buf_row, row0, off, n, r, heads, h_ok)  # [CSP, HB]
    v = raw.to(tl.float32) + tl.load(dt_bias_ptr + heads, mask=h_ok, other=0.0)[None, :]
    dt = tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(v)))
    dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
    dt = tl.where((r < n)[:, None], dt, 0.0)
    a = tl.load(a_ptr + heads, mask=h_ok, other=0.0)
    cum = tl.cumsum(dt * a[None, :], axis=0)  # each head's column on its own
    at = (w * H + heads).to(tl.int64)[None, :] * CSP + r[:, None]
    tl.store(dtp_ptr + at, dt, mask=h_ok[None, :])
    tl.store(cum_ptr + at, cum, mask=h_ok[None, :])


@triton.jit
def _chunk_cb_kernel(
    xbc_ptr, buf_ptr, items_ptr, tiles_ptr, cb_ptr,
    stride_xbc, stride_buf_slot, stride_buf_row, tile_base,
    H: tl.constexpr, P: tl.constexpr, G: tl.constexpr, N: tl.constexpr, CBW: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):
    """C.B of one row tile and group, every s-block up to the tile: fp32 [BM, CBW] into
    cb[tile_base + tile index, group] (shared by the group's heads and P tiles)."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    w = tl.load(tiles_ptr + 2 * pid)
    tile = tl.load(tiles_ptr + 2 * pid + 1)
    item = items_ptr + w * 7
    slot = tl.load(item + 1).to(tl.int64)
    row0 = tl.load(item + 3)
    off = tl.load(item + 4)
    n = tl.load(item + 5)
    r = tile * BM + tl.arange(0, BM)
    ncols = tl.arange(0, BN)
    n_ok = ncols < N
    now = (r >= off) & (r < n)
    step_rows = (row0 + r).to(tl.int64)
    c_cols = H * P + G * N + g * N + ncols
    c_r = tl.load(xbc_ptr + step_rows[:, None] * stride_xbc + c_cols[None, :],
                  mask=now[:, None] & n_ok[None, :], other=0.0)
    buf = buf_ptr + slot * stride_buf_slot
    out = cb_ptr + ((tile_base + pid) * G + g).to(tl.int64) * (BM * CBW)
    rows = tl.arange(0, BM)
    for sb in range(0, tile + 1):
        srow = sb * BM + tl.arange(0, BM)
        b_s = _load_rows(xbc_ptr, stride_xbc, buf, stride_buf_row, row0, off, n, srow,
                         H * P + g * N + ncols, n_ok)
        cb = tl.dot(c_r, tl.trans(b_s))  # [BM, BM] fp32
        tl.store(out + rows[:, None] * CBW + srow[None, :], cb)


@triton.jit
def _chunk_scan_kernel(
    xbc_ptr, buf_ptr, y_ptr, state_ptr, scratch_ptr, cum_ptr, dtp_ptr, d_ptr, cb_ptr,
    items_ptr, tiles_ptr,
    stride_xbc, stride_buf_slot, stride_buf_row, stride_y,
    stride_st_slot, stride_st_h, stride_st_p, stride_sc_item, stride_sc_h, stride_sc_p,
    tile_base,
    H: tl.constexpr, P: tl.constexpr, G: tl.constexpr, N: tl.constexpr, CSP: tl.constexpr,
    CBW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
    FROM_SLOT: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    pcols = tl.program_id(2) * BP + tl.arange(0, BP)
    dtype = xbc_ptr.dtype.element_ty
    w = tl.load(tiles_ptr + 2 * pid)
    tile = tl.load(tiles_ptr + 2 * pid + 1)
    item = items_ptr + w * 7
    slot = tl.load(item + 1).to(tl.int64)
    chunk = tl.load(item + 2)
    row0 = tl.load(item + 3)
    off = tl.load(item + 4)
    n = tl.load(item + 5)
    rest = tl.load(item + 6).to(tl.int64)
    g = h // (H // G)
    r = tile * BM + tl.arange(0, BM)
    ncols = tl.arange(0, BN)
    p_ok = pcols < P
    n_ok = ncols < N
    x_cols = h * P + pcols
    c_cols = H * P + G * N + g * N + ncols
    buf = buf_ptr + slot * stride_buf_slot
    now = (r >= off) & (r < n)
    step_rows = (row0 + r).to(tl.int64)
    c_r = tl.load(xbc_ptr + step_rows[:, None] * stride_xbc + c_cols[None, :],
                  mask=now[:, None] & n_ok[None, :], other=0.0)
    cum_base = (w * H + h).to(tl.int64) * CSP
    cum_r = tl.load(cum_ptr + cum_base + r, mask=r < CSP, other=0.0)
    sn = p_ok[:, None] & n_ok[None, :]
    if FROM_SLOT:
        s = tl.load(state_ptr + slot * stride_st_slot + h * stride_st_h
                    + pcols[:, None] * stride_st_p + ncols[None, :], mask=sn, other=0.0)
        s = tl.where(chunk > 0, s, 0.0)
    else:
        s = tl.load(scratch_ptr + rest * stride_sc_item + h * stride_sc_h
                    + pcols[:, None] * stride_sc_p + ncols[None, :], mask=sn, other=0.0)
    acc = tl.dot(c_r, tl.trans(s.to(dtype)))  # [BM, BP]
    acc = acc * tl.exp(cum_r)[:, None]
    cb_tile = cb_ptr + ((tile_base + pid) * G + g).to(tl.int64) * (BM * CBW)
    rows = tl.arange(0, BM)
    for sb in range(0, tile + 1):
        srow = sb * BM + tl.arange(0, BM)
        cb = tl.load(cb_tile + rows[:, None] * CBW + srow[None, :])  # C.B, [BM, BM] fp32
        cum_s = tl.load(cum_ptr + cum_base + srow, mask=srow < CSP, other=0.0)
        dt_s = tl.load(dtp_ptr + cum_base + srow, mask=srow < CSP, other=0.0)
        m = cb * tl.exp(cum_r[:, None] - cum_s[None, :]) * dt_s[None, :]
        m = tl.where(r[:, None] >= srow[None, :], m, 0.0)
        x_s = _load_rows(xbc_ptr, stride_xbc, buf, stride_buf_row, row0, off, n, srow,
                         x_cols, p_ok)
        acc = tl.dot(m.to(dtype), x_s, acc)
    x_r = tl.load(xbc_ptr + step_rows[:, None] * stride_xbc + x_cols[None, :],
                  mask=now[:, None] & p_ok[None, :], other=0.0)
    acc = tl.fma(x_r.to(tl.float32), tl.load(d_ptr + h), acc)
    tl.store(y_ptr + step_rows[:, None] * stride_y + x_cols[None, :], acc,
             mask=now[:, None] & p_ok[None, :])


@triton.jit
def _state_pass_kernel(
    xbc_ptr, buf_ptr, state_ptr, scratch_ptr, cum_ptr, dtp_ptr, items_ptr, seq_items_ptr,
    pass_ptr,
    stride_xbc, stride_buf_slot, stride_buf_row,
    stride_st_slot, stride_st_h, stride_st_p, stride_sc_item, stride_sc_h, stride_sc_p,
    H: tl.constexpr, P: tl.constexpr, G: tl.constexpr, N: tl.constexpr, CS: tl.constexpr,
    CSP: tl.constexpr, TILES: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
):
    seq = tl.load(pass_ptr + tl.program_id(0))
    h = tl.program_id(1)
    pcols = tl.program_id(2) * BP + tl.arange(0, BP)
    dtype = xbc_ptr.dtype.element_ty
    g = h // (H // G)
    ncols = tl.arange(0, BN)
    p_ok = pcols < P
    n_ok = ncols < N
    sn = p_ok[:, None] & n_ok[None, :]
    x_cols = h * P + pcols
    b_cols = H * P + g * N + ncols
    first = tl.load(seq_items_ptr + seq)
    last = tl.load(seq_items_ptr + seq + 1)
    slot = tl.load(items_ptr + first * 7 + 1).to(tl.int64)
    chunk0 = tl.load(items_ptr + first * 7 + 2)
    buf = buf_ptr + slot * stride_buf_slot
    slot_state = (state_ptr + slot * stride_st_slot + h * stride_st_h
                  + pcols[:, None] * stride_st_p + ncols[None, :])
    # Does the state move (several chunks, or the last one closes)? A plan may list every
    # sequence (a decode graph's): the others read nothing.
    moves = (last - first > 1) | (tl.load(items_ptr + (last - 1) * 7 + 5) == CS)
    s = tl.zeros([BP, BN], dtype=tl.float32)
    if (chunk0 > 0) & moves:
        s = tl.load(slot_state, mask=sn, other=0.0)
    closed = 0
    for w in range(first, last):
        item = items_ptr + w * 7
        if w != first:
            rest = tl.load(item + 6).to(tl.int64)
            tl.store(scratch_ptr + rest * stride_sc_item + h * stride_sc_h
                     + pcols[:, None] * stride_sc_p + ncols[None, :], s.to(dtype), mask=sn)
        n = tl.load(item + 5)
        if n == CS:
            row0 = tl.load(item + 3)
            off = tl.load(item + 4)
            cum_base = (w * H + h).to(tl.int64) * CSP
            cum_last = tl.load(cum_ptr + cum_base + CS - 1)
            # The decayed state, then the chunk's rows added on top of it by the dots.
            s = s * tl.exp(cum_last)
            for lb in range(TILES):
                lrow = lb * BM + tl.arange(0, BM)
                x_l = _load_rows(xbc_ptr, stride_xbc, buf, stride_buf_row, row0, off, n, lrow,
                                 x_cols, p_ok)
                b_l = _load_rows(xbc_ptr, stride_xbc, buf, stride_buf_row, row0, off, n, lrow,
                                 b_cols, n_ok)
                cum_l = tl.load(cum_ptr + cum_base + lrow, mask=lrow < CSP, other=0.0)
                dt_l = tl.load(dtp_ptr + cum_base + lrow, mask=lrow < CSP, other=0.0)
                scale = tl.where(lrow < n, tl.exp(cum_last - cum_l) * dt_l, 0.0)
                b_scaled = (b_l.to(tl.float32) * scale[:, None]).to(dtype)
                s = tl.dot(tl.trans(x_l), b_scaled, s)  # [BP, BN]
            closed = 1
    if closed:
        tl.store(slot_state, s, mask=sn)


@triton.jit
def _chunk_buf_kernel(
    xbc_ptr, dt_ptr, buf_ptr, items_ptr, open_ptr,
    stride_xbc, stride_dt, stride_buf_slot, stride_buf_row,
    CONV: tl.constexpr, H: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
):
    w = tl.load(open_ptr + tl.program_id(0))
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    item = items_ptr + w * 7
    slot = tl.load(item + 1).to(tl.int64)
    row0 = tl.load(item + 3)
    off = tl.load(item + 4)
    n = tl.load(item + 5)
    is_x = (cols < CONV)[None, :]
    is_dt = ((cols >= CONV) & (cols < CONV + H))[None, :]
    for rb in range(off // BM, (n + BM - 1) // BM):  # the row blocks holding new rows
        r = rb * BM + tl.arange(0, BM)
        now = ((r >= off) & (r < n))[:, None]
        step_rows = (row0 + r).to(tl.int64)[:, None]
        v = tl.load(xbc_ptr + step_rows * stride_xbc + cols[None, :], mask=now & is_x,
                    other=0.0)
        u = tl.load(dt_ptr + step_rows * stride_dt + (cols - CONV)[None, :],
                    mask=now & is_dt, other=0.0)
        v = tl.where(is_x, v, u.to(v.dtype))
        tl.store(buf_ptr + slot * stride_buf_slot + r[:, None].to(tl.int64) * stride_buf_row
                 + cols[None, :], v, mask=now & (is_x | is_dt))


def scan_blocks(chunk_size: int, d_state: int, head_dim: int) -> tuple[int, int, int]:
    """(BM, BN, BP): row tile, state and head-dim blocks; functions of the shapes alone."""
    return (row_tile(chunk_size), max(16, next_power_of_2(d_state)),
            max(16, min(64, next_power_of_2(head_dim))))


def mamba_chunk_scan(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    d: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    chunk_buf: torch.Tensor,
    plan: ChunkPlan,
    *,
    head_dim: int,
    n_groups: int,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> torch.Tensor:
    """The chunked scan of a step (module docstring): y fp32 [T, H * P]; ``ssm_state`` and
    ``chunk_buf`` updated in place."""
    xbc = check_tensor("xbc", xbc, ndim=2, dtypes=_DTYPES, unit_last_stride=True)
    t, conv_dim = xbc.shape
    dt = check_tensor("dt", dt, ndim=2, dtypes=(xbc.dtype,), unit_last_stride=True)
    heads = dt.shape[1]
    if dt.shape[0] != t:
        raise ValueError(f"dt must have {t} rows, got {tuple(dt.shape)}")
    d_inner = heads * head_dim
    if n_groups < 1 or heads % n_groups or (conv_dim - d_inner) % (2 * n_groups) \
            or conv_dim <= d_inner:
        raise ValueError(f"xbc width {conv_dim} does not hold x ({heads} heads of "
                         f"{head_dim}) and B, C of {n_groups} groups")
    d_state = (conv_dim - d_inner) // (2 * n_groups)
    cs = chunk_buf.shape[1]
    for name, v in (("a", a), ("d", d), ("dt_bias", dt_bias)):
        check_tensor(name, v, ndim=1, dtypes=(torch.float32,))
        check_shape(name, v, (heads,))
    check_tensor("ssm_state", ssm_state, ndim=4, dtypes=(torch.float32,),
                 unit_last_stride=True)
    check_shape("ssm_state", ssm_state[0], (heads, head_dim, d_state))
    check_tensor("chunk_buf", chunk_buf, ndim=3, dtypes=(xbc.dtype,), unit_last_stride=True)
    check_shape("chunk_buf", chunk_buf[0], (cs, conv_dim + heads))
    if plan.chunk_size != cs:
        raise ValueError(f"the plan's chunk_size {plan.chunk_size} is not chunk_buf's {cs}")
    check_same_device(xbc=xbc, dt=dt, a=a, ssm_state=ssm_state, chunk_buf=chunk_buf,
                      items=plan.items)
    y = torch.empty(t, d_inner, dtype=torch.float32, device=xbc.device)
    w = plan.num_items
    if t == 0 or w == 0:
        return y
    bm, bn, bp = scan_blocks(cs, d_state, head_dim)
    csp = next_power_of_2(cs)
    p_tiles = -(-head_dim // bp)
    dtp = torch.empty(w, heads, csp, dtype=torch.float32, device=xbc.device)
    cum = torch.empty_like(dtp)
    scratch = torch.empty(max(plan.num_rest, 1), heads, head_dim, d_state, dtype=xbc.dtype,
                          device=xbc.device)
    hb = min(next_power_of_2(heads), max(1, 4096 // csp))  # heads per cumsum program
    _dt_cumsum_kernel[(w, -(-heads // hb))](
        dt, chunk_buf, plan.items, dt_bias, a, dtp, cum, dt.stride(0), chunk_buf.stride(0),
        chunk_buf.stride(1), float(dt_limit[0]), float(dt_limit[1]),
        H=heads, CONV=conv_dim, CSP=csp, HB=hb, num_warps=4)
    n_first, n_rest = plan.first_tiles.shape[0], plan.rest_tiles.shape[0]
    cbw = -(-cs // bm) * bm
    cb = torch.empty(n_first + n_rest, n_groups, bm, cbw, dtype=torch.float32,
                     device=xbc.device)
    cb_args = (xbc, chunk_buf, plan.items)
    cb_kw = dict(H=heads, P=head_dim, G=n_groups, N=d_state, CBW=cbw, BM=bm, BN=bn,
                 num_warps=4)
    for tiles, base in ((plan.first_tiles, 0), (plan.rest_tiles, n_first)):
        if tiles.shape[0]:
            _chunk_cb_kernel[(tiles.shape[0], n_groups)](
                *cb_args, tiles, cb, xbc.stride(0), chunk_buf.stride(0), chunk_buf.stride(1),
                base, **cb_kw)
    common = dict(H=heads, P=head_dim, G=n_groups, N=d_state, CSP=csp, CBW=cbw, BM=bm, BN=bn,
                  BP=bp, num_warps=4)
    strides = (xbc.stride(0), chunk_buf.stride(0), chunk_buf.stride(1), y.stride(0),
               ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
               scratch.stride(0), scratch.stride(1), scratch.stride(2))
    args = (xbc, chunk_buf, y, ssm_state, scratch, cum, dtp, d, cb, plan.items)
    _chunk_scan_kernel[(n_first, heads, p_tiles)](
        *args, plan.first_tiles, *strides, 0, FROM_SLOT=True, **common)
    n_pass = plan.pass_seqs.shape[0]
    # The state pass holds two [BP, BN] fp32 tiles: narrower tiles keep them in registers.
    pass_rows, pass_bp = (16 if cs <= 16 else 32), min(bp, 32)
    if n_pass:
        _state_pass_kernel[(n_pass, heads, -(-head_dim // pass_bp))](
            xbc, chunk_buf, ssm_state, scratch, cum, dtp, plan.items, plan.seq_items,
            plan.pass_seqs, xbc.stride(0), chunk_buf.stride(0), chunk_buf.stride(1),
            ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
            scratch.stride(0), scratch.stride(1), scratch.stride(2),
            H=heads, P=head_dim, G=n_groups, N=d_state, CS=cs, CSP=csp,
            TILES=-(-cs // pass_rows), BM=pass_rows, BN=bn, BP=pass_bp, num_warps=8)
    if n_rest:
        _chunk_scan_kernel[(n_rest, heads, p_tiles)](
            *args, plan.rest_tiles, *strides, n_first, FROM_SLOT=False, **common)
    n_open = plan.open_items.shape[0]
    if n_open:
        width = conv_dim + heads
        _chunk_buf_kernel[(n_open, -(-width // _BUF_COLS))](
            xbc, dt, chunk_buf, plan.items, plan.open_items, xbc.stride(0), dt.stride(0),
            chunk_buf.stride(0), chunk_buf.stride(1), CONV=conv_dim, H=heads, BM=bm,
            BC=_BUF_COLS, num_warps=4)
    return y


__all__ = ["ITEM_FIELDS", "ChunkPlan", "mamba_chunk_scan", "mamba_chunk_scan_ref",
           "row_tile", "scan_blocks", "softplus_ref"]
