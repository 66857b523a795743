"""Test helpers: tiny models built from a spec (no checkpoint needed) and PEFT-format adapter
directories written directly, so every field of adapter_config.json can be set at will."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from detlora.layers.backend import make_backend
from detlora.layers.lora_slots import LoRAConfig
from detlora.models.llama import LlamaForCausalLM
from detlora.models.spec import ModelSpec

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 64}
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_model(max_loras: int = 2, max_rank: int = 8) -> LlamaForCausalLM:
    return LlamaForCausalLM(ModelSpec.from_config(CONFIG), backend=make_backend("cpu"),
                            lora=LoRAConfig(max_loras, max_rank))


def module_shapes() -> dict[str, tuple[int, int]]:
    return tiny_model(1, 1).lora_target_shapes()


def write_adapter(path: Path, *, r: int = 8, alpha: float = 16, targets=None, layers=(0, 1),
                  seed: int = 0, ranks: dict[str, int] | None = None, extra_tensors=None,
                  drop: tuple[str, ...] = (), **config) -> Path:
    """An adapter in PEFT's on-disk format. ``ranks`` overrides the rank of modules whose
    name ends with a key (for rank_pattern tests); ``drop`` leaves out tensors by key."""
    path.mkdir(parents=True, exist_ok=True)
    targets = SEVEN if targets is None else targets
    shapes = module_shapes()
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (fin, fout) in shapes.items():
        layer = int(name.split(".")[2])
        short = name.rsplit(".", 1)[-1]
        if short not in targets or layer not in layers:
            continue
        rank = next((v for k, v in (ranks or {}).items() if name.endswith(k)), r)
        key = f"base_model.model.{name}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=g)
        tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=g)
    for k in drop:
        tensors.pop(k)
    tensors |= extra_tensors or {}
    save_file(tensors, path / "adapter_model.safetensors")
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
           "bias": "none", "use_dora": False, "use_rslora": False, "modules_to_save": None,
           "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
           "fan_in_fan_out": False, "lora_dropout": 0.0}
    cfg.update(config)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path
