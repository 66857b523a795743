"""Gated MLP: fused gate|up projection, act(gate) * up (with the gate|up LoRA expand), down
projection; act is SiLU (SwiGLU: Llama, Qwen3) or tanh-approximated GELU (GeGLU: Gemma)."""

from __future__ import annotations

import torch
from torch import nn

from detlora.distributed.group import TensorParallelGroup
from detlora.layers.backend import OpBackend
from detlora.layers.lora_slots import LoRAConfig
from detlora.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from detlora.ops.adapter_groups import AdapterGroups


class GatedMLP(nn.Module):
    """With a tensor-parallel group, this rank holds a share of the intermediate columns:
    gate|up column-parallel (the activation is elementwise), down row-parallel."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        backend: OpBackend,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        lora: LoRAConfig | None = None,
        tp: TensorParallelGroup | None = None,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation must be 'silu' or 'gelu_tanh', got {activation!r}")
        self.backend = backend
        self.activation = activation
        common = dict(backend=backend, bias=bias, dtype=dtype, device=device, lora=lora, tp=tp)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, (intermediate_size,) * 2,
                                                 **common)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, **common)

    def forward(self, x: torch.Tensor, lora: AdapterGroups | None = None) -> torch.Tensor:
        gate_up, pending = self.gate_up_proj.forward_unexpanded(x, lora)
        if pending is None:
            h = self.backend.act_and_mul(self.activation, gate_up)
        else:  # the gate|up expand fused into the activation where it can be: same bits
            h = self.backend.expand_act_and_mul(self.activation, gate_up, pending.shrink_out,
                                                pending.lora_b, lora,
                                                slot_ranks=pending.slot_ranks)
        return self.down_proj(h, lora)
