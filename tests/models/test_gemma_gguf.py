"""Gemma 3 from a .gguf file (written here with the ``gguf`` package, norms stored with the 1
added as llama.cpp stores them): detlora's source converts it through transformers' reader, and
the model computes what transformers computes from the same file."""

from __future__ import annotations

import json

import torch
from tests.helpers.tiny_gemma import GroupedPagedKV, make_gemma3
from tests.helpers.tiny_gguf import _byte_tokens
from tests.helpers.tiny_hf import rel_err

from detlora.models.loader import load_model
from detlora.models.sources import gguf_architecture, resolve_model


def _write_gguf(checkpoint, out):
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((checkpoint / "config.json").read_text())
    kind = gguf.MODEL_ARCH.GEMMA3
    layers, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[kind])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens = [*_byte_tokens(), "ab"]
    tokens += [f"<|x{i}|>" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3] * (vocab - 257))
    w.add_token_scores([0.0] * vocab)  # real Gemma files have them (5.17 reads them)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    names = gguf.get_tensor_name_map(kind, layers)
    for key, t in load_file(checkpoint / "model.safetensors").items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        data = t.float() + 1 if key.endswith("norm.weight") else t.float()
        w.add_tensor(name, data.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_gemma3_gguf_runs_as_transformers_reads_it(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("DETLORA_CACHE", str(tmp_path / "cache"))
    base = make_gemma3(tmp_path / "hf", vocab_size=300, rope_scaling=None)
    file = _write_gguf(base, tmp_path / "tiny.gguf")
    assert gguf_architecture(file) == "Gemma3ForCausalLM"
    model = load_model(resolve_model(str(file)))
    assert model.spec.architecture == "Gemma3ForCausalLM"
    assert [g.window for g in model.kv_groups] == [None, 8]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name).eval()
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        got = model(GroupedPagedKV(model, 16, 4).step({0: ids}))
        want = hf(input_ids=torch.tensor([ids])).logits[0].float()
    assert rel_err(got, want) < 1e-4
