"""Adapters on Phi-3's fused modules (qkv_proj, gate_up_proj: one A, one B spanning the
slices) load as one module per slice, B's rows split and A shared; split-name adapters load
as they are; both at once, or a fused name on a model without it, are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tests.helpers.adapter_files import module_shapes

from detlora.layers.backend import make_backend
from detlora.layers.lora_slots import LoRAConfig
from detlora.lora.hashing import adapter_hash
from detlora.lora.peft_loader import load_peft_adapter
from detlora.models.phi3 import Phi3ForCausalLM
from detlora.models.spec import ModelSpec

CONFIG = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 128, "hidden_size": 96,
          "intermediate_size": 200, "num_hidden_layers": 2, "num_attention_heads": 6,
          "num_key_value_heads": 2, "max_position_embeddings": 64}
ATTN = "model.layers.1.self_attn."
MLP = "model.layers.1.mlp."


@pytest.fixture(scope="module")
def phi3() -> Phi3ForCausalLM:
    return Phi3ForCausalLM(ModelSpec.from_config(CONFIG), backend=make_backend("cpu"),
                           lora=LoRAConfig(1, 8))


def write(path: Path, shapes: dict[str, tuple[int, int]], targets: list[str],
          r: int = 4) -> dict[str, torch.Tensor]:
    """A PEFT adapter on ``targets`` (module names' last parts), random A and B."""
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, (fin, fout) in shapes.items():
        if name.rsplit(".", 1)[-1] in targets:
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(r, fin, generator=g)
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(fout, r, generator=g)
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": targets}))
    return tensors


def test_model_names_its_fused_modules(phi3):
    shapes = phi3.lora_target_shapes()
    assert shapes[ATTN + "qkv_proj"] == (96, 96 + 2 * 32)
    assert shapes[MLP + "gate_up_proj"] == (96, 400)
    assert shapes[ATTN + "k_proj"] == (96, 32)  # the split names stay targets too
    assert phi3.lora_fused_targets()[ATTN + "qkv_proj"] == (
        ATTN + "q_proj", ATTN + "k_proj", ATTN + "v_proj")


def test_fused_adapter_splits_b_rows_and_shares_a(phi3, tmp_path):
    stored = write(tmp_path / "a", phi3.lora_target_shapes(),
                   ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    adapter = load_peft_adapter(tmp_path / "a", phi3.lora_target_shapes(), 8,
                                phi3.lora_fused_targets())
    assert sorted(n.rsplit(".", 1)[-1] for n in adapter.modules if ".1." in n) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    a = stored[f"base_model.model.{ATTN}qkv_proj.lora_A.weight"]
    b = stored[f"base_model.model.{ATTN}qkv_proj.lora_B.weight"]
    for name, (lo, hi) in (("q_proj", (0, 96)), ("k_proj", (96, 128)), ("v_proj", (128, 160))):
        m = adapter.modules[ATTN + name]
        assert torch.equal(m.a, a) and torch.equal(m.b, b[lo:hi]) and m.scale == 2.0
    up = adapter.modules[MLP + "up_proj"]
    assert torch.equal(up.b, stored[f"base_model.model.{MLP}gate_up_proj.lora_B.weight"][200:])
    # The hash is of the tensors as stored: the same bytes under other names differ.
    split_view = {n: adapter.modules[n] for n in adapter.modules}
    assert adapter.hash != adapter_hash(split_view)


def test_split_adapter_loads_as_it_is(phi3, tmp_path):
    write(tmp_path / "a", phi3.lora_target_shapes(), ["q_proj", "v_proj", "up_proj"])
    adapter = load_peft_adapter(tmp_path / "a", phi3.lora_target_shapes(), 8,
                                phi3.lora_fused_targets())
    assert sorted(n.rsplit(".", 1)[-1] for n in adapter.modules) == \
        ["q_proj", "q_proj", "up_proj", "up_proj", "v_proj", "v_proj"]


def test_fused_and_split_together_are_refused(phi3, tmp_path):
    write(tmp_path / "a", phi3.lora_target_shapes(), ["qkv_proj", "k_proj"])
    with pytest.raises(ValueError, match=r"qkv_proj' and its slice '.*k_proj' are both"):
        load_peft_adapter(tmp_path / "a", phi3.lora_target_shapes(), 8,
                          phi3.lora_fused_targets())


def test_fused_name_on_a_model_without_it(phi3, tmp_path):
    fused = {k: v for k, v in phi3.lora_target_shapes().items() if k.endswith("qkv_proj")}
    write(tmp_path / "a", fused, ["qkv_proj"])
    llama = module_shapes()  # Llama's modules: q/k/v apart
    with pytest.raises(ValueError, match=r"not a supported LoRA target of this model "
                                         r"\(supported: q_proj, k_proj, v_proj, o_proj, "
                                         r"gate_proj, up_proj, down_proj in"):
        load_peft_adapter(tmp_path / "a", llama, 8)
