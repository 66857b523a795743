"""An adapter's logits do not depend on its slot, on the other adapters resident, on being
evicted and copied back (from the host cache or from disk), nor on ``max_loras``: the kernel
path (every op a Triton kernel, the in_gemm linear skipping unused slots' tiles) in Triton's
CPU interpreter, fp16, compared bit for bit."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_hf import PagedKV, write_random_adapter, write_random_checkpoint

from detlora.layers.backend import make_backend
from detlora.lora import LoRAConfig, LoRARequest
from detlora.lora.manager import LoRAManager
from detlora.models.loader import load_model
from detlora.ops._runtime import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")

PROMPT = [(5 * j + 1) % 300 for j in range(7)]
TARGETS = [None, ["q_proj", "v_proj"], ["o_proj", "down_proj", "up_proj"]]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("slots")
    base = write_random_checkpoint(root / "base", "llama")
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_random_adapter(
        base, root / f"a{i}", r=(2, 4, 8)[i % 3], targets=TARGETS[i % 3], seed=i)))
        for i in range(64)]
    return base, adapters


def _model(base, level: str, max_loras: int, **manager_args):
    backend = make_backend("cpu", level, None, dtype=torch.float16, kernels=True,
                           max_lora_rank=8)
    model = load_model(base, dtype=torch.float16, backend=backend,
                       lora_config=LoRAConfig(max_loras=max_loras, max_lora_rank=8))
    model.allocate_kv_cache(num_blocks=32, block_size=4)
    return model, LoRAManager(model, **manager_args)


def _logits(model, manager, request, others=(), max_loras=None) -> torch.Tensor:
    """The target prompt's logits with ``request``, alone or beside ``others`` (requests) in
    one batch."""
    slots = manager.activate([request, *others])
    chunks = {0: PROMPT} | {k + 1: [3 + k, 9, 4] for k in range(len(others))}
    batch = PagedKV(32, 4, seed=4).step(chunks, dict(enumerate(slots)),
                                        max_loras or manager.max_loras)
    with torch.no_grad():
        return model(batch)[: len(PROMPT)]


@pytest.mark.parametrize("level", ["batch_invariant", "run_to_run"])
def test_slot_and_residents_change_no_bit(assets, level):
    base, adapters = assets
    target, others = adapters[0], adapters[1:]
    model, manager = _model(base, level, 8)
    alone = _logits(model, manager, target)
    assert manager.slot_of(target.id) == 0
    # Slot 7, seven other adapters resident.
    manager.remove(target.id)
    for r in others[:7]:
        manager.add(r)
    seventh = _logits(model, manager, target)
    assert manager.slot_of(target.id) == 7 and len(manager.resident()) == 8
    assert torch.equal(alone, seventh)
    # Evicted (by eight others), then copied back from the host cache.
    for r in others[7:15]:
        manager.add(r)
    assert manager.slot_of(target.id) is None
    back = _logits(model, manager, target)
    assert torch.equal(alone, back) and manager.stats.host_hits >= 1
    if level == "batch_invariant":  # beside other adapters in one batch, too
        mixed = _logits(model, manager, target, others[20:23])
        assert torch.equal(alone, mixed)


def test_read_again_from_disk_changes_no_bit(assets):
    base, adapters = assets
    model, manager = _model(base, "batch_invariant", 2, max_cpu_loras=2)
    alone = _logits(model, manager, adapters[0])
    for r in adapters[1:4]:
        manager.add(r)  # out of its slot and out of the host cache
    loads = manager.loads
    again = _logits(model, manager, adapters[0])
    assert manager.loads == loads + 1 and torch.equal(alone, again)


def test_one_or_sixty_three_others_and_any_max_loras(assets):
    base, adapters = assets
    target, others = adapters[0], adapters[1:]
    ref_model, ref_manager = _model(base, "batch_invariant", 1)
    ref = _logits(ref_model, ref_manager, target)
    model, manager = _model(base, "batch_invariant", 64)
    manager.add(others[0])
    one = _logits(model, manager, target)
    assert manager.slot_of(target.id) == 1
    for r in others[1:]:
        manager.add(r)
    manager.remove(target.id)
    manager.remove(others[30].id)  # slot 31
    manager.add(others[30])  # into slot 1: the target comes back into slot 31
    many = _logits(model, manager, target)
    assert len(manager.resident()) == 64 and manager.slot_of(target.id) == 31
    # max_loras 1 and 64 give the same bits: every column is summed in the base's K order.
    assert torch.equal(ref, one) and torch.equal(ref, many)
