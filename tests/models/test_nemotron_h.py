"""Nemotron-H (hybrid Mamba-2 / attention / MLP): config reading, checkpoint names, and logits
against transformers 5.x (+ PEFT) on its torch path, fp32, on a tiny random checkpoint."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.helpers.tiny_hf import PagedKV, rel_err, split_rows
from tests.helpers.tiny_nemotron_h import (
    PATTERN,
    hf_model,
    make_nemotron_adapter,
    make_nemotron_h,
    write_out_proj_adapter,
)

from detlora.layers.mamba_metadata import build_mamba_metadata
from detlora.lora import LoRAConfig, LoRARequest
from detlora.lora.manager import LoRAManager
from detlora.models.loader import load_model
from detlora.models.spec import ModelSpec
from detlora.ops._runtime import interpreting

PROMPTS = [[(7 * i + 3 * j) % 120 + 2 for j in range(n)] for i, n in enumerate([11, 19, 5])]


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    root = tmp_path_factory.mktemp("nemotron_h")
    base = make_nemotron_h(root / "base")
    adapter = make_nemotron_adapter(base, root / "lora")
    out_proj, deltas = write_out_proj_adapter(base, root / "out_proj")
    return base, adapter, out_proj, deltas


def _batch(model, kv: PagedKV, chunks: dict[int, list[int]], slots: dict[int, int],
           adapters: dict[int, int] | None = None):
    batch = kv.step(chunks, adapters, max_loras=2)
    meta = build_mamba_metadata(batch.attn.query_start_loc.tolist(),
                                batch.attn.seq_lens.tolist(), [slots[s] for s in chunks],
                                model.mamba_chunk_size)
    return dataclasses.replace(batch, mamba=meta)


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def test_spec_reads_the_pattern_in_both_spellings_and_refuses_moe(nemotron):
    base = nemotron[0]
    cfg = json.loads((base / "config.json").read_text())
    spec = ModelSpec.from_config(cfg)
    assert spec.hybrid is not None and spec.hybrid.layer_types == PATTERN
    assert spec.num_attention_layers == 2 and spec.hybrid.chunk_size == 8
    assert spec.hybrid.time_step_limit == (0.0, float("inf"))  # {"__float__": "Infinity"}
    legacy = {k: v for k, v in cfg.items() if k not in ("layers_block_type", "chunk_size")}
    legacy |= {"hybrid_override_pattern": PATTERN, "mamba_chunk_size": 8,
               "num_hidden_layers": len(PATTERN)}
    assert ModelSpec.from_config(legacy) == spec
    with pytest.raises(ValueError, match=r"mixture-of-experts layers \(E"):
        ModelSpec.from_config({**legacy, "hybrid_override_pattern": "M*E-"})
    with pytest.raises(ValueError, match="num_hidden_layers=3 but the layer pattern has 8"):
        ModelSpec.from_config({**legacy, "num_hidden_layers": 3})
    # The 4B's KV cache holds its attention layers only.
    assert spec.kv_cache_bytes_per_token(torch.float32) == 2 * 2 * 2 * 16 * 4


def test_loads_backbone_and_model_names_alike(nemotron, tmp_path):
    base = nemotron[0]
    tensors = load_file(base / "model.safetensors")
    assert any(k.startswith("backbone.") for k in tensors)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "config.json").write_text((base / "config.json").read_text())
    save_file({k.replace("backbone.", "model.", 1): v for k, v in tensors.items()}
              | {"mtp.layers.0.weight": torch.zeros(2)},  # multi-token prediction: ignored
              renamed / "model.safetensors")
    assert load_model(renamed).weights_hash() == load_model(base).weights_hash()
    save_file(tensors | {"backbone.layers.0.mixer.extra": torch.zeros(2)},
              renamed / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected weight"):
        load_model(renamed)


def test_logits_match_transformers_with_and_without_adapters(nemotron):
    base, adapter, out_proj, deltas = nemotron
    model = load_model(base, lora_config=LoRAConfig(max_loras=2, max_lora_rank=8))
    model.allocate_kv_cache(num_blocks=32, block_size=4)
    model.allocate_state_cache(4)
    manager = LoRAManager(model)
    slots = manager.activate([LoRARequest("a", 1, str(adapter)), None,
                              LoRARequest("o", 2, str(out_proj))])
    lens = [len(p) for p in PROMPTS]
    batch = _batch(model, PagedKV(32, 4, seed=3), dict(enumerate(PROMPTS)), {0: 2, 1: 0, 2: 3},
                   dict(enumerate(slots)))
    with torch.no_grad():
        got = split_rows(model(batch), lens)
    refs = [hf_model(base, adapter=adapter), hf_model(base), hf_model(base, deltas=deltas)]
    for ids, logits, ref in zip(PROMPTS, got, refs, strict=True):
        assert rel_err(logits, _hf_logits(ref, ids)) < 1e-5
    # The adapters change the logits, so the comparisons above are not the base model's.
    plain = hf_model(base)
    assert rel_err(_hf_logits(plain, PROMPTS[0]), _hf_logits(refs[0], PROMPTS[0])) > 1e-2
    assert rel_err(_hf_logits(plain, PROMPTS[2]), _hf_logits(refs[2], PROMPTS[2])) > 1e-3


def test_tensor_parallel_and_a_missing_state_cache_are_refused(nemotron):
    from detlora.distributed.group import TensorParallelGroup

    base = nemotron[0]
    spec = ModelSpec.from_dir(base)
    model = load_model(base)
    model.allocate_kv_cache(num_blocks=8, block_size=4)
    batch = PagedKV(8, 4).step({0: PROMPTS[2]})
    with pytest.raises(ValueError, match=r"needs ForwardBatch\.mamba"):
        model(batch)
    with pytest.raises(ValueError, match="no state cache bound"):
        model(_batch(model, PagedKV(8, 4), {0: PROMPTS[2]}, {0: 0}))

    class Two(TensorParallelGroup):
        def __init__(self):  # a stand-in: only is_single is read before the refusal
            pass

        is_single = False

    from detlora.layers.backend import make_backend
    from detlora.models.nemotron_h import NemotronHForCausalLM

    with pytest.raises(ValueError, match="tensor parallelism does not support hybrid"):
        NemotronHForCausalLM(spec, backend=make_backend("cpu"), tp=Two())


@pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")
def test_mamba_kernels_in_the_model_match_transformers_and_keep_the_bits(nemotron):
    """The Mamba-2 ops as Triton kernels (the interpreter, fp16; the other ops the CPU's
    batch-invariant references, whose kernels tests/gpu runs): close to transformers +
    PEFT, and a prompt computed in one step equals the same prompt in two pieces (the first
    cut off the chunk grid, beside another sequence). tests/ops covers the decode splits."""
    from detlora.layers.backend import make_backend
    from detlora.ops import gated_rms_norm, mamba_conv, mamba_ssd

    base, adapter = nemotron[0], nemotron[1]
    backend = dataclasses.replace(
        make_backend("cpu", "batch_invariant"), causal_conv1d=mamba_conv.causal_conv1d,
        mamba_chunk_scan=mamba_ssd.mamba_chunk_scan,
        gated_rms_norm=gated_rms_norm.gated_rms_norm)
    model = load_model(base, dtype=torch.float16, backend=backend,
                       lora_config=LoRAConfig(max_loras=2, max_lora_rank=8))
    model.allocate_kv_cache(num_blocks=32, block_size=4)
    model.allocate_state_cache(3)
    slot = LoRAManager(model).activate([LoRARequest("a", 1, str(adapter))])[0]
    target = PROMPTS[1]  # 19 tokens: chunks of 8, 8 and 3
    with torch.no_grad():
        whole = model(_batch(model, PagedKV(32, 4, seed=1), {0: target}, {0: 0}, {0: slot}))
        kv = PagedKV(32, 4, seed=2)
        parts = [model(_batch(model, kv, {0: target[:11], 1: PROMPTS[2]}, {0: 2, 1: 1},
                              {0: slot, 1: -1}))[:11]]
        parts.append(model(_batch(model, kv, {0: target[11:]}, {0: 2}, {0: slot})))
    assert torch.equal(whole, torch.cat(parts))
    assert rel_err(whole, _hf_logits(hf_model(base, adapter=adapter), target)) < 1e-2


def test_the_study_default_adapter_targets_a_hybrid_by_its_own_names(nemotron, tmp_path):
    from detlora.lora.peft_loader import load_peft_adapter
    from detlora.study.default_adapter import write_default_adapter

    base = nemotron[0]
    model = load_model(base, lora_config=LoRAConfig(max_loras=1, max_lora_rank=4))
    adapter = load_peft_adapter(write_default_adapter(base, tmp_path / "a", rank=4),
                                model.lora_target_shapes(), max_rank=4)
    kinds = {name.rsplit(".", 1)[1] for name in adapter.modules}
    assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "in_proj"}
    assert len(adapter.modules) == 4 + 2 * 4 + 2 * 2  # in_proj x4, q/k/v/o x2, up/down x2
