"""Mamba-2 mixer: in_proj -> [z | xBC | dt], causal conv over xBC, the chunked selective scan
on the fixed chunk grid, the gated grouped RMSNorm, out_proj.

The layer's per-sequence state lives in slots the engine hands out (``bind_state``): the
conv state (the last K - 1 inputs of the conv), the SSM state at the start of the open
chunk (fp32) and the open chunk's rows ([xBC after the conv | raw dt]). Every position is
computed by the chunk formula of ``detlora.ops.mamba_ssd`` from its chunk's rows and the state
at the chunk's start, so a prompt in one step, in pieces, or decoded a token at a time gives
the same bits (docs/design.md, "Hybrid models: the state cache and the chunk grid").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from detlora.layers.backend import OpBackend
from detlora.layers.lora_slots import LoRAConfig
from detlora.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from detlora.ops.adapter_groups import AdapterGroups

if TYPE_CHECKING:  # the contract lives in layers/forward_batch.py; layers only read it
    from detlora.layers.forward_batch import MambaMetadata


class MambaMixer(nn.Module):
    """One Mamba-2 mixer of ``num_heads`` heads of ``head_dim``, ``n_groups`` groups of B and
    C of ``d_state``, a depthwise conv of ``conv_kernel`` taps and chunks of ``chunk_size``."""

    def __init__(
        self,
        hidden_size: int,
        *,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        d_state: int,
        conv_kernel: int,
        chunk_size: int,
        eps: float,
        backend: OpBackend,
        conv_bias: bool = True,
        proj_bias: bool = False,
        dt_limit: tuple[float, float] = (0.0, math.inf),
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        lora: LoRAConfig | None = None,
    ) -> None:
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"mamba heads {num_heads} must be a multiple of n_groups {n_groups}")
        if conv_kernel < 2:
            raise ValueError(f"conv_kernel must be at least 2, got {conv_kernel}")
        self.backend = backend
        self.num_heads, self.head_dim = num_heads, head_dim
        self.n_groups, self.d_state = n_groups, d_state
        self.conv_kernel, self.chunk_size = conv_kernel, chunk_size
        self.eps, self.dt_limit = float(eps), (float(dt_limit[0]), float(dt_limit[1]))
        self.d_inner = num_heads * head_dim
        self.conv_dim = self.d_inner + 2 * n_groups * d_state
        common = dict(backend=backend, bias=proj_bias, dtype=dtype, device=device, lora=lora)
        self.in_proj = ColumnParallelLinear(
            hidden_size, (2 * self.d_inner + 2 * n_groups * d_state + num_heads,), **common)
        self.out_proj = RowParallelLinear(self.d_inner, hidden_size, **common)
        f32 = dict(dtype=torch.float32, device=device)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel, dtype=dtype,
                                                    device=device), requires_grad=False)
        self.conv_bias = (nn.Parameter(torch.empty(self.conv_dim, dtype=dtype, device=device),
                                       requires_grad=False) if conv_bias else None)
        # A = -exp(A_log), D and dt_bias in fp32, from the checkpoint's values in the model
        # dtype (what transformers computes with).
        self.register_buffer("a", torch.empty(num_heads, **f32))
        self.register_buffer("d", torch.empty(num_heads, **f32))
        self.register_buffer("dt_bias", torch.empty(num_heads, **f32))
        self.norm_weight = nn.Parameter(torch.empty(self.d_inner, dtype=dtype, device=device),
                                        requires_grad=False)
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        self.chunk_buf: torch.Tensor | None = None

    # ---- loading ----

    def load_conv_weight(self, tensor: torch.Tensor) -> None:
        """The checkpoint's [conv_dim, 1, K] depthwise kernel."""
        with torch.no_grad():
            self.conv_weight.copy_(tensor.reshape(self.conv_dim, self.conv_kernel))

    def load_conv_bias(self, tensor: torch.Tensor) -> None:
        assert self.conv_bias is not None
        with torch.no_grad():
            self.conv_bias.copy_(tensor)

    def load_a_log(self, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            self.a.copy_(-torch.exp(tensor.float()))

    def load_d(self, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            self.d.copy_(tensor.float())

    def load_dt_bias(self, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            self.dt_bias.copy_(tensor.float())

    def load_norm_weight(self, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            self.norm_weight.copy_(tensor)

    # ---- state ----

    def state_shapes(self, num_slots: int) -> dict[str, tuple[tuple[int, ...], bool]]:
        """name -> (shape, fp32?) of the state buffers of ``num_slots`` slots."""
        return {
            "conv_state": ((num_slots, self.conv_kernel - 1, self.conv_dim), False),
            "ssm_state": ((num_slots, self.num_heads, self.head_dim, self.d_state), True),
            "chunk_buf": ((num_slots, self.chunk_size, self.conv_dim + self.num_heads), False),
        }

    def bind_state(self, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                   chunk_buf: torch.Tensor) -> None:
        num = conv_state.shape[0]
        given = {"conv_state": conv_state, "ssm_state": ssm_state, "chunk_buf": chunk_buf}
        for name, (shape, _) in self.state_shapes(num).items():
            if tuple(given[name].shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got "
                                 f"{tuple(given[name].shape)}")
        self.conv_state, self.ssm_state, self.chunk_buf = conv_state, ssm_state, chunk_buf

    def release_state(self) -> None:
        self.conv_state = self.ssm_state = self.chunk_buf = None

    # ---- compute ----

    def forward(self, x: torch.Tensor, meta: MambaMetadata,
                lora: AdapterGroups | None = None) -> torch.Tensor:
        if self.conv_state is None or self.ssm_state is None or self.chunk_buf is None:
            raise ValueError("no state cache bound: call the model's allocate_state_cache "
                             "first")
        zxbcdt = self.in_proj(x, lora)
        di, cd = self.d_inner, self.conv_dim
        z, xbc, dt = zxbcdt[:, :di], zxbcdt[:, di:di + cd], zxbcdt[:, di + cd:]
        b = self.backend
        xbc = b.causal_conv1d(xbc, self.conv_weight, self.conv_bias, self.conv_state,
                              meta.state_slots, meta.seq_start, meta.query_start_loc,
                              meta.token_seq)
        y = b.mamba_chunk_scan(xbc, dt, self.a, self.d, self.dt_bias, self.ssm_state,
                               self.chunk_buf, meta.plan, head_dim=self.head_dim,
                               n_groups=self.n_groups, dt_limit=self.dt_limit)
        h = b.gated_rms_norm(y, z, self.norm_weight, self.d_inner // self.n_groups, self.eps)
        return self.out_proj(h, lora)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, groups={self.n_groups}, "
                f"d_state={self.d_state}, conv={self.conv_kernel}, chunk={self.chunk_size}")
