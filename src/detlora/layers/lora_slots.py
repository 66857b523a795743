"""The LoRA part of a linear layer: fixed adapter slots that the LoRA manager fills.

Every slot has room for one adapter of rank up to ``max_lora_rank``; smaller ranks are
zero-padded (zero rows of A and zero columns of B only add exact zeros), and each slot records
its rank per slice (``lora_rank``, 0 for a slice the adapter does not target), so the expand
sums only the ranks a slot has. The buffers never move or change shape, so a captured CUDA
graph keeps valid pointers while adapters come and go.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from detlora.layers.backend import OpBackend
from detlora.ops.adapter_groups import AdapterGroups
from detlora.ops.lora_partials import ShrinkPartials
from detlora.ops.slot_columns import SlotColumns


@dataclass(frozen=True)
class PendingLoRA:
    """A layer's LoRA term before its expand: what ``lora_expand`` takes besides y and the
    groups. The consumer of y runs the expand, alone or fused into its own op."""

    shrink_out: torch.Tensor | ShrinkPartials
    lora_b: torch.Tensor
    slice_offsets: tuple[int, ...]
    slot_ranks: torch.Tensor | None = None  # int32 [L, S]: each slot's rank per slice


@dataclass(frozen=True)
class LoRAConfig:
    """How many adapters the model holds at once and their largest rank."""

    max_loras: int
    max_lora_rank: int

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")


class LoRASlots(nn.Module):
    """Adapter slots of one (possibly fused) linear layer with ``len(output_sizes)`` slices.

    lora_a: [max_loras, S, R, in], lora_b: [max_loras, out, R] with R = max_lora_rank (slice s
    owns rows slice_offsets[s]:slice_offsets[s+1] of B), lora_scale: [max_loras] fp32,
    lora_rank: [max_loras, S] int32 (the rank each slot's adapter has in each slice).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        config: LoRAConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        a_storage: torch.Tensor | None = None,
    ) -> None:
        """``a_storage`` ([L * S * R, in], zeros): where A lives when the base weight carries
        it as extra output rows (``in_gemm``); A is then a view of it."""
        super().__init__()
        self.input_size = input_size
        self.output_sizes = tuple(int(n) for n in output_sizes)
        self.config = config
        self.slice_offsets = (0, *itertools.accumulate(self.output_sizes))
        slices, out = len(self.output_sizes), sum(self.output_sizes)
        rank, num = config.max_lora_rank, config.max_loras
        # Not persistent: adapter weights are not model weights (and not in weights_hash).
        a_shape = (num, slices, rank, input_size)
        lora_a = (torch.zeros(a_shape, dtype=dtype, device=device) if a_storage is None
                  else a_storage.view(a_shape))
        self.register_buffer("lora_a", lora_a, persistent=False)
        self.register_buffer(
            "lora_b", torch.zeros(num, out, rank, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "lora_scale", torch.zeros(num, dtype=torch.float32, device=device), persistent=False
        )
        self.register_buffer(
            "lora_rank", torch.zeros(num, slices, dtype=torch.int32, device=device),
            persistent=False)

    @property
    def num_slices(self) -> int:
        return len(self.output_sizes)

    def set_slot(
        self,
        slot: int,
        a: Sequence[torch.Tensor | None],
        b: Sequence[torch.Tensor | None],
        scale: float,
    ) -> None:
        """Write one adapter into ``slot``: per slice, A [r, in] and B [out_s, r], or None for
        a slice the adapter does not target (zeros: no update)."""
        self._check_slot(slot)
        if len(a) != self.num_slices or len(b) != self.num_slices:
            raise ValueError(
                f"expected {self.num_slices} A and B tensors (one per slice), "
                f"got {len(a)} and {len(b)}"
            )
        new_a = torch.zeros_like(self.lora_a[slot])
        new_b = torch.zeros_like(self.lora_b[slot])
        ranks = [0] * self.num_slices
        for s, (a_s, b_s) in enumerate(zip(a, b, strict=True)):
            if (a_s is None) != (b_s is None):
                raise ValueError(f"slice {s}: A and B must both be given or both be None")
            if a_s is None or b_s is None:
                continue
            rank = a_s.shape[0]
            lo, hi = self.slice_offsets[s], self.slice_offsets[s + 1]
            if a_s.dim() != 2 or a_s.shape[1] != self.input_size:
                raise ValueError(
                    f"slice {s}: A must have shape [r, {self.input_size}], got {tuple(a_s.shape)}"
                )
            if tuple(b_s.shape) != (hi - lo, rank):
                raise ValueError(
                    f"slice {s}: B must have shape [{hi - lo}, {rank}], got {tuple(b_s.shape)}"
                )
            if rank > self.config.max_lora_rank:
                raise ValueError(
                    f"slice {s}: rank {rank} exceeds max_lora_rank {self.config.max_lora_rank}"
                )
            new_a[s, :rank] = a_s.to(device=new_a.device, dtype=new_a.dtype)
            new_b[lo:hi, :rank] = b_s.to(device=new_b.device, dtype=new_b.dtype)
            ranks[s] = rank
        # In-place copies keep the buffers' addresses (CUDA graphs).
        self.lora_a[slot].copy_(new_a)
        self.lora_b[slot].copy_(new_b)
        self.lora_scale[slot] = float(scale)
        self.lora_rank[slot].copy_(torch.tensor(ranks, dtype=torch.int32))

    def clear_slot(self, slot: int) -> None:
        self._check_slot(slot)
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.lora_scale[slot] = 0.0
        self.lora_rank[slot].zero_()

    def slot_columns(self, n: int, groups: AdapterGroups) -> SlotColumns:
        """``in_gemm``: where each slot's x A^T sits in the GEMM's output (after the ``n``
        base columns), so the GEMM may skip the slots no row of ``groups`` uses."""
        return SlotColumns(n, self.num_slices * self.config.max_lora_rank, groups)

    def split_in_gemm(self, y_cat: torch.Tensor, n: int) -> tuple[torch.Tensor, ShrinkPartials]:
        """``in_gemm``: y_cat = x [W; A]^T holds x W^T in its first ``n`` columns and x A^T of
        every slot after them. Returns (x W^T, a view with y_cat's row stride; the shrink
        output as adapter-strided partials that ``lora_expand`` takes: x A^T rounded to the
        model dtype, as PEFT's lora_A output is, and scaled in the expand)."""
        h = ShrinkPartials(y_cat[:, n:].unsqueeze(0), self.num_slices, self.config.max_lora_rank,
                           tail_group=1, scale=self.lora_scale,
                           adapter_stride=self.num_slices * self.config.max_lora_rank)
        return y_cat[:, :n], h

    def shrink_beside(
        self, x: torch.Tensor, base: Callable[[], torch.Tensor], groups: AdapterGroups,
        backend: OpBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(``base()``, the layer's x W^T; the shrink output [S, M, R]), both ready on the
        current stream: the expand that takes them is the caller's.

        On CUDA the shrink, which needs only x, runs on a side stream while ``base`` runs, and
        the current stream waits for both: the shrink leaves the critical path (in a CUDA graph
        the fork and join become graph edges). Same kernels, same inputs, so the same bits;
        the shrinks stay ordered among themselves on the one side stream, so their workspace
        is never used by two kernels at once.
        """
        if x.device.type != "cuda":
            return base(), backend.lora_shrink(x, self.lora_a, groups, self.lora_scale)
        main = torch.cuda.current_stream(x.device)
        side = _side_stream(x.device)
        # Allocated on the main stream, which reads it last: no cross-stream frees.
        h = torch.empty(self.lora_a.shape[1], x.shape[0], self.lora_a.shape[2],
                        dtype=torch.float32, device=x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            backend.lora_shrink(x, self.lora_a, groups, self.lora_scale, out=h)
        y = base()
        main.wait_stream(side)
        return y, h

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.config.max_loras:
            raise ValueError(f"slot {slot} is outside [0, {self.config.max_loras - 1}]")


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream every LoRA shrink on ``device`` runs on (one per device), beside the base
    GEMM on the main stream (see docs/decisions.md, "Shrink stream")."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream
