"""LoRA expand of a projection fused into the residual add + RMSNorm that reads its output.

Semantics:
    x: [T, H] bf16/fp16/fp32, the base output of o_proj or down_proj (any row stride);
    residual: [T, H]; weight: [H]; shrink_out and lora_b as ``lora_expand`` takes them, with
    one slice (lora_b [L, H, R]); groups (or token_adapter) as there.

        x2 = lora_expand_ref(x.clone(), shrink_out, lora_b, token_adapter)
        y, r = fused_add_rms_norm_ref(x2, residual, weight, eps)

    i.e. each adapter row gets x2 = (x + (hb @ B[a].T).to(x.dtype)) rounded to x's dtype, with
    hb the row's shrink output rounded to B's dtype; then r = x2 + residual and y = RMSNorm(r).
    ``x`` and ``residual`` are read, never written; y and r are new tensors.

Bits: rows without an adapter run the very instructions of ``fused_add_rms_norm`` (same
BLOCK, rows per program and warps, so the same ``tl.sum`` tree): the same bits, whether or
not other rows of the batch have adapters. An adapter row's update is summed over the rank
in fp32 in a fixed order (chunks of ``rank_chunk(H, R)`` ranks, a function of H and R alone),
not by the expand kernel's MMA, so its bits may differ from the unfused expand in the last
place; they never depend on the batch. An engine must run it for every LoRA o/down output
(never the unfused pair for some batches), so that a row is always computed one way.

Not used by the engine: it was no faster at decode and slower for prefill rows, where each
row gathers its adapter's whole B (see docs/decisions.md, "Fused expands"). It stays a
tested op.

Kernel: one program per ``rms_norm_config(H).rows`` rows (a row of H <= 8192 is one
register tile, as in ``fused_add_rms_norm``). Phase 1 gathers the rows' B [BLOCK, rank chunk]
per adapter row, multiplies by the row's shrink values, sums over the chunk, adds the update
to x and stores the result into y; phase 2 reads it back and runs the plain kernel's add,
normalization and stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv, next_power_of_2
from detlora.ops.adapter_groups import AdapterGroups
from detlora.ops.checks import check_same_device, check_shape, check_tensor
from detlora.ops.lora_expand import expand_args, lora_expand_ref
from detlora.ops.lora_partials import ShrinkPartials
from detlora.ops.reductions import canonical_rows
from detlora.ops.rms_norm import (
    check_eps,
    check_weight,
    fused_add_rms_norm_ref,
    inv_rms,
    normalize_store,
    rms_norm_blocks,
    rms_norm_config,
)

MAX_HIDDEN = 8192  # rows held in one register tile; wider rows take the unfused ops
_CHUNK_ELEMENTS = 16384  # B elements a program holds at once (rows x BLOCK x rank chunk)


def lora_expand_add_rms_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    shrink_out: torch.Tensor | ShrinkPartials,
    lora_b: torch.Tensor,
    token_adapter: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: the expand, then the residual add and RMSNorm."""
    x2 = lora_expand_ref(x.clone(), shrink_out, lora_b, token_adapter)
    return fused_add_rms_norm_ref(x2, residual, weight, eps)


