"""Linear layers with an optional LoRA part: a plain one and a fused (merged) one.

``MergedLinear`` stacks several projections that read the same input into one weight (q/k/v
with their unequal GQA widths, gate/up), so one GEMM and one LoRA shrink serve all of them.

Tensor parallelism (layers/parallel_linear.py) slots in beside these classes by overriding
the sharding hooks of ``LinearBase``: ``local_sizes`` (the part of the layer this rank holds),
``shard`` (cut a full checkpoint or adapter tensor down to that part), ``gemm`` (which linear
computes the held part) and ``forward_unexpanded`` where the output needs a reduction
(row-parallel: the base output and the shrink output; with ``in_gemm`` the shrink columns
ride in the base output, so one reduction serves both). Loaders and the LoRA manager always
hand over *full* tensors and never need to know how the layer is split.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from detlora.layers.backend import OpBackend
from detlora.layers.lora_slots import LoRAConfig, LoRASlots, PendingLoRA
from detlora.ops.adapter_groups import AdapterGroups
from detlora.ops.slot_columns import SlotColumns


class LinearBase(nn.Module):
    """y = x W^T (+ b) for output slices ``output_sizes`` (then + the LoRA update)."""

    # Debugging only (``detlora.engine.introspect``): when set, called as ``observer(layer, x,
    # shrink_out, groups)`` after every LoRA shrink of an eager step (a captured CUDA graph
    # replays without Python). It must not write to what it is given.
    lora_observer: Callable[..., None] | None = None

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        backend: OpBackend,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        lora: LoRAConfig | None = None,
    ) -> None:
        super().__init__()
        if input_size < 1 or not output_sizes or min(output_sizes) < 1:
            raise ValueError(
                f"linear sizes must be positive, got input {input_size}, outputs {output_sizes}"
            )
        self.backend = backend
        self.input_size = int(input_size)
        self.output_sizes = tuple(int(n) for n in output_sizes)
        local_in, local_out = self.local_sizes()
        self.local_input_size = local_in
        self.local_output_sizes = local_out
        self.local_offsets = (0, *itertools.accumulate(local_out))
        n = sum(local_out)
        # in_gemm: the slots' A rows follow W's in one weight, so one GEMM gives x W^T and
        # x A^T. weight (and bias) are views of the first n rows; the A rows start at zero.
        extra = (lora.max_loras * len(local_out) * lora.max_lora_rank
                 if lora and backend.lora_in_gemm else 0)
        gemm_weight = torch.empty(n + extra, local_in, dtype=dtype, device=device)
        gemm_weight[n:].zero_()
        self.weight = nn.Parameter(gemm_weight[:n], requires_grad=False)
        gemm_bias = None
        if bias:
            gemm_bias = torch.zeros(n + extra, dtype=dtype, device=device)
        self.bias = nn.Parameter(gemm_bias[:n], requires_grad=False) if bias else None
        # Not persistent: the checkpoint holds W (and b); the A rows are adapter state.
        self.register_buffer("gemm_weight", gemm_weight if extra else None, persistent=False)
        self.register_buffer("gemm_bias", gemm_bias if extra else None, persistent=False)
        self.lora = (
            LoRASlots(local_in, local_out, lora, dtype=dtype, device=device,
                      a_storage=gemm_weight[n:] if extra else None)
            if lora else None
        )

    # ---- sharding hooks (identity here; tensor-parallel subclasses override) ----

    def local_sizes(self) -> tuple[int, tuple[int, ...]]:
        """(input size, output slice sizes) of the part of the layer held here."""
        return self.input_size, self.output_sizes

    def shard(self, tensor: torch.Tensor, slice_index: int, dim: int) -> torch.Tensor:
        """The part of a full tensor held here. ``dim`` is the tensor's output (0) or input
        (1) axis; B of LoRA is cut like the weight's output axis, A like its input axis."""
        del slice_index, dim
        return tensor

    def gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             slot_columns: SlotColumns | None = None) -> torch.Tensor:
        """x W^T (+ b) for the held weight (with ``in_gemm``, the A rows after W's, whose
        ``slot_columns`` the GEMM may skip where no row uses them)."""
        if slot_columns is None:
            return self.backend.linear(x, weight, bias)
        return self.backend.linear(x, weight, bias, slot_columns=slot_columns)

    # ---- loading ----

    def load_weight(self, tensor: torch.Tensor, slice_index: int = 0) -> None:
        """Copy the full checkpoint weight of slice ``slice_index`` ([out_s, in])."""
        self._check_slice(slice_index)
        expected = (self.output_sizes[slice_index], self.input_size)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weight must have shape {expected}, got {tuple(tensor.shape)}")
        lo, hi = self.local_offsets[slice_index], self.local_offsets[slice_index + 1]
        local = self.shard(self.shard(tensor, slice_index, 0), slice_index, 1)
        with torch.no_grad():
            self.weight[lo:hi].copy_(local)

    def load_bias(self, tensor: torch.Tensor, slice_index: int = 0) -> None:
        self._check_slice(slice_index)
        if self.bias is None:
            raise ValueError("this layer has no bias")
        expected = (self.output_sizes[slice_index],)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"bias must have shape {expected}, got {tuple(tensor.shape)}")
        lo, hi = self.local_offsets[slice_index], self.local_offsets[slice_index + 1]
        with torch.no_grad():
            self.bias[lo:hi].copy_(self.shard(tensor, slice_index, 0))

    # ---- LoRA slots ----

    def set_lora(
        self,
        slot: int,
        a: Sequence[torch.Tensor | None],
        b: Sequence[torch.Tensor | None],
        scale: float,
    ) -> None:
        """Write one adapter's full A [r, in] and B [out_s, r] per slice (None: untargeted)."""
        if self.lora is None:
            raise ValueError("this layer was built without LoRA slots")
        a_local = [None if t is None else self.shard(t, s, 1) for s, t in enumerate(a)]
        b_local = [None if t is None else self.shard(t, s, 0) for s, t in enumerate(b)]
        self.lora.set_slot(slot, a_local, b_local, scale)

    def clear_lora(self, slot: int) -> None:
        if self.lora is not None:
            self.lora.clear_slot(slot)

    # ---- compute ----

    def forward(self, x: torch.Tensor, lora: AdapterGroups | None = None) -> torch.Tensor:
        y, pending = self.forward_unexpanded(x, lora)
        if pending is None:
            return y
        return self.backend.lora_expand(y, pending.shrink_out, pending.lora_b, lora,
                                        pending.slice_offsets, slot_ranks=pending.slot_ranks)

    def forward_unexpanded(
        self, x: torch.Tensor, lora: AdapterGroups | None = None
    ) -> tuple[torch.Tensor, PendingLoRA | None]:
        """(x W^T (+ b), the LoRA term still to expand into it, or None without LoRA): for a
        consumer that fuses the expand into its own op (``GatedMLP``)."""
        if self.lora is None or lora is None:
            return self.gemm(x, self.weight, self.bias), None
        if self.gemm_weight is not None:
            n = self.weight.shape[0]
            y_cat = self.gemm(x, self.gemm_weight, self.gemm_bias,
                              slot_columns=self.lora.slot_columns(n, lora))
            y, h = self.lora.split_in_gemm(y_cat, n)
        else:
            y, h = self.lora.shrink_beside(
                x, lambda: self.gemm(x, self.weight, self.bias), lora, self.backend)
        if self.lora_observer is not None:
            self.lora_observer(self, x, h, lora)
        return y, PendingLoRA(h, self.lora.lora_b, self.lora.slice_offsets,
                              self.lora.lora_rank)

    def _check_slice(self, slice_index: int) -> None:
        if not 0 <= slice_index < len(self.output_sizes):
            raise ValueError(
                f"slice_index {slice_index} is outside [0, {len(self.output_sizes) - 1}]"
            )

    def extra_repr(self) -> str:
        lora = f", lora={self.lora.config}" if self.lora is not None else ""
        return (f"in={self.input_size}, out={list(self.output_sizes)}, "
                f"bias={self.bias is not None}{lora}")


class Linear(LinearBase):
    """One projection: o_proj, down_proj, the LM head."""

    def __init__(self, input_size: int, output_size: int, **kwargs) -> None:
        super().__init__(input_size, (output_size,), **kwargs)


class MergedLinear(LinearBase):
    """Several projections of one input fused along the output axis (q|k|v, gate|up)."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], **kwargs) -> None:
        super().__init__(input_size, output_sizes, **kwargs)
