"""Tiny random Gemma 3 and Gemma 4 checkpoints (transformers 5.24) and PEFT adapters for them.

Gemma 4: six layers (sliding, sliding, full, sliding, sliding, full) with a sliding window of
8 keys (shorter than the test prompts), head_dim 16 on sliding layers and 32 on full ones,
the last two layers reading layers 3 and 2's K/V (num_kv_shared_layers=2), per-layer
embeddings of 12, a final soft-cap of 10, and random norm weights and layer scalars, so that
a dropped or misplaced one shows. Gemma 3: seven layers (5:1 sliding, then sliding), window
8, query_pre_attn_scalar 24, a linearly scaled global rotary table and random ``w`` of its
``1 + w`` norms. Widths 96 and 160: not powers of two.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

VOCAB = 128
GEMMA4_LAYERS = ["sliding_attention", "sliding_attention", "full_attention",
                 "sliding_attention", "sliding_attention", "full_attention"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PLE_TARGETS = ["per_layer_input_gate", "per_layer_projection", "per_layer_model_projection"]


def gemma4_text_config(**overrides) -> dict:
    cfg = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=6,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
               sliding_window=8, layer_types=list(GEMMA4_LAYERS), num_kv_shared_layers=2,
               hidden_size_per_layer_input=12, vocab_size_per_layer_input=VOCAB,
               final_logit_softcapping=10.0, max_position_embeddings=256,
               initializer_range=0.1, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    return cfg | overrides


def gemma3_text_config(**overrides) -> dict:
    cfg = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=7,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8,
               query_pre_attn_scalar=24, rope_scaling={"rope_type": "linear", "factor": 8.0},
               max_position_embeddings=256, initializer_range=0.1, bos_token_id=2,
               eos_token_id=1, pad_token_id=0)
    return cfg | overrides


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) * 0.8 + 0.6)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand(b.shape, generator=g) * 0.8 + 0.6)


def make_gemma4(path: Path, *, multimodal: bool = False, seed: int = 0, **overrides) -> Path:
    """A tiny Gemma4ForCausalLM (or Gemma4ForConditionalGeneration with tiny vision and
    audio towers) saved with save_pretrained."""
    from transformers import (
        Gemma4Config,
        Gemma4ForCausalLM,
        Gemma4ForConditionalGeneration,
        Gemma4TextConfig,
    )

    torch.manual_seed(seed)
    text = gemma4_text_config(**overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if multimodal:
            cfg = Gemma4Config(
                text_config=text,
                vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, head_dim=16),
                audio_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  output_proj_dims=32, subsampling_conv_channels=[8, 4]),
                image_token_id=120, video_token_id=121, audio_token_id=122,
                boi_token_id=123, eoi_token_id=124, boa_token_id=125, eoa_token_index=126)
            model = Gemma4ForConditionalGeneration(cfg)
        else:
            model = Gemma4ForCausalLM(Gemma4TextConfig(**text))
    _randomize(model, seed + 100)
    model.eval().save_pretrained(str(path))
    return path


def make_gemma3(path: Path, *, seed: int = 0, **overrides) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Gemma3ForCausalLM(Gemma3TextConfig(**gemma3_text_config(**overrides)))
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # Gemma 3 norms scale by 1 + w: random w around 0
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) - 0.5)
    model.eval().save_pretrained(str(path))
    return path


def make_gemma_adapter(base: Path, path: Path, *, targets: list[str] | str | None,
                       r: int = 8, alpha: float = 16, seed: int = 1) -> Path:
    """A PEFT LoRA adapter with random non-zero A and B (PEFT initialises B to zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(base))
        if json.loads((base / "config.json").read_text())["architectures"][0].endswith(
                "ConditionalGeneration"):
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_pretrained(str(base))
        peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha,
                                                      target_modules=targets,
                                                      lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    peft_model.save_pretrained(str(path))
    return path


class GroupedPagedKV:
    """``PagedKV`` (tests/helpers/tiny_hf.py) for a model with several KV groups: one page
    allocator per group, the batches merged into one ForwardBatch with the groups' slots and
    tables. In a window group the pages wholly before a sequence's first query window are
    poisoned with NaN in ``kv`` and left -1 in its table, as the engine releases them, so a
    read of one would show."""

    def __init__(self, model, num_blocks: int, block_size: int, seed: int = 0) -> None:
        from tests.helpers.tiny_hf import PagedKV

        self.model, self.block_size = model, block_size
        self.kv = model.allocate_kv_cache(num_blocks, block_size)
        self.groups = [PagedKV(num_blocks, block_size, seed=seed + g)
                       for g in range(len(model.kv_groups))]

    def step(self, chunks: dict[int, list[int]], slots: dict[int, int] | None = None,
             max_loras: int = 1, logits: str = "all"):
        import dataclasses

        batches = [p.step(chunks, slots, max_loras, logits) for p in self.groups]
        for g, group in enumerate(self.model.kv_groups):
            if group.window is None:
                continue
            tables = batches[g].attn.block_tables
            for row, (sid, toks) in enumerate(chunks.items()):
                first = self.groups[g].lens[sid] - len(toks)  # the step's first position
                for i in range(max(0, first - group.window + 1) // self.block_size):
                    page = int(tables[row, i])
                    if page >= 0:
                        for layer in group.layers:
                            self.kv.k[layer][page] = float("nan")
                            self.kv.v[layer][page] = float("nan")
                    tables[row, i] = -1
        attn = batches[0].attn
        if len(batches) > 1:
            attn = dataclasses.replace(
                attn, group_slot_mapping=torch.stack([b.attn.slot_mapping for b in batches[1:]]),
                group_block_tables=torch.stack([b.attn.block_tables for b in batches[1:]]))
        return dataclasses.replace(batches[0], attn=attn)
