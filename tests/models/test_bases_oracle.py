"""Qwen2, Mistral and Phi-3 on the CPU model path against transformers + PEFT (fp32), with
sliding windows shorter than the prompts (Qwen2: from max_window_layers on, so one full and
one windowed layer; Mistral and Phi-3: every layer): a mixed base/adapter batch over a paged
cache (pages behind the windows released and NaN-poisoned) and the decode steps after it;
Qwen2's biases; Phi-3 adapters on the fused modules and on the split names; a row's bits with
biases at batch_invariant whatever shares its batch."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tests.helpers.tiny_gemma import GroupedPagedKV
from tests.helpers.tiny_hf import (
    ALL_TARGETS,
    BASES,
    FUSED_TARGETS,
    HFReference,
    make_adapter,
    make_base_checkpoint,
    rel_err,
    split_rows,
)

from detlora.layers.lora_slots import LoRAConfig
from detlora.lora.manager import LoRAManager
from detlora.lora.request import LoRARequest
from detlora.models.loader import load_model

TOL = 1e-4  # fp32, relative to the largest reference logit
SUBSET = {"phi3": ["qkv_proj", "down_proj"],
          "qwen2": ["q_proj", "v_proj", "o_proj", "down_proj", "up_proj"],
          "mistral": ["k_proj", "v_proj", "gate_proj"]}
# Windows shorter than most prompts here (3 to 14 tokens), as each config.json spells them.
WINDOWS = {"qwen2": dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
           "mistral": dict(sliding_window=6), "phi3": dict(sliding_window=7)}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """arch -> (checkpoint, two adapters: r=8 on every target, rsLoRA r=4 on a subset, the
    HF reference), built on first use."""
    made: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in made:
            root = tmp_path_factory.mktemp(arch)
            base = make_base_checkpoint(root / "base", arch, **WINDOWS[arch])
            every = FUSED_TARGETS if arch == "phi3" else ALL_TARGETS
            ad1 = make_adapter(base, root / "ad1", r=8, alpha=16, seed=1, targets=every)
            ad2 = make_adapter(base, root / "ad2", r=4, alpha=8, use_rslora=True, seed=2,
                               targets=SUBSET[arch])
            made[arch] = base, ad1, ad2, HFReference(base)
        return made[arch]

    return get


def _prompts(lengths, seed, vocab=320):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", BASES)
def test_mixed_batch_then_decode_steps(families, arch):
    """Base and two adapters in one prefill, then two decode steps reading the pages."""
    base, ad1, ad2, ref = families(arch)
    model = load_model(base, lora_config=LoRAConfig(max_loras=3, max_lora_rank=8))
    manager = LoRAManager(model)
    adapters = [LoRARequest("one", 1, str(ad1)), LoRARequest("two", 2, str(ad2)), None,
                LoRARequest("one", 1, str(ad1))]
    paths = [ad1, ad2, None, ad1]
    lengths = [5, 9, 3, 12]
    full = _prompts([n + 2 for n in lengths], seed=4)
    slots = dict(enumerate(manager.activate(adapters)))
    kv = GroupedPagedKV(model, 40, 4, seed=5)
    assert [g.window for g in model.kv_groups] == ([None, 6] if arch == "qwen2" else
                                                   [WINDOWS[arch]["sliding_window"]])
    batch = kv.step({s: full[s][:n] for s, n in enumerate(lengths)}, slots, 3)
    with torch.no_grad():
        got = split_rows(model(batch), lengths)
    for s, n in enumerate(lengths):
        want = ref.logits(full[s][:n], paths[s])
        assert rel_err(got[s], want) < TOL
        if paths[s] is not None:  # the adapter must matter far beyond the tolerance
            assert rel_err(ref.logits(full[s][:n]), want) > 1000 * TOL
    for step in range(2):
        batch = kv.step({s: [full[s][n + step]] for s, n in enumerate(lengths)}, slots, 3,
                        logits="last")
        with torch.no_grad():
            got = model(batch)
        for s, n in enumerate(lengths):
            assert rel_err(got[s], ref.logits(full[s][: n + step + 1], paths[s])[-1]) < TOL


def test_qwen2_biases_are_used_and_matter(families):
    base, _, _, ref = families("qwen2")
    model = load_model(base)
    attn = model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    (ids,) = _prompts([11], seed=6)
    want = ref.logits(ids)
    with torch.no_grad():
        assert rel_err(model(GroupedPagedKV(model, 8, 4).step({0: ids})), want) < TOL
        for layer in model.layers:
            layer.self_attn.qkv_proj.bias.zero_()
        assert rel_err(model(GroupedPagedKV(model, 8, 4).step({0: ids})), want) > 1000 * TOL


@pytest.mark.parametrize("arch", BASES)
def test_rows_are_batch_invariant(families, arch):
    """batch_invariant (the CPU default): a row's logits, biases and adapters included, are
    the same bits alone and beside other prompts, in any order."""
    base, ad1, _, _ = families(arch)
    model = load_model(base, lora_config=LoRAConfig(max_loras=2, max_lora_rank=8))
    assert model.backend.determinism.value == "batch_invariant"
    slot = LoRAManager(model).activate([LoRARequest("one", 1, str(ad1))])[0]
    a, b, c = _prompts([7, 13, 4], seed=7)
    with torch.no_grad():
        alone = model(GroupedPagedKV(model, 40, 4).step({0: a}, {0: slot}, 2))
        mixed = model(GroupedPagedKV(model, 40, 4, seed=1).step({1: b, 0: a, 2: c},
                                                                {0: slot, 1: -1, 2: slot}, 2))
    assert torch.equal(alone, mixed[13:20])


def _write_split_adapter(path: Path, shapes: dict[str, tuple[int, int]], r: int,
                         alpha: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    tensors = {}
    for name, (fin, fout) in shapes.items():
        if name.rsplit(".", 1)[-1] in ALL_TARGETS:
            tensors[f"base_model.model.{name}.lora_A.weight"] = 0.1 * torch.randn(
                r, fin, generator=g)
            tensors[f"base_model.model.{name}.lora_B.weight"] = 0.1 * torch.randn(
                fout, r, generator=g)
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ALL_TARGETS}))
    return tensors


def _fused_equivalent(base: Path, split: dict[str, torch.Tensor], path: Path, r: int,
                      alpha: float, layers: int) -> Path:
    """The split adapter as a PEFT adapter on Phi-3's fused modules: A stacked, B block
    diagonal, rank and alpha scaled with the slice count so alpha / r stays the same."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    fused = {"qkv_proj": ("self_attn", ["q_proj", "k_proj", "v_proj"]),
             "gate_up_proj": ("mlp", ["gate_proj", "up_proj"])}
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=FUSED_TARGETS, lora_dropout=0.0,
                     rank_pattern={n: r * len(p) for n, (_, p) in fused.items()},
                     alpha_pattern={n: alpha * len(p) for n, (_, p) in fused.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), cfg)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for i in range(layers):
            key = f"base_model.model.model.layers.{i}."
            for name, (part, slices) in fused.items():
                a = [split[f"{key}{part}.{s}.lora_A.weight"] for s in slices]
                b = [split[f"{key}{part}.{s}.lora_B.weight"] for s in slices]
                params[f"{key}{part}.{name}.lora_A.default.weight"].copy_(torch.cat(a))
                params[f"{key}{part}.{name}.lora_B.default.weight"].copy_(torch.block_diag(*b))
            for part, name in (("self_attn", "o_proj"), ("mlp", "down_proj")):
                for ab in "AB":
                    params[f"{key}{part}.{name}.lora_{ab}.default.weight"].copy_(
                        split[f"{key}{part}.{name}.lora_{ab}.weight"])
    model.save_pretrained(path)
    return path


def test_phi3_split_name_adapter(families, tmp_path):
    """An adapter on q/k/v/gate/up apart (say, trained on a split layout) against the same
    update written on the fused modules for PEFT."""
    base, _, _, ref = families("phi3")
    model = load_model(base, lora_config=LoRAConfig(max_loras=1, max_lora_rank=4))
    split = _write_split_adapter(tmp_path / "split", model.lora_target_shapes(), 4, 8)
    fused = _fused_equivalent(base, split, tmp_path / "fused", 4, 8, model.spec.num_layers)
    slot = LoRAManager(model).activate([LoRARequest("split", 1, str(tmp_path / "split"))])[0]
    (ids,) = _prompts([10], seed=8)
    with torch.no_grad():
        got = model(GroupedPagedKV(model, 8, 4).step({0: ids}, {0: slot}, 1))
    want = ref.logits(ids, fused)
    assert rel_err(got, want) < TOL
    assert rel_err(ref.logits(ids), want) > 1000 * TOL
