"""Gemma 3 / Gemma 4 config.json -> ModelSpec (models/gemma_config.py): what is refused by name,
the multimodal text tower's prefix and placeholder ids, Gemma 3's legacy fields, and the
rotary tables of each layer type (Gemma 4's proportional one turns only a quarter of the
frequencies; the rest pass through unchanged)."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_gemma import gemma3_text_config, gemma4_text_config

from detlora.models.spec import ModelSpec
from detlora.ops.rotary import rope_cos_sin_cache, rope_inv_freq


def _g4(**kw) -> dict:
    return {"architectures": ["Gemma4ForCausalLM"], **gemma4_text_config(**kw)}


def _g3(**kw) -> dict:
    return {"architectures": ["Gemma3ForCausalLM"], **gemma3_text_config(**kw)}


@pytest.mark.parametrize(("cfg", "message"), [
    (_g4(enable_moe_block=True), "mixture-of-experts variant"),
    (_g4(attention_k_eq_v=True), "attention_k_eq_v=true"),
    (_g4(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
    (_g3(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    (_g3(attn_logit_softcapping=50.0), "attn_logit_softcapping is not supported"),
    (_g3(hidden_activation="silu"), "hidden_activation 'silu' is not supported"),
    (_g4(num_kv_shared_layers=6), "no layer that computes its own keys"),
    (_g4(layer_types=["sliding_attention"] * 5 + ["full_attention"], num_kv_shared_layers=1),
     r"layer 5 \(full_attention\) shares keys and values but none of layers 0-4"),
    (_g4(per_layer_config={"5": {"intermediate_size": 64}}),
     r"per_layer_config\['5'\] may override only head_dim, num_key_value_heads"),
    (_g4(sliding_window=0), "sliding_window must be a finite positive number"),
    (_g4(final_logit_softcapping=float("nan")), "final_logit_softcapping must be"),
    (_g3(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
    (_g4(quantization_config={"quant_method": "fp8"}), "quantized checkpoints"),
])
def test_refused_by_name(cfg, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_config(cfg)


def test_multimodal_text_tower():
    cfg = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
           "text_config": gemma4_text_config(), "image_token_id": 120, "video_token_id": 121,
           "audio_token_id": 122, "eos_token_id": [1, 106], "dtype": "bfloat16"}
    spec = ModelSpec.from_config(cfg)
    assert spec.gemma.weight_prefix == "model.language_model."
    assert spec.gemma.placeholder_token_ids == (120, 121, 122)
    assert spec.eos_token_id == (1, 106) and spec.dtype == torch.bfloat16
    g3 = ModelSpec.from_config({"architectures": ["Gemma3ForConditionalGeneration"],
                                "text_config": gemma3_text_config(), "image_token_index": 99})
    assert g3.gemma.placeholder_token_ids == ()  # inside the vocabulary: HF embeds it as is
    with pytest.raises(ValueError, match="needs a text_config object"):
        ModelSpec.from_config({"architectures": ["Gemma3ForConditionalGeneration"]})


def test_gemma3_legacy_fields_and_layer_types():
    cfg = _g3(num_hidden_layers=13, sliding_window_pattern=4, rope_theta=5e5,
              rope_local_base_freq=2e4, query_pre_attn_scalar=64)
    cfg.pop("rope_scaling")
    spec = ModelSpec.from_config(cfg)
    full = [i for i in range(13) if spec.attention(i).window is None]
    assert full == [3, 7, 11]
    assert spec.attention(3).rope.theta == 5e5 and spec.attention(0).rope.theta == 2e4
    assert spec.attention(0).softmax_scale == 64**-0.5
    assert not spec.gemma.v_norm and spec.gemma.norm_unit_offset
    assert [g.window for g in spec.kv_groups()] == [None, 8]


def test_gemma4_forces_a_full_last_layer_as_hf_does():
    spec = ModelSpec.from_config(_g4(layer_types=["sliding_attention"] * 5 +
                                     ["full_attention"] + ["sliding_attention"] * 2,
                                     num_hidden_layers=8, num_kv_shared_layers=0))
    assert spec.attention(7).window is None and spec.attention(7).head_dim == 32


def test_proportional_rotary_turns_a_quarter_of_the_frequencies():
    scaling = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 1.0}
    inv = rope_inv_freq(512, 1e6, scaling)
    assert inv.shape == (256,) and int((inv != 0).sum()) == 64
    assert torch.isclose(inv[63], torch.tensor(1e6 ** (-126 / 512)), rtol=1e-6)
    cos, sin = rope_cos_sin_cache(512, 50, 1e6, scaling).chunk(2, dim=-1)
    assert torch.equal(cos[:, 64:], torch.ones(50, 192)) and torch.equal(sin[:, 64:],
                                                                          torch.zeros(50, 192))
    linear = rope_inv_freq(64, 1e6, {"rope_type": "linear", "factor": 8.0})
    assert torch.allclose(linear * 8, rope_inv_freq(64, 1e6))
