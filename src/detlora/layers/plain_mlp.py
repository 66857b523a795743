"""Non-gated MLP: up projection, squared ReLU, down projection (Nemotron-H's ``-`` layers)."""

from __future__ import annotations

import torch
from torch import nn

from detlora.distributed.group import TensorParallelGroup
from detlora.layers.backend import OpBackend
from detlora.layers.lora_slots import LoRAConfig
from detlora.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from detlora.ops.adapter_groups import AdapterGroups


class PlainMLP(nn.Module):
    """``down(relu(up(x)) ** 2)``; up column-parallel, down row-parallel."""

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
    ) -> None:
        super().__init__()
        self.backend = backend
        common = dict(backend=backend, bias=bias, dtype=dtype, device=device, lora=lora, tp=tp)
        self.up_proj = ColumnParallelLinear(hidden_size, (intermediate_size,), **common)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, **common)

    def forward(self, x: torch.Tensor, lora: AdapterGroups | None = None) -> torch.Tensor:
        return self.down_proj(self.backend.relu_squared(self.up_proj(x, lora)), lora)
