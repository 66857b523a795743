"""Models on CUDA in bf16, per determinism level: the oracle test of tests/models (mixed-adapter
batch over a paged cache, then a decode step), and the bit-level promises: batch_invariant
logits of a prompt are torch.equal alone, inside a mixed batch, and across prefill / chunked
prefill / decode; run_to_run and batch_invariant repeat a fixed batch bit for bit.

The reference is Hugging Face + PEFT in fp32 when both are installed, else detlora's CPU fp32
path (which tests/models proves equal to them); checkpoints are written with transformers when
it is installed, else directly.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("safetensors")


from tests.helpers import tiny_hf as H  # noqa: E402

HAVE_HF = all(importlib.util.find_spec(m) is not None for m in ("transformers", "peft"))
DEV, DTYPE = "cuda", torch.bfloat16
LEVELS = ("fast", "run_to_run", "batch_invariant")
ARCHS = {"llama": dict(rope_scaling=True, tie=True), "qwen3": {}}
BLOCK = 16
# bf16 against fp32, through 2 layers with random weights (the CPU bf16 path reaches ~2.3e-2
# max and ~1.5e-2 norm-relative error on these models).
MAX_TOL, NORM_TOL = 8e-2, 4e-2


_ADAPTER_IDS: dict[str, int] = {}


def _request(path: Path):
    """One LoRARequest per adapter directory, with a stable id."""
    from detlora.lora import LoRARequest

    return LoRARequest(path.name, _ADAPTER_IDS.setdefault(str(path), len(_ADAPTER_IDS) + 1),
                       path)


def _model(base, level, device=None, dtype=None, max_loras=3):
    from detlora.layers.backend import make_backend
    from detlora.lora import LoRAConfig
    from detlora.lora.manager import LoRAManager
    from detlora.models.loader import load_model

    device, dtype = device or DEV, dtype or DTYPE
    backend = make_backend(device, level, dtype=dtype, max_lora_rank=16, kernels=True)
    model = load_model(base, dtype=dtype, device=device, backend=backend,
                       lora_config=LoRAConfig(max_loras, 16))
    model.allocate_kv_cache(num_blocks=128, block_size=BLOCK)
    return model, LoRAManager(model)


class CPUReference:
    """detlora's CPU fp32 path as the oracle (equal to HF + PEFT per tests/models)."""

    def __init__(self, base: Path) -> None:
        from detlora.layers.backend import make_backend
        from detlora.lora import LoRAConfig
        from detlora.lora.manager import LoRAManager
        from detlora.models.loader import load_model

        self.model = load_model(base, dtype=torch.float32, backend=make_backend("cpu"),
                                lora_config=LoRAConfig(2, 16))
        self.model.allocate_kv_cache(num_blocks=64, block_size=BLOCK)
        self.manager = LoRAManager(self.model)

    @torch.no_grad()
    def logits(self, ids: list[int], adapter: Path | None = None) -> torch.Tensor:
        slots = None if adapter is None else {0: self.manager.add(_request(adapter))}
        return self.model(H.PagedKV(64, BLOCK).step({0: ids}, slots, 2))


@pytest.fixture(scope="module", params=list(ARCHS))
def assets(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"gpu-{request.param}")
    kw = ARCHS[request.param]
    if HAVE_HF:
        base = H.make_checkpoint(root / "base", request.param, **kw)
        a1 = H.make_adapter(base, root / "a1", r=8, alpha=16, seed=1)
        a2 = H.make_adapter(base, root / "a2", r=4, alpha=8, use_rslora=True, seed=2,
                            targets=["q_proj", "v_proj", "o_proj", "down_proj", "up_proj"])
        ref = H.HFReference(base)
    else:
        base = H.write_random_checkpoint(root / "base", request.param, **kw)
        a1 = H.write_random_adapter(base, root / "a1", r=8, alpha=16, seed=1)
        a2 = H.write_random_adapter(base, root / "a2", r=4, alpha=8, use_rslora=True, seed=2,
                                    targets=["q_proj", "v_proj", "o_proj", "down_proj",
                                             "up_proj"])
        ref = CPUReference(base)
    return base, a1, a2, ref


