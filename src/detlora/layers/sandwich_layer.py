"""Gemma's transformer block: attention and MLP each between a pre-norm and a post-norm
("sandwich" norms), the residual adds outside both, then optionally Gemma 4's per-layer-input
branch and a scalar on the whole residual stream.

    h = post_attention_norm(attn(input_norm(x)));          x = x + h
    h = post_feedforward_norm(mlp(pre_feedforward_norm(x))); x = x + h
    per-layer input (Gemma 4):  x = x + post_per_layer_norm(projection(gelu_tanh(gate(x)) * p))
    layer scalar (Gemma 4):     x = x * layer_scalar

Every add and scale rounds to the model dtype once, as HF's do. Without the last two steps
(Gemma 3) the final add is left to the next norm (fused), as in ``DecoderLayer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from detlora.layers.attention import Attention
from detlora.layers.backend import OpBackend
from detlora.layers.linear import Linear
from detlora.layers.mlp import GatedMLP
from detlora.layers.norm import RMSNorm
from detlora.ops.adapter_groups import AdapterGroups

if TYPE_CHECKING:  # the contract lives in models/; layers only read it
    from detlora.layers.forward_batch import AttentionMetadata


class PerLayerInputBranch(nn.Module):
    """Gemma 4's per-layer-input branch: gate (H -> P), GeGLU with the layer's per-layer
    input, projection (P -> H), RMSNorm. Both linears take LoRA (PEFT names
    ``per_layer_input_gate`` and ``per_layer_projection``)."""

    def __init__(self, hidden_size: int, size: int, eps: float, *, backend: OpBackend,
                 dtype: torch.dtype, device: torch.device | str | None, lora,
                 unit_offset: bool = False) -> None:
        super().__init__()
        self.backend = backend
        common = dict(backend=backend, dtype=dtype, device=device, lora=lora)
        self.per_layer_input_gate = Linear(hidden_size, size, **common)
        self.per_layer_projection = Linear(size, hidden_size, **common)
        self.post_per_layer_input_norm = RMSNorm(hidden_size, eps, backend=backend,
                                                 dtype=dtype, device=device,
                                                 unit_offset=unit_offset)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor,
                lora: AdapterGroups | None) -> torch.Tensor:
        assert self.backend.gelu_tanh_mul is not None
        g = self.backend.gelu_tanh_mul(self.per_layer_input_gate(x, lora), per_layer_input)
        return self.post_per_layer_input_norm(self.per_layer_projection(g, lora))


class SandwichDecoderLayer(nn.Module):
    def __init__(
        self,
        self_attn: Attention,
        mlp: GatedMLP,
        norms: tuple[RMSNorm, RMSNorm, RMSNorm, RMSNorm],
        *,
        per_layer: PerLayerInputBranch | None = None,
        layer_scalar: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        """``norms``: input, post-attention, pre-feedforward, post-feedforward."""
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
         self.post_feedforward_layernorm) = norms
        self.per_layer = per_layer
        # Loaded from the checkpoint (HF's ``layer_scalar`` buffer); 1 is HF's initial value.
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=dtype, device=device),
                                         requires_grad=False) if layer_scalar else None

    def load_layer_scalar(self, tensor: torch.Tensor) -> None:
        if self.layer_scalar is None or tuple(tensor.shape) != (1,):
            raise ValueError(f"layer_scalar must have shape (1,), got {tuple(tensor.shape)}")
        with torch.no_grad():
            self.layer_scalar.copy_(tensor)

    @property
    def closes_stream(self) -> bool:
        """Whether the layer adds its last branch itself (returns residual None)."""
        return self.per_layer is not None or self.layer_scalar is not None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        lora: AdapterGroups | None = None,
        per_layer_input: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, residual): the next norm adds them (residual None: output is the
        stream itself)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, positions, attn, lora))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        h = self.post_feedforward_layernorm(self.mlp(h, lora))
        if not self.closes_stream:
            return h, residual
        x = residual + h
        if self.per_layer is not None:
            assert per_layer_input is not None
            x = x + self.per_layer(x, per_layer_input, lora)
        if self.layer_scalar is not None:
            x = x * self.layer_scalar
        return x, None
