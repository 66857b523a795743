"""The study's default adapter: rank 16 on all seven projections, seeded, non-zero A and B.

Written as a PEFT directory (adapter_config.json + adapter_model.safetensors) for any
Llama-like model directory, so a user's model goes through the study without an adapter of
its own. A has entries of scale 1/sqrt(in) (x A^T of a normalised input is O(1)) and B of
scale ``b_std``, small enough to leave the base model's answers mostly intact and large
enough that the LoRA term reaches the outputs' bits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from detlora.models.spec import ModelSpec

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_default_adapter(model_dir: str | Path, out_dir: str | Path, *, rank: int = 16,
                          alpha: int = 32, seed: int = 0, b_std: float = 0.01) -> Path:
    """Write the adapter for the model in ``model_dir`` into ``out_dir``; returns it."""
    from safetensors.torch import save_file

    spec = ModelSpec.from_dir(model_dir)
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dims = {"q_proj": (spec.hidden_size, spec.q_size), "k_proj": (spec.hidden_size, spec.kv_size),
            "v_proj": (spec.hidden_size, spec.kv_size), "o_proj": (spec.q_size, spec.hidden_size),
            "gate_proj": (spec.hidden_size, spec.intermediate_size),
            "up_proj": (spec.hidden_size, spec.intermediate_size),
            "down_proj": (spec.intermediate_size, spec.hidden_size)}
    g = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for layer in range(spec.num_layers):
        for name in TARGETS:
            fin, fout = dims[name]
            part = "self_attn" if name in _ATTENTION else "mlp"
            p = f"base_model.model.model.layers.{layer}.{part}.{name}."
            weights[p + "lora_A.weight"] = (torch.randn(rank, fin, generator=g)
                                            / fin ** 0.5).to(torch.bfloat16)
            weights[p + "lora_B.weight"] = (torch.randn(fout, rank, generator=g)
                                            * b_std).to(torch.bfloat16)
    save_file(weights, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
              "target_modules": list(TARGETS), "lora_dropout": 0.0, "bias": "none",
              "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir)}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out


def adapter_rank(adapter_dir: str | Path) -> int:
    """``r`` of a PEFT adapter directory (the largest of its rank_pattern too)."""
    path = Path(adapter_dir) / "adapter_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"adapter directory {adapter_dir} has no adapter_config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    ranks = [cfg.get("r"), *(cfg.get("rank_pattern") or {}).values()]
    ranks = [r for r in ranks if isinstance(r, int) and not isinstance(r, bool) and r > 0]
    if not ranks:
        raise ValueError(f"{path} names no positive rank r")
    return max(ranks)