def _prompts(lengths, seed, vocab=320):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.float().cpu(), want.float().cpu()
    assert not got.isnan().any()
    assert float((got - want).abs().max() / want.abs().max()) < MAX_TOL
    assert float((got - want).norm() / want.norm()) < NORM_TOL


@pytest.mark.parametrize("level", LEVELS)
def test_oracle_mixed_batch_then_decode(assets, level):
    base, a1, a2, ref = assets
    model, manager = _model(base, level)
    adapters = [a1, a2, None, a1]
    reqs = [None if a is None else _request(a) for a in adapters]
    lengths = [5, 17, 3, 33]
    prompts = _prompts(lengths, seed=1)
    slots = dict(enumerate(manager.activate(reqs)))
    kv = H.PagedKV(128, BLOCK, seed=2, device=DEV)
    with torch.no_grad():
        got = H.split_rows(model(kv.step(dict(enumerate(prompts)), slots, 3)), lengths)
    for ids, path, logits in zip(prompts, adapters, got, strict=True):
        _close(logits, ref.logits(ids, path))
    nxt = _prompts([1] * 4, seed=3)
    with torch.no_grad():
        dec = model(kv.step({s: nxt[s] for s in range(4)}, slots, 3))
    for s in range(4):
        _close(dec[s], ref.logits(prompts[s] + nxt[s], adapters[s])[-1])


@pytest.mark.parametrize("level", ["run_to_run", "batch_invariant"])
def test_fixed_batch_repeats_bit_for_bit(assets, level):
    base, a1, a2, _ = assets
    model, manager = _model(base, level)
    reqs = [_request(a1), None, _request(a2)]
    slots = dict(enumerate(manager.activate(reqs)))
    prompts = _prompts([40, 7, 120], seed=4)
    outs = []
    for _ in range(3):
        with torch.no_grad():
            outs.append(model(H.PagedKV(128, BLOCK, seed=5, device=DEV)
                              .step(dict(enumerate(prompts)), slots, 3)))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_batch_invariant_alone_equals_in_mixed_batches(assets):
    base, a1, a2, _ = assets
    model, manager = _model(base, "batch_invariant")
    r1, r2 = _request(a1), _request(a2)
    (target,) = _prompts([37], seed=6)
    with torch.no_grad():
        alone = model(H.PagedKV(128, BLOCK, seed=7, device=DEV)
                      .step({0: target}, {0: manager.add(r1)}, 3))
        # Batches of 2 to 13 sequences, short and long, with and without adapters.
        for trial, lengths in enumerate([(1,), (64, 3, 9, 120, 2), (1,) * 7 + (33,) * 5]):
            others = _prompts(list(lengths), seed=20 + trial)
            reqs = [(r2, None, r1)[k % 3] for k in range(len(others))] + [r1]
            slots = manager.activate(reqs)
            batch = H.PagedKV(128, BLOCK, seed=30 + trial, device=DEV).step(
                dict(enumerate([*others, target])), dict(enumerate(slots)), 3)
            mixed = H.split_rows(model(batch), [*lengths, len(target)])[-1]
            assert torch.equal(alone, mixed), f"a batch of {len(lengths) + 1} changed the bits"


def test_batch_invariant_prefill_chunk_and_decode_agree(assets):
    """The logits of one position are the same bits whether computed in a full prefill, in
    the second chunk of a chunked prefill, or in a decode step."""
    base, a1, _, _ = assets
    model, manager = _model(base, "batch_invariant")
    slot = {0: manager.add(_request(a1))}
    (p,) = _prompts([45], seed=8)
    with torch.no_grad():
        full = model(H.PagedKV(128, BLOCK, seed=9, device=DEV).step({0: p}, slot, 3))
        kv = H.PagedKV(128, BLOCK, seed=10, device=DEV)
        first = model(kv.step({0: p[:20]}, slot, 3))
        chunk = model(kv.step({0: p[20:44]}, slot, 3))
        decode = model(kv.step({0: p[44:]}, slot, 3))
    assert torch.equal(first, full[:20])
    assert torch.equal(chunk, full[20:44])
    assert torch.equal(decode, full[44:])
