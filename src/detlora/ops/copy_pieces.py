"""Copy many small 2-D pieces of one flat buffer into their places in other tensors, in one
launch.

Semantics (``table`` from ``piece_table``, ``slot`` an int >= 0):
    for (src_offset, dst), slot_stride in zip(pieces, slot_strides):  # dst: 2-D, unit columns
        dst = dst shifted by slot * slot_stride elements   # the same view in another slot
        dst.copy_(src[src_offset: src_offset + dst.numel()].view(dst.shape))

A slot write copies an adapter image (hundreds of A and B pieces, B's rows strided by the
slot's rank) from a device staging buffer into every LoRA linear; as ``copy_`` calls that is
one launch per strided piece and milliseconds of host time per swap. The table holds each
piece's source offset, destination address (the buffers never move: LoRA slots are fixed for
graph capture), shape, row stride and slot stride, so one table per image layout serves every
slot; a program copies CHUNK elements of one piece. Pure data movement: the destination holds
exactly the source's bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from detlora.ops._runtime import cdiv
from detlora.ops.checks import check_same_device

CHUNK = 4096  # elements a program copies
_COLUMNS = 6  # src offset, dst address, rows, cols, dst row stride, dst slot stride


@triton.jit(do_not_specialize=["slot"])
def _copy_pieces_kernel(src_ptr, table_ptr, slot, CHUNK: tl.constexpr):
    piece = tl.program_id(0)
    entry = table_ptr + piece * 6
    rows = tl.load(entry + 2)
    cols = tl.load(entry + 3)
    start = tl.program_id(1).to(tl.int64) * CHUNK
    if start < rows * cols:
        src_offset = tl.load(entry)
        dst_ptr = tl.load(entry + 1).to(tl.pointer_type(src_ptr.dtype.element_ty))
        dst_ptr += slot * tl.load(entry + 5)
        stride = tl.load(entry + 4)
        e = start + tl.arange(0, CHUNK).to(tl.int64)
        mask = e < rows * cols
        values = tl.load(src_ptr + src_offset + e, mask=mask)
        tl.store(dst_ptr + (e // cols) * stride + e % cols, values, mask=mask)


def copy_pieces_ref(src: torch.Tensor, pieces: Sequence[tuple[int, torch.Tensor]]) -> None:
    """The semantics in torch, for ``slot`` 0 (or views already in their slot): one
    ``copy_`` per piece."""
    for offset, dst in pieces:
        dst.copy_(src[offset: offset + dst.numel()].view(dst.shape))


def piece_table(pieces: Sequence[tuple[int, torch.Tensor]], device: torch.device,
                slot_strides: Sequence[int] | None = None) -> tuple[torch.Tensor, int]:
    """The int64 table of ``pieces`` ((source offset in elements, 2-D destination view in
    slot 0)) and their ``slot_strides`` (elements between a view and the same view in the
    next slot; None: all 0) on ``device``, and the most chunks any piece needs (the launch
    grid's second dimension). On CUDA the table is copied from pinned memory without a wait:
    a copy from pageable memory would wait for the stream to drain."""
    if slot_strides is None:
        slot_strides = [0] * len(pieces)
    if len(slot_strides) != len(pieces):
        raise ValueError(f"{len(slot_strides)} slot strides for {len(pieces)} pieces")
    rows: list[list[int]] = []
    chunks = 0
    for (offset, dst), slot_stride in zip(pieces, slot_strides, strict=True):
        if dst.dim() != 2 or (dst.shape[1] > 1 and dst.stride(1) != 1):
            raise ValueError(f"piece destinations must be 2-D with unit column stride, got "
                             f"shape {tuple(dst.shape)} and strides {dst.stride()}")
        if offset < 0:
            raise ValueError(f"piece source offsets must be >= 0, got {offset}")
        if slot_stride < 0:
            raise ValueError(f"slot strides must be >= 0, got {slot_stride}")
        r, c = dst.shape
        rows.append([offset, dst.data_ptr(), r, c, dst.stride(0), slot_stride])
        chunks = max(chunks, cdiv(r * c, CHUNK))
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, _COLUMNS)
    if device.type != "cuda":
        return table.to(device), chunks
    return table.pin_memory().to(device, non_blocking=True), chunks


def copy_pieces(src: torch.Tensor, table: torch.Tensor, chunks: int,
                destinations: Sequence[torch.Tensor] = (), *, slot: int = 0) -> None:
    """Copy the pieces of ``table`` (``piece_table``'s, every destination of ``src``'s dtype)
    out of the flat ``src`` into ``slot``, on the current stream. ``destinations``: the
    table's views, only to check their dtype and device (the table holds raw addresses; the
    caller keeps every slot it names inside its tensor)."""
    if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
        raise ValueError(f"slot must be an int >= 0, got {slot!r}")
    if src.dim() != 1 or not src.is_contiguous():
        raise ValueError(f"src must be a contiguous 1-D tensor, got shape {tuple(src.shape)}")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != _COLUMNS:
        raise ValueError(f"table must be int64 [pieces, {_COLUMNS}], got {table.dtype} "
                         f"{tuple(table.shape)}")
    check_same_device(src=src, table=table)
    for dst in destinations:
        if dst.dtype != src.dtype or dst.device != src.device:
            raise ValueError(f"a destination is {dst.dtype} on {dst.device}, src {src.dtype} "
                             f"on {src.device}")
    if table.shape[0] == 0 or chunks == 0:
        return
    _copy_pieces_kernel[(table.shape[0], chunks)](src, table, slot, CHUNK=CHUNK)
