"""RMSNorm, plain and with a fused residual add; one fixed reduction order per row.

Semantics:
    x: [T, H] bf16/fp16/fp32, weight: [H], eps: float.

        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)

    fused_add_rms_norm(x, residual, weight, eps) returns (rms_norm(r), r) with
    r = (x.float() + residual.float()).to(x.dtype), the new residual stream.

    Batch invariance: each row is reduced in an order fixed by H (through BLOCK and the
    default ``RmsNormConfig``), so a row's bits never depend on T. An explicit ``config=``
    may change the bits, for every T alike.

Kernels (``rms_norm``, ``fused_add_rms_norm``):
    Each program handles ROWS consecutive rows as one [ROWS, BLOCK] register tile and sums
    each row with ``tl.sum(axis=1)``; rows past T are masked. Short rows (H <= 1024) share a
    program so that it moves a few KB at least (``rms_norm_config``). By default
    ROWS and the warp count come from H alone (``rms_norm_config``), never from T, because
    together with BLOCK and the dtype they set the register layout and so the ``tl.sum``
    tree: that tree is fixed by H. Rows never share a sum, and row 0 of a one-row call runs
    the same code as row i of a large call.
    A row of H <= 8192 is one tile of BLOCK = next power of two >= H. Wider rows are walked in
    fixed BLOCK-sized blocks: an fp32 [ROWS, BLOCK] tile adds block after block elementwise,
    then one ``tl.sum`` (one row per program by default). Operands whose rows are not 16-byte
    aligned the way a fresh contiguous tensor's are go through an aligned copy
    (``detlora.ops.reductions.canonical_rows``), because Triton specializes a kernel on
    pointer alignment and the layout it then picks decides the ``tl.sum`` tree; T is passed
    unspecialized for the same reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv, next_power_of_2
from detlora.ops.checks import check_same_device, check_shape, check_tensor
from detlora.ops.pdl import pdl_kwargs, pdl_start
from detlora.ops.reductions import canonical_out, canonical_rows, finish_out

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_BLOCK = 8192  # widest row held in registers in one tile; wider rows loop over blocks
_TILE = 2048  # elements of x a program holds by default at least (rows x BLOCK)
_MAX_DEFAULT_ROWS = 16  # short rows (q/k norms of H 128) stop here
_MAX_ROWS, _MAX_WARPS, _MAX_TILE = 64, 32, 65536  # what an explicit config may ask for


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    r = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(r, weight, eps), r


# ----------------------------------------------------------------------------- kernels


@triton.jit
def inv_rms(sum_sq, eps, H: tl.constexpr):
    """1 / sqrt(mean + eps) per row; the mean is correctly rounded, as torch's."""
    return tl.rsqrt(tl.div_rn(sum_sq, H) + eps)


@triton.jit
def normalize_store(x, inv, w_ptr, y_rows, o, ok, H: tl.constexpr):
    """y = (x * inv_rms) * w, in the reference's order; x is an fp32 [ROWS, BLOCK] tile."""
    # One weight load per program, shared by its rows.
    w = tl.load(w_ptr + o, mask=o < H, other=0.0, eviction_policy="evict_last").to(tl.float32)
    y = x * inv[:, None] * w[None, :]
    # evict_first: the output is streamed out, and nothing reads it again soon (see
    # docs/decisions.md, "RMSNorm").
    tl.store(y_rows + o[None, :], y.to(y_rows.dtype.element_ty), mask=ok,
             eviction_policy="evict_first")


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    n_rows,
    stride_x,
    stride_y,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)  # ops/pdl.py: before any read or store
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = (rows < n_rows)[:, None]
    x_rows = x_ptr + rows[:, None] * stride_x
    y_rows = y_ptr + rows[:, None] * stride_y
    offs = tl.arange(0, BLOCK)
    if NUM_BLOCKS == 1:
        ok = row_ok & (offs < H)[None, :]
        x = tl.load(x_rows + offs[None, :], mask=ok, other=0.0, eviction_policy="evict_first")
        x = x.to(tl.float32)
        inv = inv_rms(tl.sum(x * x, axis=1), eps, H)
        normalize_store(x, inv, w_ptr, y_rows, offs, ok, H)
    else:
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for b in range(NUM_BLOCKS):
            o = b * BLOCK + offs
            ok = row_ok & (o < H)[None, :]
            x = tl.load(x_rows + o[None, :], mask=ok, other=0.0).to(tl.float32)
            acc += x * x
        inv = inv_rms(tl.sum(acc, axis=1), eps, H)
        for b in range(NUM_BLOCKS):
            o = b * BLOCK + offs
            ok = row_ok & (o < H)[None, :]
            x = tl.load(x_rows + o[None, :], mask=ok, other=0.0, eviction_policy="evict_first")
            normalize_store(x.to(tl.float32), inv, w_ptr, y_rows, o, ok, H)


