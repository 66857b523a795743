"""Gemma config.json as the transformers releases the package allows write it, read by
models/gemma_config.py into the same per-layer attention whichever release wrote the file
and whichever one reads it. Each spelling is a JSON literal here, so CI with one release
checks them all; the installed release's own save is checked to be one of them, and its
own per-layer view (where its config has one) to agree with the expected layers."""

from __future__ import annotations

import json
import warnings

import pytest

from detlora.models.layer_spec import LayerAttention, RopeSpec
from detlora.models.spec import ModelSpec

# Gemma 4: 12 layers (per_layer_config keys then zero-padded: "02"), full every third,
# the last 4 layers reading the K/V of the last earlier layer of their type (5 and 7).
_G4_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 4
_G4 = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 12,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
       "sliding_window": 8, "layer_types": _G4_TYPES, "num_kv_shared_layers": 4,
       "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 128,
       "rope_parameters": {
           "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
           "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                              "rope_theta": 1000000.0}}}
# 5.5-5.9: the full layers' head size as one number.
_G4_GLOBAL_HEAD_DIM = json.dumps({**_G4, "global_head_dim": 32})
# 5.1x heterogeneous configs (5.17, 5.24): the overrides of each full layer.
_G4_PER_LAYER = json.dumps({**_G4, "per_layer_config": {
    "02": {"head_dim": 32}, "05": {"head_dim": 32}, "08": {"head_dim": 32},
    "11": {"head_dim": 32}}})

_G4_SLIDING = RopeSpec(10000.0)
_G4_FULL = RopeSpec(1e6, {"rope_type": "proportional", "factor": 1.0,
                          "partial_rotary_factor": 0.25})
# (head_dim, window, kv_source) of each layer; 2 KV heads and softmax scale 1.0 throughout.
_G4_LAYERS = [(16, 8, None), (16, 8, None), (32, None, None), (16, 8, None), (16, 8, None),
              (32, None, None), (16, 8, None), (16, 8, None), (32, None, 5), (16, 8, 7),
              (16, 8, 7), (32, None, 5)]
G4_EXPECTED = [LayerAttention(head_dim=hd, num_kv_heads=2, window=w, kv_source=src, scale=1.0,
                              rope=_G4_SLIDING if w else _G4_FULL)
               for hd, w, src in _G4_LAYERS]

# Gemma 3: 7 layers, full every third (layers 2 and 5), linear scaling on the full layers.
_G3 = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 7,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
       "sliding_window": 8, "query_pre_attn_scalar": 24}
# 4.x: rotary attributes and the window pattern.
_G3_LEGACY = json.dumps({**_G3, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                         "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                         "sliding_window_pattern": 3})
# 5.x: rotary parameters of each layer type, and the layer types.
_G3_BY_TYPE = json.dumps({**_G3, "layer_types": [
    "sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
    "sliding_attention", "full_attention", "sliding_attention"], "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}})
G3_EXPECTED = [LayerAttention(
    head_dim=32, num_kv_heads=2, window=None if i in (2, 5) else 8, scale=24**-0.5,
    rope=RopeSpec(1e6, {"rope_type": "linear", "factor": 8.0}) if i in (2, 5)
    else RopeSpec(10000.0)) for i in range(7)]


def _attention(fields: dict, arch: str) -> list[LayerAttention]:
    return list(ModelSpec.from_config({"architectures": [arch], **fields}).layer_attention)


@pytest.mark.parametrize("written", [_G4_GLOBAL_HEAD_DIM, _G4_PER_LAYER],
                         ids=["global_head_dim", "per_layer_config"])
def test_gemma4_spellings_read_alike(written):
    assert _attention(json.loads(written), "Gemma4ForCausalLM") == G4_EXPECTED
    tower = {"model_type": "gemma4", "text_config": json.loads(written)}
    assert _attention(tower, "Gemma4ForConditionalGeneration") == G4_EXPECTED


@pytest.mark.parametrize("written", [_G3_LEGACY, _G3_BY_TYPE], ids=["4.x", "5.x"])
def test_gemma3_spellings_read_alike(written):
    assert _attention(json.loads(written), "Gemma3ForCausalLM") == G3_EXPECTED


def test_installed_release_saves_a_spelling_read_alike(tmp_path):
    """What the installed transformers saves is one of the spellings above and reads the
    same; its own view of the layers, where its config has one, agrees."""
    from transformers import Gemma3TextConfig, Gemma4TextConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g4 = Gemma4TextConfig(**{**_G4, "global_head_dim": 32})
        g3 = Gemma3TextConfig(**json.loads(_G3_LEGACY))
    g4.save_pretrained(tmp_path / "g4")
    g3.save_pretrained(tmp_path / "g3")
    saved4 = json.loads((tmp_path / "g4" / "config.json").read_text())
    saved3 = json.loads((tmp_path / "g3" / "config.json").read_text())
    written = {k: saved4[k] for k in ("global_head_dim", "per_layer_config") if k in saved4}
    assert written in ({"global_head_dim": 32},
                       {"per_layer_config": json.loads(_G4_PER_LAYER)["per_layer_config"]})
    assert saved3.get("rope_parameters") in (None, json.loads(_G3_BY_TYPE)["rope_parameters"])
    assert _attention(saved4, "Gemma4ForCausalLM") == G4_EXPECTED
    assert _attention(saved3, "Gemma3ForCausalLM") == G3_EXPECTED
    checked = 0
    if hasattr(type(g4), "kv_sharing_modes"):  # 5.24: HF's own sharing map
        store = {t: i for i, (t, m) in enumerate(zip(_G4_TYPES, g4.kv_sharing_modes,
                                                     strict=True)) if m == "store"}
        assert [store[t] if m == "reuse" else None for t, m in
                zip(_G4_TYPES, g4.kv_sharing_modes, strict=True)] == [
                    a.kv_source for a in G4_EXPECTED]
        checked += 1
    if "per_layer_config" in written:  # heterogeneous configs: HF's per-layer head sizes
        assert [g4.per_layer_config[i].head_dim for i in range(12)] == [
            a.head_dim for a in G4_EXPECTED]
        checked += 1
    assert checked or "global_head_dim" in written


def test_gemma4_without_its_config_class_names_the_release(monkeypatch):
    """A transformers release older than Gemma 4 (< 5.5.0) is named, not a KeyError."""
    import transformers

    known = set(transformers.CONFIG_MAPPING.keys()) - {"gemma4", "gemma4_text"}
    monkeypatch.setattr(transformers, "CONFIG_MAPPING", known)
    with pytest.raises(ValueError, match=r"needs transformers >= 5\.5\.0 .*installed: "):
        _attention(json.loads(_G4_PER_LAYER), "Gemma4ForCausalLM")
