"""The CUDA code path (every op a Triton kernel, as make_backend binds it on a GPU) run in
Triton's CPU interpreter, fp16 (the interpreter's bf16 tl.dot is wrong): it must match
Hugging Face + PEFT, and under batch_invariant a prompt's logits must not depend on its batch.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_hf import (
    HFReference,
    PagedKV,
    make_adapter,
    make_checkpoint,
    rel_err,
    split_rows,
)

from detlora.layers.backend import make_backend
from detlora.lora import LoRAConfig, LoRARequest
from detlora.lora.manager import LoRAManager
from detlora.models.loader import load_model
from detlora.ops._runtime import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")

TOL = 1e-2  # fp16 against fp32, relative to the largest logit


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("kernels")
    base = make_checkpoint(root / "base", "qwen3")
    return (base, make_adapter(base, root / "a1", seed=1),
            make_adapter(base, root / "a2", r=4, alpha=8, seed=2), HFReference(base))


def _model(base, level, reduction=None):
    backend = make_backend("cpu", level, reduction, dtype=torch.float16, kernels=True,
                           max_lora_rank=8)
    assert not any(v.endswith("_ref") for v in backend.impls.values())
    model = load_model(base, dtype=torch.float16, backend=backend,
                       lora_config=LoRAConfig(max_loras=2, max_lora_rank=8))
    model.allocate_kv_cache(num_blocks=32, block_size=4)
    return model, LoRAManager(model)


def test_fast_kernels_match_hf(qwen3):
    """cuBLAS-style linear (torch), split-KV attention, atomic shrink."""
    base, a1, a2, ref = qwen3
    model, manager = _model(base, "fast")
    paths = [a1, None, a2]
    slots = manager.activate([LoRARequest("a1", 1, a1), None, LoRARequest("a2", 2, a2)])
    prompts = [[(7 * i + 3 * j) % 300 for j in range(n)] for i, n in enumerate([5, 8, 3])]
    batch = PagedKV(32, 4, seed=3).step(dict(enumerate(prompts)), dict(enumerate(slots)), 2)
    with torch.no_grad():
        got = split_rows(model(batch), [5, 8, 3])
    for ids, path, logits in zip(prompts, paths, got, strict=True):
        assert logits.dtype == torch.float32
        assert rel_err(logits, ref.logits(ids, path)) < TOL


@pytest.mark.parametrize("reduction", [None, "ordered_bi"])  # None: the level's in_gemm
def test_batch_invariant_kernels(qwen3, reduction):
    """Match HF, and a prompt's logits alone equal its logits inside a mixed batch, with the
    shrink in the GEMM (the default) or as its own split-invariant kernel."""
    base, a1, a2, ref = qwen3
    model, manager = _model(base, "batch_invariant", reduction)
    r1, r2 = LoRARequest("a1", 1, a1), LoRARequest("a2", 2, a2)
    target = [(5 * j + 1) % 300 for j in range(9)]
    others = [[(3 * j + 2) % 300 for j in range(n)] for n in (6, 2, 11)]
    with torch.no_grad():
        alone = model(PagedKV(32, 4, seed=4).step({0: target}, {0: manager.add(r1)}, 2))
        slots = manager.activate([r2, None, r1, r1])
        batch = PagedKV(32, 4, seed=5).step(dict(enumerate([*others, target])),
                                            dict(enumerate(slots)), 2)
        mixed = split_rows(model(batch), [6, 2, 11, 9])
    assert torch.equal(alone, mixed[-1])
    for ids, path, logits in zip([*others, target], [a2, None, a1, a1], mixed, strict=True):
        assert rel_err(logits, ref.logits(ids, path)) < TOL


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fused_attention_inputs_keep_the_bits(tmp_path, arch):
    """The backend's fused rotary + KV write (and, without q/k norms, the q|k|v LoRA expand
    fused into it) gives the logits of the unfused ops: a model on the same backend without
    the fused ops is compared bit for bit, with and without an adapter in the batch."""
    import dataclasses

    base = make_checkpoint(tmp_path / "base", arch)
    a1 = make_adapter(base, tmp_path / "a1", seed=1)
    backend = make_backend("cpu", "batch_invariant", dtype=torch.float16, kernels=True,
                           max_lora_rank=8)
    assert backend.rotary_write_kv is not None
    assert backend.lora_expand_rotary_write_kv is not None
    unfused = dataclasses.replace(backend, rotary_write_kv=None,
                                  lora_expand_rotary_write_kv=None)
    outs = []
    for b in (backend, unfused):
        model = load_model(base, dtype=torch.float16, backend=b,
                           lora_config=LoRAConfig(max_loras=2, max_lora_rank=8))
        model.allocate_kv_cache(num_blocks=32, block_size=4)
        manager = LoRAManager(model)
        slots = manager.activate([LoRARequest("a1", 1, a1), None])
        prompts = {0: [3, 1, 4, 1, 5, 9, 2], 1: [2, 7, 1, 8]}
        batch = PagedKV(32, 4, seed=6).step(prompts, dict(enumerate(slots)), 2)
        with torch.no_grad():
            outs.append(model(batch))
    assert torch.equal(outs[0], outs[1])
