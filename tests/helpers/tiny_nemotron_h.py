"""Tiny random Nemotron-H checkpoints (transformers 5.x) and their LoRA adapters, for tests.

Widths are not powers of two (hidden 72, d_inner 60, conv 108, state 12; attention heads of
16, the attention kernels' power of two), the chunk size (8) is smaller than the prompts, and
the pattern has several Mamba and attention layers. dt_bias is drawn so that dt stays far
above transformers' prefill clamp (time_step_min), which its one-token path does not apply:
with it, the oracle's prefill and decode are one function, as detlora's are.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

PATTERN = "M-M*-M*M"
NEMOTRON_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "in_proj"]


def nemotron_config(**overrides):
    from transformers import NemotronHConfig

    cfg = dict(hidden_size=72, hybrid_override_pattern=PATTERN, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, intermediate_size=120, mamba_num_heads=6,
               mamba_head_dim=10, n_groups=2, ssm_state_size=12, chunk_size=8, vocab_size=128,
               max_position_embeddings=256, initializer_range=0.1, time_step_min=1e-6,
               bos_token_id=0, eos_token_id=1, pad_token_id=0, use_mamba_kernels=False)
    cfg |= overrides
    return NemotronHConfig(**cfg)


def make_nemotron_h(path: Path, *, seed: int = 0, **overrides) -> Path:
    """Save a random tiny NemotronHForCausalLM with save_pretrained (``backbone.*`` keys)."""
    from transformers import NemotronHForCausalLM

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = NemotronHForCausalLM(nemotron_config(**overrides)).eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=g))  # dt = softplus(...) >> 1e-6
            elif name.endswith(".D"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("conv1d.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(path)
    return path


def make_nemotron_adapter(base_dir: Path, path: Path, *, r: int = 8, alpha: float = 16,
                          targets: list[str] | None = None, seed: int = 1) -> Path:
    """A PEFT LoRA adapter (random non-zero A and B) on ``targets`` (default: q/k/v/o,
    up/down and the Mamba in_proj, whose B rows land in the fused [z | xBC | dt] output)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForCausalLM.from_pretrained(base_dir)
        peft_model = get_peft_model(base, LoraConfig(
            r=r, lora_alpha=alpha, target_modules=targets or NEMOTRON_TARGETS,
            lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    peft_model.save_pretrained(path)
    return path


def write_out_proj_adapter(base_dir: Path, path: Path, *, r: int = 4, alpha: float = 8,
                           seed: int = 3) -> tuple[Path, dict[str, torch.Tensor]]:
    """An adapter on the Mamba out_proj only (PEFT refuses to make one), written by hand;
    also returns each targeted weight's merged delta ``scale * B @ A`` by transformers name."""
    from safetensors.torch import save_file

    cfg = json.loads((base_dir / "config.json").read_text())
    pattern = cfg.get("hybrid_override_pattern") or "".join(
        {"linear_attention": "M", "full_attention": "*", "mlp": "-"}[t]
        for t in cfg["layers_block_type"])
    d_inner, hidden = cfg["mamba_num_heads"] * cfg["mamba_head_dim"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for i, kind in enumerate(pattern):
        if kind != "M":
            continue
        name = f"model.layers.{i}.mixer.out_proj"
        a = torch.randn(r, d_inner, generator=g) * 0.1
        b = torch.randn(hidden, r, generator=g) * 0.1
        tensors[f"base_model.model.{name}.lora_A.weight"] = a
        tensors[f"base_model.model.{name}.lora_B.weight"] = b
        deltas[f"{name}.weight"] = (alpha / r) * b @ a
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["out_proj"],
         "bias": "none"}))
    return path, deltas


def hf_model(base_dir: Path, adapter: Path | None = None,
             deltas: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """transformers' NemotronH on its torch path (fp32, eager attention), with a PEFT adapter
    or merged weight deltas."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                     attn_implementation="eager")
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter)
    if deltas:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, delta in deltas.items():
                params[name].add_(delta)
    return model.eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int
              ) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from transformers' generate (a cache: the chunked
    scan for the prompt, the one-token update after it)."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=None, output_scores=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item()
                for s, t in zip(out.scores, tokens, strict=True)]
    return tokens, logprobs
