"""Test helpers: tiny random Hugging Face checkpoints, PEFT adapters with non-zero B, the
HF(+PEFT) reference logits, and ForwardBatches built by hand over a paged KV cache.

Imported by tests/models (its conftest puts this directory on sys.path) and, by file path,
by tests/gpu.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from detlora.layers.forward_batch import AttentionMetadata, ForwardBatch, LoRABatch
from detlora.ops.adapter_groups import group_tokens

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


# Adapter targets of the families whose HF modules fuse q|k|v and gate|up.
FUSED_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
# The bases of issue 45 at widths real models have, not powers of two (hidden 96, MLP 200).
BASES = ("qwen2", "mistral", "phi3")


def longrope_parameters(head_dim: int, original: int, seed: int = 3) -> dict:
    """Phi-3 LongRoPE rotary fields with random short (near 1) and long (1-8) factors."""
    g = torch.Generator().manual_seed(seed)
    half = head_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": (1 + 0.2 * torch.rand(half, generator=g)).tolist(),
            "long_factor": (1 + 7 * torch.rand(half, generator=g)).tolist(),
            "original_max_position_embeddings": original}


def make_base_checkpoint(path: Path, arch: str, *, seed: int = 0, **overrides) -> Path:
    """A random tiny Qwen2 (q/k/v biases drawn large), Mistral (head_dim 32, not hidden /
    heads) or Phi-3 (fused qkv_proj / gate_up_proj) checkpoint, saved by transformers."""
    from transformers import (
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, vocab_size=320,
                  max_position_embeddings=128, initializer_range=0.1, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**{**common, "rope_theta": 1e6, **overrides}))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**{
            **common, "num_attention_heads": 4, "head_dim": 32, "sliding_window": None,
            **overrides}))
    elif arch == "phi3":
        model = Phi3ForCausalLM(Phi3Config(**{**common, **overrides}))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # random norm weights: a dropped norm shows
                p.uniform_(0.5, 1.5)
            elif name.endswith("_proj.bias"):  # biases that move logits far past tolerance
                p.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return path


def make_checkpoint(path: Path, arch: str, *, tie: bool = False, rope_scaling: bool = False,
                    seed: int = 0, **overrides) -> Path:
    """Save a random tiny model (hidden 64, 2 layers, GQA 4/2) with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if arch in BASES:
        return make_base_checkpoint(path, arch, seed=seed, tie_word_embeddings=tie,
                                    **overrides)
    torch.manual_seed(seed)
    # A larger init than HF's 0.02 so attention is far from uniform and errors show.
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                  max_position_embeddings=128, initializer_range=0.1, rms_norm_eps=1e-5,
                  tie_word_embeddings=tie)
    common |= overrides
    if arch == "llama":
        if rope_scaling:
            common["rope_scaling"] = dict(LLAMA3_ROPE)
        model = LlamaForCausalLM(LlamaConfig(rope_theta=500000.0, **common))
    elif arch == "qwen3":
        # head_dim 32: q/k/v widths (128/64/64) differ from hidden (64).
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=32, **common))
    else:
        raise ValueError(arch)
    with torch.no_grad():  # random norm weights, so a dropped norm cannot hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def make_adapter(base_dir: Path, path: Path, *, r: int = 8, alpha: float = 16,
                 targets: list[str] | None = None, use_rslora: bool = False,
                 seed: int = 1, **lora_kwargs) -> Path:
    """A PEFT LoRA adapter for the checkpoint at ``base_dir``, with random non-zero B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS,
                     use_rslora=use_rslora, lora_dropout=0.0, **lora_kwargs)
    peft_model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:  # PEFT initialises B to zero
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    peft_model.save_pretrained(path)
    return path


def write_random_checkpoint(path: Path, arch: str, *, tie: bool = False,
                            rope_scaling: bool = False, seed: int = 0, **overrides) -> Path:
    """make_checkpoint's shapes (or others: ``overrides`` of config.json's fields), written
    without transformers (for machines without it): config.json and model.safetensors with
    the weight names the loader expects."""
    from safetensors.torch import save_file

    from detlora.layers.backend import make_backend
    from detlora.models.loader import ARCHITECTURES
    from detlora.models.spec import ModelSpec

    name = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    cfg = dict(architectures=[name], model_type=arch, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=320, max_position_embeddings=128, rms_norm_eps=1e-5,
               tie_word_embeddings=tie, hidden_act="silu", dtype="float32",
               rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    if arch == "qwen3":
        cfg |= dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    if rope_scaling:
        cfg["rope_parameters"] = {**LLAMA3_ROPE, "rope_theta": 500000.0}
    cfg |= overrides
    spec = ModelSpec.from_config(cfg)
    shapes = ARCHITECTURES[name](spec, backend=make_backend("cpu")).hf_weights()
    g = torch.Generator().manual_seed(seed)
    tensors = {
        n: (torch.rand(shape, generator=g) + 0.5 if n.endswith("norm.weight")
            else torch.randn(shape, generator=g) * 0.1)
        for n, (shape, _) in shapes.items()
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def write_random_adapter(base_dir: Path, path: Path, *, r: int = 8, alpha: float = 16,
                         targets: list[str] | None = None, use_rslora: bool = False,
                         seed: int = 1) -> Path:
    """make_adapter's format, written without peft: adapter_config.json and
    adapter_model.safetensors with random non-zero A and B."""
    from safetensors.torch import save_file

    from detlora.layers.backend import make_backend
    from detlora.models.loader import ARCHITECTURES
    from detlora.models.spec import ModelSpec

    spec = ModelSpec.from_dir(base_dir)
    model = ARCHITECTURES[spec.architecture](spec, backend=make_backend("cpu"))
    targets = targets or ALL_TARGETS
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (fin, fout) in model.lora_target_shapes().items():
        if name.rsplit(".", 1)[-1] in targets:
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, fin, generator=g) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(fout, r, generator=g) * 0.1
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets,
           "use_rslora": use_rslora, "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


class HFReference:
    """Full-sequence logits from transformers (+PEFT), fp32, eager attention."""

    def __init__(self, base_dir: Path, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> None:
        self.base_dir, self.dtype, self.device = base_dir, dtype, device
        self._models: dict[Path | None, torch.nn.Module] = {}

    def model(self, adapter: Path | None) -> torch.nn.Module:
        if adapter not in self._models:
            from transformers import AutoModelForCausalLM

            m = AutoModelForCausalLM.from_pretrained(
                self.base_dir, dtype=self.dtype, attn_implementation="eager"
            )
            if adapter is not None:
                from peft import PeftModel

                m = PeftModel.from_pretrained(m, adapter)
            self._models[adapter] = m.to(self.device).eval()
        return self._models[adapter]

    @torch.no_grad()
    def logits(self, ids: list[int], adapter: Path | None = None) -> torch.Tensor:
        x = torch.tensor([ids], device=self.device)
        return self.model(adapter)(input_ids=x).logits[0].float()


@dataclass
class PagedKV:
    """Hands out shuffled pages to sequences and builds ForwardBatches by hand."""

    num_blocks: int
    block_size: int
    seed: int = 0
    device: str = "cpu"
    tables: dict[int, list[int]] = field(default_factory=dict)
    lens: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        self._free = torch.randperm(self.num_blocks, generator=g).tolist()

    def step(self, chunks: dict[int, list[int]], slots: dict[int, int] | None = None,
             max_loras: int = 1, logits: str = "all") -> ForwardBatch:
        """One engine step: sequence ``sid`` appends the tokens ``chunks[sid]``.

        ``slots`` gives each sequence's adapter slot (-1 / missing = none; None = no LoRA
        batch at all). ``logits``: "all" rows or each sequence's "last" row.
        """
        ids, pos, slot_map, q_start, seq_lens, token_slots, last = [], [], [], [0], [], [], []
        for sid, toks in chunks.items():
            table = self.tables.setdefault(sid, [])
            past = self.lens.get(sid, 0)
            total = past + len(toks)
            while len(table) * self.block_size < total:
                table.append(self._free.pop())
            for p in range(past, total):
                pos.append(p)
                slot_map.append(table[p // self.block_size] * self.block_size
                                + p % self.block_size)
            ids += toks
            self.lens[sid] = total
            seq_lens.append(total)
            q_start.append(q_start[-1] + len(toks))
            last.append(q_start[-1] - 1)
            token_slots += [(slots or {}).get(sid, -1)] * len(toks)
        width = max(len(self.tables[s]) for s in chunks)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in chunks]
        dev = self.device
        i32 = dict(dtype=torch.int32, device=dev)
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slot_map, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, **i32),
            seq_lens=torch.tensor(seq_lens, **i32),
            query_start_loc=torch.tensor(q_start, **i32),
            max_query_len=max(len(t) for t in chunks.values()),
            max_seq_len=max(seq_lens),
        )
        rows = list(range(len(ids))) if logits == "all" else last
        lora = None
        if slots is not None:
            lora = LoRABatch(group_tokens(torch.tensor(token_slots, **i32), max_loras))
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            attn=attn,
            logits_indices=torch.tensor(rows, dtype=torch.int64, device=dev),
            lora=lora,
        )


def split_rows(logits: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """Cut stacked per-token logits back into one block per sequence."""
    bounds = [0, *itertools.accumulate(lengths)]
    return [logits[a:b] for a, b in itertools.pairwise(bounds)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference relative to the reference's largest logit."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())
