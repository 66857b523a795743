"""Adapter numbers: config values finite and in range, weights finite, corrupt bytes caught.

``lora_alpha: NaN`` (JSON allows it through Python's json), ``Infinity``, integers too large
for a float, non-integer ranks and NaN weights are refused when the adapter is loaded, with
an error naming the field or the tensor. Corrupt bytes in the data region (safetensors has no
checksum) either decode to non-finite values (refused, naming the tensor) or to finite
garbage, which the engine's non-finite logits guard catches at run time
(tests/engine/test_nonfinite_logits.py).
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.helpers.adapter_files import module_shapes, write_adapter

from detlora.lora.peft_loader import load_peft_adapter

Q0 = "model.layers.0.self_attn.q_proj"


def _load(path, max_rank=16):
    return load_peft_adapter(path, module_shapes(), max_rank)


def _write_raw_config(path, **fields):
    """Rewrite adapter_config.json with raw JSON values (NaN, Infinity, 1e400 as text)."""
    cfg = json.loads((path / "adapter_config.json").read_text())
    text = json.dumps(cfg)
    for name, raw in fields.items():
        cfg.pop(name, None)
        text = json.dumps(cfg)[:-1] + f', "{name}": {raw}}}'
        cfg = json.loads(text)
    (path / "adapter_config.json").write_text(text)


@pytest.mark.parametrize(("field", "raw", "match"), [
    ("lora_alpha", "NaN", r"lora_alpha must be a finite positive number, got nan"),
    ("lora_alpha", "Infinity", r"lora_alpha must be a finite positive number, got inf"),
    ("lora_alpha", "-Infinity", r"lora_alpha must be a finite positive number"),
    ("lora_alpha", "1e400", r"lora_alpha must be a finite positive number, got inf"),
    ("lora_alpha", "1" + "0" * 400, r"lora_alpha must be a finite positive number, got 1000"),
    ("lora_alpha", "0", r"lora_alpha must be a finite positive number, got 0"),
    ("lora_alpha", '"16"', r"lora_alpha must be a finite positive number, got '16'"),
    ("r", "8.0", r"r must be a positive integer \(at most 65536\), got 8\.0"),
    ("r", "NaN", r"r must be a positive integer \(at most 65536\), got nan"),
    ("r", "1" + "0" * 400, r"r must be a positive integer \(at most 65536\), got 1000"),
    ("rank_pattern", '{"q_proj": NaN}', r"rank_pattern\['q_proj'\] must be a positive integer"),
    ("rank_pattern", '{"q_proj": 4.5}', r"rank_pattern\['q_proj'\] must be a positive integer"),
    ("alpha_pattern", '{"q_proj": Infinity}',
     r"alpha_pattern\['q_proj'\] must be a finite positive number, got inf"),
    ("alpha_pattern", '{"q_proj": -1}', r"alpha_pattern\['q_proj'\] must be a finite positive"),
    ("alpha_pattern", '["q_proj"]', r"alpha_pattern must map module patterns to numbers"),
    ("layers_to_transform", "[0, NaN]", r"layers_to_transform must be a layer index"),
    ("layers_to_transform", "[[0]]", r"layers_to_transform must be a layer index"),
    ("layers_to_transform", "-1", r"layers_to_transform must be a layer index"),
    ("use_rslora", '"yes"', r"use_rslora must be true or false, got 'yes'"),
])
def test_config_numbers_must_be_finite_and_in_range(tmp_path, field, raw, match):
    path = write_adapter(tmp_path / "a")
    _write_raw_config(path, **{field: raw})
    with pytest.raises(ValueError, match=match):
        _load(path)


def test_huge_but_finite_alpha_loads(tmp_path):
    """1e38 is a float: the config is valid; its overflow is the run-time guard's business."""
    path = write_adapter(tmp_path / "a", r=8, alpha=1e38)
    assert _load(path).modules[Q0].scale == 1e38 / 8


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, bad):
    path = write_adapter(tmp_path / "a")
    file = path / "adapter_model.safetensors"
    tensors = load_file(file)
    key = f"base_model.model.{Q0}.lora_B.weight"
    tensors[key][3, 1] = bad
    save_file(tensors, file)
    with pytest.raises(ValueError, match=rf"tensor '{key}' holds 1 non-finite value"):
        _load(path)


def _data_offset(file) -> int:
    """Where the safetensors data region starts (after the 8-byte length and the header)."""
    with open(file, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


@pytest.mark.parametrize(("fill", "outcome"), [
    (b"\xff", "refused"),  # 0xffffffff: NaN in fp32
    (b"\x7e", "loads"),  # 0x7e7e7e7e: 8.4e37, finite garbage
])
def test_four_kb_of_corrupt_bytes_in_the_data_region(tmp_path, fill, outcome):
    path = write_adapter(tmp_path / "a")
    file = path / "adapter_model.safetensors"
    data = bytearray(file.read_bytes())
    start = _data_offset(file) + 1024
    data[start: start + 4096] = fill * 4096
    file.write_bytes(bytes(data))
    if outcome == "refused":
        with pytest.raises(ValueError, match=r"non-finite value.*corrupt"):
            _load(path)
    else:
        adapter = _load(path)
        assert max(m.b.abs().max().item() for m in adapter.modules.values()) > 1e37


def test_random_corrupt_bytes_are_refused_or_finite(tmp_path):
    """Random bytes: refused (a NaN/inf among them), or every loaded value is finite."""
    g = torch.Generator().manual_seed(0)
    for k in range(4):
        path = write_adapter(tmp_path / f"a{k}")
        file = path / "adapter_model.safetensors"
        data = bytearray(file.read_bytes())
        start = _data_offset(file) + 512 * k
        data[start: start + 4096] = bytes(torch.randint(0, 256, (4096,), generator=g).tolist())
        file.write_bytes(bytes(data))
        try:
            adapter = _load(path)
        except ValueError as e:
            assert "non-finite" in str(e)
            continue
        for m in adapter.modules.values():
            assert torch.isfinite(m.a).all() and torch.isfinite(m.b).all()
