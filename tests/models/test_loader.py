"""load_model: sharded and single-file checkpoints, weights_hash, and every refusal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.helpers.tiny_hf import make_checkpoint

from detlora.models.llama import LlamaForCausalLM
from detlora.models.loader import load_model
from detlora.models.qwen3 import Qwen3ForCausalLM


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


@pytest.fixture
def ckpt(llama, tmp_path) -> Path:
    """A private copy to mutate."""
    return Path(shutil.copytree(llama, tmp_path / "copy"))


def _edit_config(path: Path, drop: tuple[str, ...] = (), **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k in drop:
        cfg.pop(k, None)
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_weights(path: Path, fn) -> None:
    file = path / "model.safetensors"
    sd = load_file(file)
    fn(sd)
    save_file(sd, file, metadata={"format": "pt"})


def test_loads_llama_and_qwen3(llama, tmp_path):
    assert isinstance(load_model(llama), LlamaForCausalLM)
    qwen = make_checkpoint(tmp_path / "qwen3", "qwen3")
    model = load_model(qwen)
    assert isinstance(model, Qwen3ForCausalLM)
    assert model.layers[0].self_attn.q_norm is not None
    assert model.layers[0].self_attn.qkv_proj.output_sizes == (128, 64, 64)


def test_sharded_checkpoint_loads_the_same_weights(llama, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(llama).save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    a, b = load_model(llama), load_model(sharded)
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    assert a.weights_hash() == b.weights_hash()


def test_weights_hash_tracks_weights_and_dtype(ckpt, llama):
    h = load_model(llama).weights_hash()
    assert load_model(llama).weights_hash() == h
    assert load_model(llama, dtype=torch.bfloat16).weights_hash() != h

    def bump(sd):
        sd["model.norm.weight"][3] += 1e-3

    _edit_weights(ckpt, bump)
    assert load_model(ckpt).weights_hash() != h


def test_dtype_conversion(llama):
    model = load_model(llama, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ref = load_file(llama / "model.safetensors")["model.layers.1.self_attn.k_proj.weight"]
    got = model.layers[1].self_attn.qkv_proj.weight[128 // 2 + 0 : 128 // 2 + 32]
    assert torch.equal(got, ref.to(torch.bfloat16))


def test_fused_slices_hold_the_right_weights(llama):
    sd = load_file(llama / "model.safetensors")
    m = load_model(llama)
    attn, mlp = m.layers[0].self_attn, m.layers[0].mlp
    q, k, v = attn.qkv_proj.weight.split([64, 32, 32])
    assert torch.equal(q, sd["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(k, sd["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(v, sd["model.layers.0.self_attn.v_proj.weight"])
    gate, up = mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(gate, sd["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(up, sd["model.layers.0.mlp.up_proj.weight"])


def test_tied_checkpoint_shares_the_embedding(tmp_path):
    path = make_checkpoint(tmp_path / "tied", "llama", tie=True)
    model = load_model(path)
    assert model.lm_head is None
    assert "lm_head.weight" not in load_file(path / "model.safetensors")


def test_tied_checkpoint_with_a_different_lm_head_is_refused(tmp_path):
    path = make_checkpoint(tmp_path / "tied", "llama", tie=True)

    def add_head(sd):
        sd["lm_head.weight"] = torch.randn_like(sd["model.embed_tokens.weight"])

    _edit_weights(path, add_head)
    with pytest.raises(ValueError, match=r"lm_head\.weight differs"):
        load_model(path)


# ---- refusals ----


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(ckpt)


def test_missing_weight_files(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(ckpt)


def test_pickle_weights_are_refused(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors only"):
        load_model(ckpt)


def test_index_naming_a_missing_shard(ckpt):
    sd = load_file(ckpt / "model.safetensors")
    index = {"weight_map": {name: "model-00001-of-00002.safetensors" for name in sd}}
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_model(ckpt)


@pytest.mark.parametrize("changes,match", [
    (dict(architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel.*not supported"),
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(vocab_size=-5), r"vocab_size must be an integer in \[1, 2147483647\]"),
    (dict(vocab_size=2**31), r"vocab_size must be an integer in \[1, 2147483647\]"),
    (dict(hidden_size=2**40), r"hidden_size must be an integer in \[1, 16777216\]"),
    (dict(rms_norm_eps="tiny"), "rms_norm_eps must be a finite positive number"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite positive number"),
    (dict(rms_norm_eps=2.0), "rms_norm_eps must be a finite positive number below 1"),
    (dict(rope_theta=float("inf"), rope_parameters=None),
     "rope_theta must be a finite positive number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": float("nan")}),
     "rope_theta must be a finite positive number"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": float("inf"),
                           "original_max_position_embeddings": 64}),
     "rope scaling factor must be a finite positive number"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                           "original_max_position_embeddings": 64.5}),
     "original_max_position_embeddings must be an integer"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4}),
     r"quantization_config \(gptq\): quantized checkpoints are not supported"),
    (dict(quantization_config={"quant_method": "awq"}), r"quantization_config \(awq\)"),
    (dict(compression_config={"format": "int-quantized"}), "compression_config"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping is not supported"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5 is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
     "rope type 'yarn'"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}), "needs 'factor'"),
    (dict(dtype="int8"), "dtype 'int8'"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings must be true or false"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_config_values(ckpt, changes, match):
    _edit_config(ckpt, **changes)
    with pytest.raises(ValueError, match=match):
        load_model(ckpt)


def test_missing_config_field(ckpt):
    _edit_config(ckpt, drop=("num_hidden_layers",))
    with pytest.raises(ValueError, match="'num_hidden_layers' is missing"):
        load_model(ckpt)


def test_config_that_disagrees_with_the_weights(ckpt):
    _edit_config(ckpt, intermediate_size=100)
    shape = r"mlp\.\w+_proj\.weight.*has shape \((96, 64|64, 96)\), expected"
    with pytest.raises(ValueError, match=shape):
        load_model(ckpt)


def test_missing_weight(ckpt):
    _edit_weights(ckpt, lambda sd: sd.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(ckpt)


def test_unexpected_weight(ckpt):
    def add(sd):
        sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)

    _edit_weights(ckpt, add)
    with pytest.raises(ValueError, match=r"unexpected.*q_proj\.bias"):
        load_model(ckpt)


def test_extra_layer_is_unexpected(ckpt):
    _edit_config(ckpt, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.1\."):
        load_model(ckpt)


def test_legacy_rope_spelling_is_read(ckpt, llama):
    """transformers 4.x wrote rope_theta and rope_scaling at the top level."""
    cfg = json.loads((ckpt / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    spec = load_model(ckpt).spec
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling["factor"] == 8.0
    assert load_model(llama).spec.rope_scaling is None
