"""One pre-norm transformer block: attention and MLP, each behind an RMSNorm whose residual
add is fused into it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from detlora.layers.attention import Attention
from detlora.layers.mlp import GatedMLP
from detlora.layers.norm import RMSNorm
from detlora.ops.adapter_groups import AdapterGroups

if TYPE_CHECKING:  # the contract lives in models/; layers only read it
    from detlora.layers.forward_batch import AttentionMetadata


class DecoderLayer(nn.Module):
    def __init__(
        self,
        self_attn: Attention,
        mlp: GatedMLP,
        input_layernorm: RMSNorm,
        post_attention_layernorm: RMSNorm,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        lora: AdapterGroups | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this block's MLP output, the residual stream before it); the next norm
        adds them, so the residual is never added twice."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, attn, lora)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, lora), residual
