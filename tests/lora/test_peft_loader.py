"""load_peft_adapter: scales, supported variants, and every refusal."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from tests.helpers.adapter_files import module_shapes, write_adapter

from detlora.lora.peft_loader import load_peft_adapter

Q0 = "model.layers.0.self_attn.q_proj"


def _load(path, max_rank=16):
    return load_peft_adapter(path, module_shapes(), max_rank)


def test_reads_every_module_with_its_scale(tmp_path):
    path = write_adapter(tmp_path / "a", r=8, alpha=16)
    adapter = _load(path)
    assert len(adapter.modules) == 14  # 7 targets x 2 layers
    assert all(m.scale == 2.0 and m.rank == 8 for m in adapter.modules.values())
    stored = load_file(path / "adapter_model.safetensors")
    assert torch.equal(adapter.modules[Q0].a, stored[f"base_model.model.{Q0}.lora_A.weight"])
    assert torch.equal(adapter.modules[Q0].b, stored[f"base_model.model.{Q0}.lora_B.weight"])


def test_rslora_scale(tmp_path):
    adapter = _load(write_adapter(tmp_path / "a", r=4, alpha=8, use_rslora=True))
    assert adapter.modules[Q0].scale == 8 / math.sqrt(4)


def test_subset_of_targets_and_layers(tmp_path):
    path = write_adapter(tmp_path / "a", targets=["v_proj", "down_proj"], layers=(1,),
                         layers_to_transform=[1])
    assert sorted(_load(path).modules) == ["model.layers.1.mlp.down_proj",
                                           "model.layers.1.self_attn.v_proj"]


def test_rank_and_alpha_patterns(tmp_path):
    path = write_adapter(tmp_path / "a", r=8, alpha=16, ranks={"down_proj": 4},
                         rank_pattern={"down_proj": 4}, alpha_pattern={"o_proj": 4})
    adapter = _load(path)
    down = adapter.modules["model.layers.0.mlp.down_proj"]
    assert (down.rank, down.scale) == (4, 16 / 4)
    assert adapter.modules["model.layers.1.self_attn.o_proj"].scale == 4 / 8
    assert adapter.modules[Q0].scale == 2.0


def test_adapter_of_the_bare_decoder(tmp_path):
    """PEFT on LlamaModel (no LM head) names modules without the leading "model."."""
    bare = {"base_model.model.layers.1.mlp.up_proj.lora_A.weight": torch.randn(8, 64),
            "base_model.model.layers.1.mlp.up_proj.lora_B.weight": torch.randn(96, 8)}
    path = write_adapter(tmp_path / "a", targets=["up_proj"], layers=(0,), extra_tensors=bare)
    assert sorted(_load(path).modules) == ["model.layers.0.mlp.up_proj",
                                           "model.layers.1.mlp.up_proj"]


def test_hash_tracks_weights_and_scale(tmp_path):
    h = _load(write_adapter(tmp_path / "a", seed=0)).hash
    assert _load(write_adapter(tmp_path / "b", seed=0)).hash == h
    assert _load(write_adapter(tmp_path / "c", seed=1)).hash != h
    assert _load(write_adapter(tmp_path / "d", seed=0, alpha=32)).hash != h
    assert _load(write_adapter(tmp_path / "e", seed=0, use_rslora=True)).hash != h


@pytest.mark.parametrize("config,match", [
    (dict(use_dora=True), "DoRA"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(bias="lora_only"), "bias='lora_only'"),
    (dict(bias="all"), "bias='all'"),
    (dict(lora_bias=True), "lora_bias"),
    (dict(fan_in_fan_out=True), "fan_in_fan_out"),
    (dict(peft_type="IA3"), "peft_type 'IA3'"),
    (dict(target_modules=["q_proj", "lm_head"]), r"\['lm_head'\] are not supported"),
    (dict(target_modules=["q_proj", "c_attn"]), r"\['c_attn'\] are not supported"),
    (dict(r=0), "r must be a positive integer"),
    (dict(lora_alpha=None), "lora_alpha must be a finite positive number"),
    (dict(alora_invocation_tokens=[1, 2]), "activated LoRA"),
    (dict(layer_replication=[[0, 1]]), "layer_replication"),
])
def test_config_refusals(tmp_path, config, match):
    path = write_adapter(tmp_path / "a", **config)
    with pytest.raises(ValueError, match=match):
        _load(path)


def test_rank_above_max(tmp_path):
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank 8"):
        _load(write_adapter(tmp_path / "a", r=16, alpha=16), max_rank=8)


def test_rank_that_disagrees_with_the_config(tmp_path):
    path = write_adapter(tmp_path / "a", r=8, ranks={"k_proj": 4})
    with pytest.raises(ValueError, match=r"k_proj' has rank 4 but adapter_config\.json says r=8"):
        _load(path)


def test_weights_for_another_model(tmp_path):
    bad = {f"base_model.model.{Q0}.lora_A.weight": torch.randn(8, 80),
           f"base_model.model.{Q0}.lora_B.weight": torch.randn(64, 8)}
    path = write_adapter(tmp_path / "a", extra_tensors=bad)
    with pytest.raises(ValueError, match=r"lora_A \(8, 80\).*\[r, 64\].*another model"):
        _load(path)


def test_weights_for_a_layer_the_model_lacks(tmp_path):
    extra = {"base_model.model.model.layers.7.mlp.up_proj.lora_A.weight": torch.randn(8, 64),
             "base_model.model.model.layers.7.mlp.up_proj.lora_B.weight": torch.randn(96, 8)}
    with pytest.raises(ValueError, match=r"layers\.7\.mlp\.up_proj'.*not a supported LoRA target"):
        _load(write_adapter(tmp_path / "a", extra_tensors=extra))


@pytest.mark.parametrize("key", ["base_model.model.model.layers.0.self_attn.q_proj."
                                 "lora_magnitude_vector", "base_model.model.lm_head.weight",
                                 "base_model.model.model.embed_tokens.lora_embedding_A"])
def test_unsupported_tensors(tmp_path, key):
    path = write_adapter(tmp_path / "a", extra_tensors={key: torch.randn(8, 64)})
    with pytest.raises(ValueError, match="not"):
        _load(path)


def test_untargeted_module_with_weights(tmp_path):
    path = write_adapter(tmp_path / "a", target_modules=["q_proj"])  # weights for all seven
    with pytest.raises(ValueError, match="does not target it"):
        _load(path)


def test_layers_to_transform_mismatch(tmp_path):
    path = write_adapter(tmp_path / "a", layers_to_transform=[0])  # weights in layers 0, 1
    with pytest.raises(ValueError, match=r"model\.layers\.1.*does not target it"):
        _load(path)


def test_half_a_pair(tmp_path):
    path = write_adapter(tmp_path / "a", drop=(f"base_model.model.{Q0}.lora_B.weight",))
    with pytest.raises(ValueError, match="q_proj' has no lora_B"):
        _load(path)


def test_empty_adapter(tmp_path):
    with pytest.raises(ValueError, match="holds no LoRA weights"):
        _load(write_adapter(tmp_path / "a", targets=[]))


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _load(tmp_path / "nowhere")
    path = write_adapter(tmp_path / "a")
    (path / "adapter_config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"adapter_config\.json"):
        _load(path)
    path = write_adapter(tmp_path / "b")
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"adapter_model\.safetensors is missing"):
        _load(path)


def test_truncated_weights_name_the_file(tmp_path):
    path = write_adapter(tmp_path / "a")
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors is not a readable"):
        _load(path)


def test_pickle_adapter_is_refused(tmp_path):
    path = write_adapter(tmp_path / "a")
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    with pytest.raises(ValueError, match=r"adapter_model\.bin \(a pickle\)"):
        _load(path)


def test_bad_json(tmp_path):
    path = write_adapter(tmp_path / "a")
    (path / "adapter_config.json").write_text("{r: 8")
    with pytest.raises(ValueError, match="not valid JSON"):
        _load(path)
    (path / "adapter_config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="JSON object"):
        _load(path)