@triton.jit(do_not_specialize=["n_rows"])
def _fused_add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    res_out_ptr,
    n_rows,
    stride_x,
    stride_r,
    stride_y,
    stride_ro,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)  # ops/pdl.py: before any read or store
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = (rows < n_rows)[:, None]
    x_rows = x_ptr + rows[:, None] * stride_x
    r_rows = res_ptr + rows[:, None] * stride_r
    y_rows = y_ptr + rows[:, None] * stride_y
    ro_rows = res_out_ptr + rows[:, None] * stride_ro
    offs = tl.arange(0, BLOCK)
    if NUM_BLOCKS == 1:
        ok = row_ok & (offs < H)[None, :]
        x = tl.load(x_rows + offs[None, :], mask=ok, other=0.0, eviction_policy="evict_first")
        r = tl.load(r_rows + offs[None, :], mask=ok, other=0.0, eviction_policy="evict_first")
        # The new residual is rounded to x's dtype before it is normalized (the semantics).
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(ro_rows + offs[None, :], s.to(res_out_ptr.dtype.element_ty), mask=ok)
        sf = s.to(tl.float32)
        inv = inv_rms(tl.sum(sf * sf, axis=1), eps, H)
        normalize_store(sf, inv, w_ptr, y_rows, offs, ok, H)
    else:
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for b in range(NUM_BLOCKS):
            o = b * BLOCK + offs
            ok = row_ok & (o < H)[None, :]
            x = tl.load(x_rows + o[None, :], mask=ok, other=0.0)
            r = tl.load(r_rows + o[None, :], mask=ok, other=0.0)
            s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(ro_rows + o[None, :], s.to(res_out_ptr.dtype.element_ty), mask=ok)
            sf = s.to(tl.float32)
            acc += sf * sf
        inv = inv_rms(tl.sum(acc, axis=1), eps, H)
        # Pass 2 reads the new residual back: it may alias the old one (in-place use), and
        # other threads of this program wrote parts of it, hence the barrier.
        tl.debug_barrier()
        for b in range(NUM_BLOCKS):
            o = b * BLOCK + offs
            ok = row_ok & (o < H)[None, :]
            s = tl.load(ro_rows + o[None, :], mask=ok, other=0.0, eviction_policy="evict_first")
            normalize_store(s.to(tl.float32), inv, w_ptr, y_rows, o, ok, H)


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class RmsNormConfig:
    """How rows are spread over programs: ``rows`` consecutive rows per program (a power of
    two), ``num_warps`` warps each.

    Part of what fixes a row's bits (with BLOCK and the dtype it sets the ``tl.sum`` tree), so
    it must not follow T: the default, :func:`rms_norm_config`, is a function of H alone.
    """

    rows: int
    num_warps: int


def rms_norm_blocks(hidden: int) -> tuple[int, int]:
    """(BLOCK, NUM_BLOCKS): a row of ``hidden`` elements is NUM_BLOCKS blocks of BLOCK."""
    block = min(next_power_of_2(hidden), _MAX_BLOCK)
    return block, cdiv(hidden, block)


