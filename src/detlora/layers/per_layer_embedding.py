"""Gemma 4's per-layer embeddings (PLE): a second token embedding that holds a small input
for every decoder layer, mixed with a projection of the main embedding, computed once per
token before the first layer:

    tok  = embed_per_layer(ids) * sqrt(P)                    [T, L, P]  (scale in the dtype)
    proj = rms_norm(per_layer_model_projection(e) * H**-0.5)  [T, L, P]  (e: the scaled embedding)
    out  = (proj + tok) * 2**-0.5

with HF's roundings: sqrt(P) rounded to the model dtype before the multiply, the two Python
float scales applied in fp32 and rounded once. ``per_layer_model_projection`` takes LoRA.
"""

from __future__ import annotations

import torch
from torch import nn

from detlora.layers.backend import OpBackend
from detlora.layers.linear import Linear
from detlora.layers.lora_slots import LoRAConfig
from detlora.layers.norm import RMSNorm
from detlora.layers.vocab_parallel import VocabParallelEmbedding
from detlora.ops.adapter_groups import AdapterGroups


class PerLayerEmbedding(nn.Module):
    def __init__(self, vocab_size: int, num_layers: int, size: int, hidden_size: int,
                 eps: float, *, backend: OpBackend, dtype: torch.dtype,
                 device: torch.device | str | None, lora: LoRAConfig | None,
                 unit_offset: bool = False) -> None:
        super().__init__()
        self.num_layers, self.size, self.hidden_size = num_layers, size, hidden_size
        self.dtype = dtype
        self.embed_tokens_per_layer = VocabParallelEmbedding(
            vocab_size, num_layers * size, backend=backend, dtype=dtype, device=device)
        self.per_layer_model_projection = Linear(hidden_size, num_layers * size,
                                                 backend=backend, dtype=dtype, device=device,
                                                 lora=lora)
        self.per_layer_projection_norm = RMSNorm(size, eps, backend=backend, dtype=dtype,
                                                 device=device, unit_offset=unit_offset)
        self.register_buffer("token_scale", torch.tensor(size**0.5, device=device).to(dtype),
                             persistent=False)

    def forward(self, ids: torch.Tensor, embeds: torch.Tensor,
                lora: AdapterGroups | None) -> torch.Tensor:
        """[T, L, P]: every layer's input of each token (``embeds``: the scaled embedding)."""
        t = ids.shape[0]
        tok = self.embed_tokens_per_layer(ids) * self.token_scale
        proj = self.per_layer_model_projection(embeds, lora)
        proj = (proj.float() * self.hidden_size**-0.5).to(self.dtype)
        proj = self.per_layer_projection_norm(proj.view(t * self.num_layers, self.size))
        mixed = (proj.view(t, self.num_layers * self.size) + tok).float() * 2**-0.5
        return mixed.to(self.dtype).view(t, self.num_layers, self.size)
