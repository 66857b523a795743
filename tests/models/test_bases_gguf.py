"""Qwen2 and Phi-3 from a .gguf file (written here with the ``gguf`` package): detlora's source
converts it through transformers' reader, and the model computes what transformers computes
from the same file. (llama.cpp writes Mistral as "llama", which transformers reads as Llama.)"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_gguf import write_checkpoint_gguf
from tests.helpers.tiny_hf import PagedKV, make_base_checkpoint, rel_err

from detlora.models.loader import load_model
from detlora.models.sources import gguf_architecture, resolve_model


@pytest.mark.parametrize("arch,name", [("qwen2", "Qwen2ForCausalLM"),
                                       ("phi3", "Phi3ForCausalLM")])
def test_gguf_file_runs_as_transformers_reads_it(arch, name, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("DETLORA_CACHE", str(tmp_path / "cache"))
    base = make_base_checkpoint(tmp_path / "hf", arch)
    file = write_checkpoint_gguf(base, tmp_path / "tiny.gguf", arch)
    assert gguf_architecture(file) == name
    model = load_model(resolve_model(str(file)))
    assert model.spec.architecture == name
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name).eval()
    ids = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    model.allocate_kv_cache(num_blocks=4, block_size=4)
    with torch.no_grad():
        got = model(PagedKV(4, 4).step({0: ids}))
        want = hf(input_ids=torch.tensor([ids])).logits[0].float()
    assert rel_err(got, want) < 1e-4