def rank_chunk(hidden: int, rank: int) -> int:
    """Ranks summed per step: as many as keep the B tile at ``_CHUNK_ELEMENTS`` elements.
    A function of (H, R) alone, because it sets the order of the rank sum."""
    block, _ = rms_norm_blocks(hidden)
    per_row = rms_norm_config(hidden).rows * block
    return max(1, min(next_power_of_2(rank), _CHUNK_ELEMENTS // per_row))


@triton.jit(do_not_specialize=["n_rows"])
def _expand_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, adapter_ptr, h_ptr, b_ptr, scale_ptr,
    n_rows, R,
    stride_x, stride_r, stride_y, stride_ro,
    stride_hp, stride_ha, stride_hm, stride_bl, stride_bn,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    RANK_CHUNK: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    TAIL_GROUP: tl.constexpr,
    PARTIALS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_in = rows < n_rows
    offs = tl.arange(0, BLOCK)
    ok = row_in[:, None] & (offs < H)[None, :]
    y_rows = y_ptr + rows[:, None] * stride_y

    # Phase 1: x plus the LoRA update of the rows that have an adapter, summed over the rank
    # chunk by chunk, stored into y (the output, as scratch).
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=ok, other=0.0)
    adapter = tl.load(adapter_ptr + rows, mask=row_in, other=-1)
    has = adapter >= 0
    a = tl.where(has, adapter, 0).to(tl.int64)
    h_rows = h_ptr + a * stride_ha + rows * stride_hm
    b_rows = b_ptr + a * stride_bl
    if PARTIALS:
        scale = tl.load(scale_ptr + a, mask=has, other=0.0)
    offs_c = tl.arange(0, RANK_CHUNK)
    update = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for r0 in range(0, R, RANK_CHUNK):
        rk = r0 + offs_c
        hm = has[:, None] & (rk < R)[None, :]
        if PARTIALS:  # the expand's tree over the partials, then the scale
            total = tl.zeros((ROWS, RANK_CHUNK), dtype=tl.float32)
            group_sum = tl.zeros((ROWS, RANK_CHUNK), dtype=tl.float32)
            for p in tl.static_range(NUM_PARTS):
                group_sum += tl.load(h_rows[:, None] + p * stride_hp + rk[None, :], mask=hm,
                                     other=0.0)
                if (p + 1) % TAIL_GROUP == 0 or p == NUM_PARTS - 1:
                    total += group_sum
                    group_sum = tl.zeros((ROWS, RANK_CHUNK), dtype=tl.float32)
            hb = total * scale[:, None]
        else:
            hb = tl.load(h_rows[:, None] + rk[None, :], mask=hm, other=0.0)
        hb = hb.to(b_ptr.dtype.element_ty).to(tl.float32)
        bb = tl.load(b_rows[:, None, None] + offs[None, :, None] * stride_bn + rk[None, None, :],
                     mask=ok[:, :, None] & hm[:, None, :], other=0.0).to(tl.float32)
        update += tl.sum(bb * hb[:, None, :], axis=2)
    with_update = (x.to(tl.float32) + update.to(x.dtype).to(tl.float32)).to(x.dtype)
    tl.store(y_rows + offs[None, :], tl.where(has[:, None], with_update, x), mask=ok)
    # Phase 2 reads it back in fused_add_rms_norm's own layout (the update's sum over the rank
    # may leave the tile in another one, and the layout sets the tl.sum tree below); other
    # threads of this program wrote parts of it, hence the barrier.
    tl.debug_barrier()

    # Phase 2: fused_add_rms_norm's single-tile path, instruction for instruction.
    x = tl.load(y_rows + offs[None, :], mask=ok, other=0.0, eviction_policy="evict_first")
    r = tl.load(res_ptr + rows[:, None] * stride_r + offs[None, :], mask=ok, other=0.0,
                eviction_policy="evict_first")
    s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(res_out_ptr + rows[:, None] * stride_ro + offs[None, :],
             s.to(res_out_ptr.dtype.element_ty), mask=ok)
    sf = s.to(tl.float32)
    inv = inv_rms(tl.sum(sf * sf, axis=1), eps, H)
    normalize_store(sf, inv, w_ptr, y_rows, offs, ok, H)


def lora_expand_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    shrink_out: torch.Tensor | ShrinkPartials,
    lora_b: torch.Tensor,
    groups: AdapterGroups | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_add_rms_norm(x + the LoRA update, residual, weight, eps)`` in one kernel (see
    the module docstring): returns new tensors (y, r)."""
    e = expand_args(x, shrink_out, lora_b, groups, None)
    if len(e.widths) != 1:
        raise ValueError(f"lora_expand_add_rms_norm takes a one-slice projection, got "
                         f"{len(e.widths)} slices")
    t, h = x.shape
    if h > MAX_HIDDEN:
        raise ValueError(f"lora_expand_add_rms_norm takes rows of at most {MAX_HIDDEN} "
                         f"elements, got {h} (use lora_expand, then fused_add_rms_norm)")
    if t == 0:
        raise ValueError(f"x must have at least one row and column, got {tuple(x.shape)}")
    residual = check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,),
                            unit_last_stride=True)
    check_shape("residual", residual, (t, h))
    weight = check_weight(weight, h)
    eps = check_eps(eps)
    check_same_device(x=x, residual=residual, weight=weight)
    cfg = rms_norm_config(h)
    block, _ = rms_norm_blocks(h)
    # Fresh outputs: y is the kernel's scratch for x + the update, so it must alias nothing.
    y, r = torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty(
        t, h, dtype=x.dtype, device=x.device)
    # Aligned operands, as fused_add_rms_norm makes them: the same layouts, the same tree.
    xc, rc = canonical_rows(x), canonical_rows(residual)
    hp, ha, _, hm = e.h_strides
    _expand_add_rms_norm_kernel[(cdiv(t, cfg.rows),)](
        xc, rc, canonical_rows(weight), y, r, e.groups.token_adapter, e.h, lora_b, e.scale,
        t, e.rank,
        xc.stride(0), rc.stride(0), y.stride(0), r.stride(0),
        hp, ha, hm, lora_b.stride(0), lora_b.stride(1),
        eps,
        H=h, BLOCK=block, ROWS=cfg.rows, RANK_CHUNK=rank_chunk(h, e.rank),
        NUM_PARTS=e.num_parts, TAIL_GROUP=e.tail_group, PARTIALS=e.partials,
        num_warps=cfg.num_warps,
    )
    return y, r


__all__ = ["MAX_HIDDEN", "lora_expand_add_rms_norm", "lora_expand_add_rms_norm_ref",
           "rank_chunk"]