def rms_norm_config(hidden: int) -> RmsNormConfig:
    """The default tiling for rows of ``hidden`` elements: a function of H only.

    Rows up to a 2048-element tile (at most 16), a warp per 512 elements (16 a thread), at
    most 8: H 1024 gets 2 rows and 4 warps, H 3072 (BLOCK 4096) and wider one row and 8 warps
    (measured: see docs/decisions.md, "RMSNorm").
    """
    block, _ = rms_norm_blocks(hidden)
    rows = min(_MAX_DEFAULT_ROWS, max(1, _TILE // block))
    return RmsNormConfig(rows=rows, num_warps=min(8, max(1, rows * block // 512)))


def check_rms_norm_config(config: object, hidden: int) -> RmsNormConfig:
    """``config`` when it is a valid tiling for rows of ``hidden`` elements, else ValueError."""
    if not isinstance(config, RmsNormConfig):
        raise ValueError(f"config must be an RmsNormConfig, got {type(config).__name__}")
    for name, hi in (("rows", _MAX_ROWS), ("num_warps", _MAX_WARPS)):
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi or v & (v - 1):
            raise ValueError(f"config.{name} must be a power of two in [1, {hi}], got {v!r}")
    block, _ = rms_norm_blocks(hidden)
    if config.rows * block > _MAX_TILE:
        raise ValueError(f"config.rows is too large for H = {hidden}: rows * BLOCK = "
                         f"{config.rows} * {block} exceeds {_MAX_TILE} elements")
    return config


# ----------------------------------------------------------------------------- wrappers


def check_eps(eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise ValueError(f"eps must be a float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    return float(eps)


def check_rows(name: str, x: object) -> torch.Tensor:
    x = check_tensor(name, x, ndim=2, dtypes=_DTYPES, unit_last_stride=True)
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must have at least one row and column, got {tuple(x.shape)}")
    return x


def check_out(name: str, out: object, like: torch.Tensor) -> torch.Tensor:
    out = check_tensor(name, out, ndim=2, dtypes=(like.dtype,), unit_last_stride=True)
    check_shape(name, out, like.shape)
    return out


def check_weight(weight: object, hidden: int) -> torch.Tensor:
    weight = check_tensor("weight", weight, ndim=1, dtypes=_DTYPES, unit_last_stride=True)
    check_shape("weight", weight, (hidden,))
    return weight


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    config: RmsNormConfig | None = None,
) -> torch.Tensor:
    """RMSNorm of every row of ``x`` [T, H] (see the module docstring); returns ``out``.

    ``out`` ([T, H], x's dtype) is written in full and may be ``x`` itself. A row's bits
    depend on its values, ``weight``, ``eps``, H and ``config`` (default
    ``rms_norm_config(H)``), never on T.
    """
    x = check_rows("x", x)
    t, h = x.shape
    weight = check_weight(weight, h)
    eps = check_eps(eps)
    if out is not None:
        check_out("out", out, x)
    check_same_device(x=x, weight=weight, **({} if out is None else {"out": out}))
    cfg = check_rms_norm_config(rms_norm_config(h) if config is None else config, h)
    block, num_blocks = rms_norm_blocks(h)
    # A misaligned out is written through an aligned temporary (module docstring).
    dst = canonical_out(out, (t, h), x)
    xc = canonical_rows(x)
    _rms_norm_kernel[(cdiv(t, cfg.rows),)](
        xc, canonical_rows(weight), dst,
        t, xc.stride(0), dst.stride(0), eps,
        H=h, BLOCK=block, NUM_BLOCKS=num_blocks, ROWS=cfg.rows, num_warps=cfg.num_warps,
        **pdl_kwargs(x),
    )
    return finish_out(out, dst)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    config: RmsNormConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(r), r)`` with ``r = x + residual`` rounded to x's dtype, in one pass.

    ``out`` and ``residual_out`` ([T, H], x's dtype) are written in full; ``out`` may be
    ``x`` and ``residual_out`` may be ``residual`` (in-place update of the residual stream),
    but they must not be the same tensor. ``config`` as for :func:`rms_norm`.
    """
    x = check_rows("x", x)
    t, h = x.shape
    residual = check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,),
                            unit_last_stride=True)
    check_shape("residual", residual, (t, h))
    weight = check_weight(weight, h)
    eps = check_eps(eps)
    outs = {}
    if out is not None:
        outs["out"] = check_out("out", out, x)
    if residual_out is not None:
        outs["residual_out"] = check_out("residual_out", residual_out, x)
    if out is not None and residual_out is not None and out.data_ptr() == residual_out.data_ptr():
        raise ValueError("out and residual_out must be different tensors")
    check_same_device(x=x, residual=residual, weight=weight, **outs)
    cfg = check_rms_norm_config(rms_norm_config(h) if config is None else config, h)
    block, num_blocks = rms_norm_blocks(h)
    y, r = canonical_out(out, (t, h), x), canonical_out(residual_out, (t, h), x)
    xc, rc = canonical_rows(x), canonical_rows(residual)
    _fused_add_rms_norm_kernel[(cdiv(t, cfg.rows),)](
        xc, rc, canonical_rows(weight), y, r,
        t, xc.stride(0), rc.stride(0), y.stride(0), r.stride(0), eps,
        H=h, BLOCK=block, NUM_BLOCKS=num_blocks, ROWS=cfg.rows, num_warps=cfg.num_warps,
        **pdl_kwargs(x),
    )
    return finish_out(out, y), finish_out(residual_out, r)


__all__ = [
    "RmsNormConfig",
    "check_rms_norm_config",
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "rms_norm",
    "rms_norm_blocks",
    "rms_norm_config",
    "rms_norm_ref",
]
