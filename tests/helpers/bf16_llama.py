"""A random bf16 Llama checkpoint written directly with safetensors (no transformers model
built): the GPU tests' engine models, sized by the caller."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def write_bf16_llama(path: Path, *, vocab: int, hidden: int, layers: int, heads: int,
                     kv_heads: int, head_dim: int, inter: int, proj_std: float,
                     down_std: float, head_dim_in_config: bool = False, seed: int = 0) -> None:
    """Weights ~ N(0, std^2) in bf16 (norms 1 + N(0, 0.01), embeddings N(0, 1), an untied LM
    head N(0, 0.01)) drawn in one fixed order from ``seed``, and a config.json to match."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    q, kv = heads * head_dim, kv_heads * head_dim

    def rnd(*size: int, std: float) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * std).to(torch.bfloat16)

    w = {"model.embed_tokens.weight": rnd(vocab, hidden, std=1.0),
         "model.norm.weight": 1 + rnd(hidden, std=0.1),
         "lm_head.weight": rnd(vocab, hidden, std=0.1)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + rnd(hidden, std=0.1),
              p + "post_attention_layernorm.weight": 1 + rnd(hidden, std=0.1),
              p + "self_attn.q_proj.weight": rnd(q, hidden, std=proj_std),
              p + "self_attn.k_proj.weight": rnd(kv, hidden, std=proj_std),
              p + "self_attn.v_proj.weight": rnd(kv, hidden, std=proj_std),
              p + "self_attn.o_proj.weight": rnd(hidden, q, std=proj_std),
              p + "mlp.gate_proj.weight": rnd(inter, hidden, std=proj_std),
              p + "mlp.up_proj.weight": rnd(inter, hidden, std=proj_std),
              p + "mlp.down_proj.weight": rnd(hidden, inter, std=down_std)}
    path.mkdir(parents=True)
    save_file(w, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "eos_token_id": 1, "bos_token_id": 0}
    if head_dim_in_config:
        config = {**dict(list(config.items())[:7]), "head_dim": head_dim,
                  **dict(list(config.items())[7:])}
    (path / "config.json").write_text(json.dumps(config))
