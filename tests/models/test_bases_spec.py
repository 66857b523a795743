"""Qwen2, Mistral and Phi-3 configs as transformers 5.x reads them: biases, per-layer sliding
windows (checked against the layers transformers' own config classes window), the windows a
model applies at a context length, LongRoPE's fields and table."""

from __future__ import annotations

import math

import pytest
import torch

from detlora.models.spec import ModelSpec
from detlora.models.windows import attention_windows
from detlora.ops.longrope import longrope_cos_sin_cache, longrope_position_offset

BASE = {"vocab_size": 320, "hidden_size": 96, "intermediate_size": 200, "num_hidden_layers": 4,
        "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 128}


def spec(arch: str, **changes) -> ModelSpec:
    return ModelSpec.from_config({"architectures": [arch], **BASE, **changes})


def test_biases_follow_each_familys_code():
    qwen = spec("Qwen2ForCausalLM", attention_bias=True)  # transformers does not read it
    assert qwen.qkv_bias and not qwen.attention_bias
    for arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        s = spec(arch, attention_bias=True, mlp_bias=True, sliding_window=None)
        assert not (s.qkv_bias or s.attention_bias or s.mlp_bias)
    llama = spec("LlamaForCausalLM", attention_bias=True)
    assert llama.attention_bias and not llama.qkv_bias


QWEN2_WINDOWS = [
    ({}, ()),  # use_sliding_window defaults to false
    ({"use_sliding_window": True, "max_window_layers": 2, "sliding_window": 48},
     (None, None, 48, 48)),
    ({"use_sliding_window": True, "max_window_layers": 3}, (None, None, None, 4096)),
    ({"use_sliding_window": True, "sliding_window": 40,
      "layer_types": ["sliding_attention", "full_attention"] * 2}, (40, None, 40, None)),
    ({"use_sliding_window": False, "sliding_window": 40, "max_window_layers": 0}, ()),
    ({"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0}, ()),
    ({"use_sliding_window": True, "sliding_window": 40, "max_window_layers": 9},
     (None,) * 4),
]


@pytest.mark.parametrize("changes,windows", QWEN2_WINDOWS,
                         ids=["off", "max_window_layers", "default-window", "layer_types",
                              "not-used", "null-window", "past-the-layers"])
def test_qwen2_windows(changes, windows):
    assert spec("Qwen2ForCausalLM", **changes).layer_windows == windows


def _hf_windows(arch: str, changes: dict) -> tuple[int | None, ...]:
    """Each layer's window as transformers 5.x's modeling code applies it: Qwen2/Qwen3 the
    config's sliding_window on its ``layer_types`` "sliding_attention" layers, Mistral and
    Phi-3 config.sliding_window on every layer (their masks read nothing else)."""
    from transformers import AutoConfig

    from detlora.models.spec import SUPPORTED_ARCHITECTURES

    cfg = AutoConfig.for_model(SUPPORTED_ARCHITECTURES[arch], **{**BASE, **changes})
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return tuple(cfg.sliding_window if t == "sliding_attention" else None
                     for t in cfg.layer_types)
    return (cfg.sliding_window,) * cfg.num_hidden_layers


@pytest.mark.parametrize("arch,changes", [
    *[("Qwen2ForCausalLM", c) for c, _ in QWEN2_WINDOWS],
    *[("Qwen3ForCausalLM", c) for c, _ in QWEN2_WINDOWS[1:4]],
    ("MistralForCausalLM", {}), ("MistralForCausalLM", {"sliding_window": None}),
    ("MistralForCausalLM", {"sliding_window": 48}),
    ("Phi3ForCausalLM", {}), ("Phi3ForCausalLM", {"sliding_window": 2047}),
])
def test_windows_are_the_layers_transformers_windows(arch, changes):
    got = spec(arch, **changes).layer_windows or (None,) * BASE["num_hidden_layers"]
    assert got == _hf_windows(arch, changes)


@pytest.mark.parametrize("changes,match", [
    ({"layer_types": ["sliding_attention"] * 4}, "no window is set"),
    ({"use_sliding_window": True, "layer_types": ["full_attention"]},
     "layer_types must list 4 entries"),
    ({"use_sliding_window": True, "sliding_window": 0}, r"sliding_window must be an integer"),
])
def test_qwen2_bad_windows(changes, match):
    with pytest.raises(ValueError, match=match):
        spec("Qwen2ForCausalLM", **changes)


def test_mistral_and_phi3_windows_on_every_layer():
    # transformers' MistralConfig defaults to a 4096-key window; Phi3Config to none.
    assert spec("MistralForCausalLM").layer_windows == (4096,) * 4
    assert spec("MistralForCausalLM", sliding_window=None).layer_windows == ()
    assert spec("MistralForCausalLM", sliding_window=48).layer_windows == (48,) * 4
    assert spec("Phi3ForCausalLM").layer_windows == ()
    assert spec("Phi3ForCausalLM", sliding_window=2047).layer_windows == (2047,) * 4
    with pytest.raises(ValueError, match="use_sliding_window=true is not supported"):
        spec("LlamaForCausalLM", use_sliding_window=True)


def test_windows_a_model_applies_at_a_context_length():
    """A window shorter than the longest sequence is applied; one that holds every sequence
    is full attention bit for bit, and is dropped (the layer keeps every page)."""
    s = spec("Qwen2ForCausalLM", use_sliding_window=True, max_window_layers=2,
             sliding_window=48)
    assert attention_windows(s, 128) == (None, None, 48, 48)
    assert attention_windows(s, 49) == (None, None, 48, 48)
    assert attention_windows(s, 48) == (None,) * 4  # every window holds the whole sequence
    mistral = spec("MistralForCausalLM", sliding_window=100)
    assert attention_windows(mistral, 101) == (100,) * 4
    assert attention_windows(mistral, 100) == (None,) * 4
    assert attention_windows(spec("MistralForCausalLM", sliding_window=None), 8) == (None,) * 4
    with pytest.raises(ValueError, match="max_positions must be >= 1"):
        attention_windows(mistral, 0)


def _phi3(rope: dict, **changes) -> ModelSpec:
    return spec("Phi3ForCausalLM", rope_scaling=rope, **changes)


FACTORS = {"short_factor": [1.0 + i / 10 for i in range(8)],
           "long_factor": [2.0 + i for i in range(8)]}


def test_longrope_fields_as_transformers_reads_them():
    s = _phi3({"type": "su", **FACTORS}, original_max_position_embeddings=32)
    r = s.rope_scaling
    assert r["rope_type"] == "longrope" and r["original_max_position_embeddings"] == 32
    assert r["short_factor"] == tuple(FACTORS["short_factor"])
    assert r["attention_factor"] == math.sqrt(1 + math.log(128 / 32) / math.log(32))
    # The rotary fields' own value wins over the top level; the default is 4096.
    inner = _phi3({"type": "longrope", "original_max_position_embeddings": 16, **FACTORS},
                  original_max_position_embeddings=32)
    assert inner.rope_scaling["original_max_position_embeddings"] == 16
    assert _phi3({"type": "longrope", **FACTORS}).rope_scaling[
        "original_max_position_embeddings"] == 4096
    assert _phi3({"type": "longrope", **FACTORS}).rope_scaling["attention_factor"] == 1.0
    given = _phi3({"type": "longrope", "factor": 8.0, "attention_factor": 1.5, **FACTORS},
                  original_max_position_embeddings=32)
    assert given.rope_scaling["attention_factor"] == 1.5


@pytest.mark.parametrize("rope,match", [
    ({"type": "longrope", "short_factor": [1.0] * 7, "long_factor": [1.0] * 8},
     r"'short_factor': a list of head_dim / 2 = 8"),
    ({"type": "yarn", "factor": 4.0}, "needs 'short_factor'"),  # Phi3Config reads yarn so
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32},
     "rope type 'llama3' is not supported for Phi3ForCausalLM"),
])
def test_bad_longrope(rope, match):
    with pytest.raises(ValueError, match=match):
        _phi3(rope)


def test_longrope_table_equals_transformers_rotary():
    """The short rows, then the long rows, are transformers' cos and sin to the bit."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    s = _phi3({"type": "longrope", **FACTORS}, original_max_position_embeddings=32)
    table = longrope_cos_sin_cache(16, 128, s.rope_theta, s.rope_scaling)
    assert table.shape == (32 + 128, 16)
    hf = Phi3RotaryEmbedding(Phi3Config(**BASE, rope_scaling={"type": "longrope", **FACTORS},
                                        original_max_position_embeddings=32))
    x = torch.zeros(1, dtype=torch.float32)
    for length, rows in ((32, table[:32]), (128, table[32:])):
        cos, sin = hf(x, torch.arange(length)[None])
        assert torch.equal(rows, torch.cat([cos[0, :, :8], sin[0, :, :8]], dim=-1))
    assert [longrope_position_offset(s.rope_scaling, 128, n) for n in (1, 32, 33, 128)] == \
        [0, 0, 32, 32]
    assert longrope_position_offset(s.rope_scaling, 32, 32) == 0  # never past the original
    assert longrope_cos_sin_cache(16, 20, s.rope_theta, s.rope_scaling).shape == (20, 16)
