"""The state cache of hybrid models: per Mamba-2 layer, one slot per running sequence.

Beside the paged KV cache (attention layers), each Mamba layer keeps for every slot its conv
state [K - 1, conv_dim], its SSM state at the start of the open chunk [H, P, N] in fp32 and
the open chunk's rows [chunk_size, conv_dim + H] (``layers/mamba_mixer.py``). One allocation
per kind for every layer, made once, so CUDA graphs would see fixed addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from detlora.models.spec import ModelSpec


@dataclass(frozen=True)
class StateCache:
    conv: tuple[torch.Tensor, ...]  # per Mamba layer [S, K - 1, conv_dim], model dtype
    ssm: tuple[torch.Tensor, ...]  # per Mamba layer [S, H, P, N], fp32
    chunk: tuple[torch.Tensor, ...]  # per Mamba layer [S, chunk_size, conv_dim + H]

    @property
    def num_slots(self) -> int:
        return self.ssm[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv, *self.ssm, *self.chunk))

    @classmethod
    def allocate(cls, spec: ModelSpec, num_slots: int, *, dtype: torch.dtype,
                 device: torch.device | str) -> StateCache:
        h = spec.hybrid
        if h is None:
            raise ValueError(f"{spec.architecture} has no state-space layers")
        if num_slots < 1:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        n = h.num_mamba_layers
        conv = torch.zeros(n, num_slots, h.conv_kernel - 1, h.conv_dim, dtype=dtype,
                           device=device)
        ssm = torch.zeros(n, num_slots, h.mamba_num_heads, h.mamba_head_dim, h.ssm_state_size,
                          dtype=torch.float32, device=device)
        chunk = torch.zeros(n, num_slots, h.chunk_size, h.conv_dim + h.mamba_num_heads,
                            dtype=dtype, device=device)
        return cls(tuple(conv.unbind(0)), tuple(ssm.unbind(0)), tuple(chunk.unbind(0)))


def state_bytes_per_slot(spec: ModelSpec, dtype: torch.dtype) -> int:
    """Bytes of one slot over all Mamba layers (0 for models without them)."""
    if spec.hybrid is None:
        return 0
    return spec.hybrid.state_bytes_per_sequence(torch.empty(0, dtype=dtype).element_size())
