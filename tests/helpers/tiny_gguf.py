"""Tiny GGUF files written with the ``gguf`` package, so GGUF conversion is tested without
downloading a model: a Llama file with random weights (Q8_0 where a row holds whole 32-value
blocks, F32 otherwise), a byte-level BPE tokenizer and a chat template; and any Qwen2 or
Phi-3 checkpoint as an F32 file under llama.cpp's names (``write_checkpoint_gguf``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 96, 2, 4, 2
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tiny_llama_gguf(path: Path, *, seed: int = 0) -> Path:
    """A tiny Llama GGUF at ``path``: 2 layers, hidden 64, GQA 4/2, 256 byte tokens plus a
    few merges and three special tokens."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = _byte_tokens()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n"]
    tokens += [m.replace(" ", "") for m in merges] + ["<|bos|>", "<|eos|>", "<|pad|>"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 3) + [3] * 3)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 2)
    w.add_pad_token_id(vocab - 1)
    w.add_chat_template(CHAT_TEMPLATE)

    def tensor(name: str, *shape: int) -> None:
        data = (rng.standard_normal(shape) * (0.3 if len(shape) == 1 else 0.05)).astype(
            np.float32)
        if len(shape) == 1:
            data += 1.0
        if len(shape) == 2 and shape[-1] % 32 == 0:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, data)

    head_dim = HIDDEN // HEADS
    tensor("token_embd.weight", vocab, HIDDEN)
    tensor("output_norm.weight", HIDDEN)
    tensor("output.weight", vocab, HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}."
        tensor(b + "attn_norm.weight", HIDDEN)
        tensor(b + "attn_q.weight", HEADS * head_dim, HIDDEN)
        tensor(b + "attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(b + "attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(b + "attn_output.weight", HIDDEN, HEADS * head_dim)
        tensor(b + "ffn_norm.weight", HIDDEN)
        tensor(b + "ffn_gate.weight", INTERMEDIATE, HIDDEN)
        tensor(b + "ffn_up.weight", INTERMEDIATE, HIDDEN)
        tensor(b + "ffn_down.weight", HIDDEN, INTERMEDIATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_checkpoint_gguf(checkpoint: Path, out: Path, arch: str) -> Path:
    """``checkpoint`` (config.json + model.safetensors of a qwen2 or phi3 model) as the F32
    GGUF file ``out``: llama.cpp's tensor names (the gguf package's map from transformers'
    names) and metadata, 256 byte tokens, one merge and control tokens up to the vocabulary."""
    import gguf
    from safetensors.torch import load_file

    kind = {"qwen2": gguf.MODEL_ARCH.QWEN2, "phi3": gguf.MODEL_ARCH.PHI3}[arch]
    cfg = json.loads((checkpoint / "config.json").read_text())
    layers, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[kind])
    w.add_name("tiny")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    w.add_rope_dimension_count(cfg.get("head_dim")
                               or cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens = [*_byte_tokens(), "ab"]
    tokens += [f"<|x{i}|>" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3] * (vocab - 257))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(0)
    names = gguf.get_tensor_name_map(kind, layers)
    for key, t in load_file(checkpoint / "model.safetensors").items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        w.add_tensor(name, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
