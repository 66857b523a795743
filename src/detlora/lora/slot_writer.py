"""Copying an adapter image from host memory into a slot of every LoRA linear of the model.

A write zeroes the slot (ranks below ``max_lora_rank`` and untargeted slices stay zero, as
``LoRASlots.set_slot`` leaves them) and copies each piece of the image, the scales and the
slot's ranks per slice in. On CUDA it is one host-to-device copy of the whole image into a
staging buffer, a batched zero (``torch._foreach_zero_``) and three ``copy_pieces`` launches
(pieces, scales, ranks, from tables of destination addresses cached per image layout, one
for every slot), all on a side stream, so the step in flight keeps running: the copy waits
only for the last launched step that read the slot's previous adapter (``use`` while a step
is prepared, ``launched`` once it is enqueued), and the next step that reads the slot waits
for the copy (``wait_ready``). A slot the step being prepared reads is never written. On the
CPU everything is synchronous. Either way a slot holds exactly the values ``set_slot`` would
give it, so a slot's content, and every output bit, is the same however and whenever it was
written.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch

from detlora.layers.linear import LinearBase
from detlora.lora.host_cache import AdapterImage, ImagePiece
from detlora.ops.copy_pieces import copy_pieces, piece_table

_VIEW_CACHE = 512  # (slot, layout) entries of destination views kept


class SlotWriter:
    def __init__(self, linears: Sequence[LinearBase], num_slots: int, *,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.linears = list(linears)
        self.num_slots = num_slots
        self.device = device
        self.dtype = dtype
        self.cuda = device.type == "cuda"
        self._stream: torch.cuda.Stream | None = None
        self._staging: torch.Tensor | None = None
        self._ready: dict[int, torch.cuda.Event] = {}  # slot -> its copy, not yet waited for
        # slot -> a mark after the last launched step that reads it (a CUDA event; on the
        # CPU, where everything is synchronous, the mark's number, for tests)
        self._last_use: dict[int, object] = {}
        self._used: set[int] = set()  # read by launched work not yet marked
        self._in_step: set[int] = set()  # read by the step being prepared (not launched)
        self.marks = 0
        self._dst_views: OrderedDict[tuple, tuple[list, list]] = OrderedDict()
        # copy_pieces tables and their chunks (CUDA), per image layout, and the scales'
        self._tables: OrderedDict[tuple, tuple[torch.Tensor, int]] = OrderedDict()
        self._scale_table: tuple[torch.Tensor, int] | None = None
        # per image layout: the ranks (int32, on the device) and their table
        self._rank_tables: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = \
            OrderedDict()
        if self.cuda:  # now, so that the KV cache is sized with it allocated
            self._staging_for(0)

    def write(self, slot: int, image: AdapterImage) -> torch.cuda.Event | None:
        """Write ``image`` into ``slot``; on CUDA returns an event after the last read of the
        image's host memory (the caller keeps that memory until then), else None."""
        if slot in self._in_step:
            raise ValueError(f"slot {slot} is read by the step being prepared: not writable")
        self._mark_used()
        if not self.cuda:
            self._last_use.pop(slot, None)
            self._fill(slot, image, image.block.data)
            return None
        stream = self._side_stream()
        staging = self._staging_for(image.nbytes)
        with torch.cuda.stream(stream):
            last = self._last_use.pop(slot, None)
            if isinstance(last, torch.cuda.Event):
                stream.wait_event(last)
            staging[: image.nbytes].copy_(image.block.data[: image.nbytes], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
            self._fill(slot, image, staging)
            ready = torch.cuda.Event()
            ready.record(stream)
        self._ready[slot] = ready
        return copied

    def clear(self, slot: int) -> None:
        """Zero ``slot`` (an adapter removed), after every step that reads it."""
        self.wait_ready([slot])
        for linear in self.linears:
            linear.clear_lora(slot)
        self._last_use.pop(slot, None)

    def use(self, slots: Iterable[int]) -> None:
        """The step being prepared reads ``slots``: it waits for their copies, and copies into
        them wait for it once it is ``launched``."""
        slots = list(slots)
        self.wait_ready(slots)
        self._in_step.update(slots)

    def launched(self) -> None:
        """The step prepared since the last call is enqueued: the next write marks where the
        stream stands after it, for the slots it reads."""
        self._used |= self._in_step
        self._in_step.clear()

    def wait_ready(self, slots: Iterable[int]) -> None:
        """Work enqueued from now on (the current stream) waits for copies into ``slots``."""
        if not self.cuda or not self._ready:
            return  # (looking up the current stream costs more than the whole check)
        current = None
        for slot in slots:
            event = self._ready.pop(slot, None)
            if event is not None:
                if current is None:
                    current = torch.cuda.current_stream(self.device)
                current.wait_event(event)

    # ---- internals ----

    def _mark_used(self) -> None:
        """Record, once, where the current stream stands: after every launched step that read
        the slots used since the last mark (never after the step being prepared: its work is
        not enqueued yet, and its slots are not writable)."""
        if not self._used:
            return
        self.marks += 1
        mark: object = self.marks
        if self.cuda:
            mark = torch.cuda.Event()
            mark.record(torch.cuda.current_stream(self.device))
        for slot in self._used:
            self._last_use[slot] = mark
        self._used.clear()

    def _fill(self, slot: int, image: AdapterImage, src: torch.Tensor) -> None:
        """Zero the slot, then copy the pieces and scales of ``image`` (laid out in ``src``,
        bytes) into it, on the current stream."""
        zero, scale_dst = self._slot_views(slot)
        torch._foreach_zero_(zero)
        if self.cuda:
            self._copy_by_table(slot, image, src)
            return
        a_dst, b_dst = self._piece_views(slot, image)
        a_src, b_src = self._source_views(image, src)
        if a_dst:
            torch._foreach_copy_(a_dst, a_src)
        if b_dst:
            torch._foreach_copy_(b_dst, b_src)
        scales = src[image.scales_offset: image.scales_offset + 4 * image.num_linears]
        torch._foreach_copy_(scale_dst, list(scales.view(torch.float32).split(1)))
        for linear, ranks in zip(self.linears, _slice_ranks(self.linears, image), strict=True):
            linear.lora.lora_rank[slot] = torch.tensor(ranks, dtype=torch.int32)

    def _copy_by_table(self, slot: int, image: AdapterImage, src: torch.Tensor) -> None:
        """The pieces, scales and slice ranks of ``image`` (in ``src``, bytes) into ``slot``:
        one ``copy_pieces`` launch each (a ``copy_`` per strided piece would cost the host a
        launch per piece). Tables hold slot 0's addresses and each piece's slot stride, so
        one per layout serves every slot; they are copied to the device from pinned memory
        without a wait."""
        if image.data_bytes:
            table = self._tables.get(image.layout)
            if table is None:
                table = self._remember(self._tables, image.layout, piece_table(
                    [(p.offset, self._dst_view(0, p)) for p in image.pieces], self.device,
                    [self._slot_stride(p) for p in image.pieces]))
            else:
                self._tables.move_to_end(image.layout)
            copy_pieces(src[: image.data_bytes].view(self.dtype), *table, slot=slot)
        if self._scale_table is None:
            _, scale_dst = self._slot_views(0)
            self._scale_table = piece_table(
                [(i, d.view(1, 1)) for i, d in enumerate(scale_dst)], self.device,
                [linear.lora.lora_scale.stride(0) for linear in self.linears])
        scales = src[image.scales_offset: image.scales_offset + 4 * image.num_linears]
        copy_pieces(scales.view(torch.float32), *self._scale_table, slot=slot)
        ranks = self._rank_tables.get(image.layout)
        if ranks is None:  # every slice of every linear: 0 where the image has no piece
            loras = [lin.lora for lin in self.linears]
            values = torch.tensor([r for per in _slice_ranks(self.linears, image) for r in per],
                                  dtype=torch.int32)
            if self.cuda:
                values = values.pin_memory().to(self.device, non_blocking=True)
            starts = itertools.accumulate((lo.num_slices for lo in loras), initial=0)
            table = piece_table(
                [(i, lora.lora_rank[0].view(1, -1)) for i, lora in zip(starts, loras,
                                                                       strict=False)],
                self.device, [lora.lora_rank.stride(0) for lora in loras])
            ranks = self._remember(self._rank_tables, image.layout, (values, *table))
        else:
            self._rank_tables.move_to_end(image.layout)
        copy_pieces(ranks[0], ranks[1], ranks[2], slot=slot)

    def _slot_views(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        key = ("slot", slot)
        views = self._dst_views.get(key)
        if views is None:
            slots = [linear.lora for linear in self.linears]
            views = self._remember(self._dst_views, key, (
                [s.lora_a[slot] for s in slots] + [s.lora_b[slot] for s in slots],
                [s.lora_scale[slot: slot + 1] for s in slots]))
        return views

    def _piece_views(self, slot: int, image: AdapterImage) -> tuple[list, list]:
        key = (slot, image.layout)
        views = self._dst_views.get(key)
        if views is None:
            a_views, b_views = [], []
            for p in image.pieces:
                (a_views if p.kind == "a" else b_views).append(self._dst_view(slot, p))
            views = self._remember(self._dst_views, key, (a_views, b_views))
        else:
            self._dst_views.move_to_end(key)
        return views

    def _dst_view(self, slot: int, p: ImagePiece) -> torch.Tensor:
        """Where piece ``p`` goes in ``slot``: A [rank, in] or B [out of its slice, rank]."""
        lora = self.linears[p.linear].lora
        if p.kind == "a":
            return lora.lora_a[slot, p.slice, : p.rank]
        lo, hi = lora.slice_offsets[p.slice], lora.slice_offsets[p.slice + 1]
        return lora.lora_b[slot, lo:hi, : p.rank]

    def _slot_stride(self, p: ImagePiece) -> int:
        """Elements between piece ``p``'s place in one slot and in the next."""
        lora = self.linears[p.linear].lora
        return (lora.lora_a if p.kind == "a" else lora.lora_b).stride(0)

    def _source_views(self, image: AdapterImage, src: torch.Tensor) -> tuple[list, list]:
        """Views of ``image``'s A and B pieces in ``src`` (bytes), in image order."""
        data = src[: image.data_bytes].view(self.dtype)
        a_views, b_views = [], []
        for p in image.pieces:
            view = data[p.offset: p.offset + p.numel].view(p.shape)
            (a_views if p.kind == "a" else b_views).append(view)
        return a_views, b_views

    @staticmethod
    def _remember(cache: OrderedDict, key: tuple, value: tuple) -> tuple:
        cache[key] = value
        if len(cache) > _VIEW_CACHE:
            cache.popitem(last=False)
        return value

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        """The device buffer images are copied into (grown, never shrunk; the side stream
        orders its reuse)."""
        if self._staging is None or self._staging.numel() < nbytes:
            if self._staging is not None:
                # The old buffer may still be read by queued copies: free it after them.
                self._staging.record_stream(self._side_stream())
            self._staging = torch.empty(_slot_bytes(self.linears, self.dtype, nbytes),
                                        dtype=torch.uint8, device=self.device)
        return self._staging


def _slice_ranks(linears: Sequence[LinearBase], image: AdapterImage) -> list[list[int]]:
    """Per linear, the image's rank in each slice (0: not targeted)."""
    ranks = [[0] * lin.lora.num_slices for lin in linears]
    for p in image.pieces:
        ranks[p.linear][p.slice] = p.rank
    return ranks


def _slot_bytes(linears: Sequence[LinearBase], dtype: torch.dtype, at_least: int) -> int:
    """Bytes of one full slot of every linear plus its scales: no image is larger."""
    elements = sum(lin.lora.lora_a[0].numel() + lin.lora.lora_b[0].numel() for lin in linears)
    full = -(-elements * dtype.itemsize // 16) * 16 + 4 * len(linears)
    return max(full, at_least)
