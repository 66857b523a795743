"""LoRAManager: slot assignment, LRU eviction, reloads, and refusals."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.adapter_files import tiny_model, write_adapter

from detlora.lora.manager import LoRAManager
from detlora.lora.request import LoRARequest


@pytest.fixture
def adapters(tmp_path):
    return [LoRARequest(f"ad{i}", i, str(write_adapter(tmp_path / f"ad{i}", seed=i,
                                                       r=2 + 2 * i, alpha=8)))
            for i in (1, 2, 3)]


def _slot_buffers(model, slot):
    return [(lin.lora.lora_a[slot].clone(), lin.lora.lora_b[slot].clone(),
             lin.lora.lora_scale[slot].clone()) for lin, _ in model.lora_linears()]


def _same(x, y):
    return all(torch.equal(a, b) for xs, ys in zip(x, y, strict=True)
               for a, b in zip(xs, ys, strict=True))


def test_slots_for_a_batch(model, adapters):
    m = LoRAManager(model)
    r1, r2, _ = adapters
    slots = m.activate([r1, None, r2, r1])
    assert slots[1] == -1 and slots[0] == slots[3] and sorted({slots[0], slots[2]}) == [0, 1]
    assert m.slot_of(1) == slots[0] and m.slot_of(3) is None
    assert m.activate([r2]) == [slots[2]]
    assert m.loads == 2  # resident adapters are not read again


def test_slot_holds_the_adapter(model, adapters):
    m = LoRAManager(model)
    slot = m.add(adapters[1])  # r = 6 in slots of max_rank 8, scale = 8 / 6
    from detlora.lora.peft_loader import load_peft_adapter

    ad = load_peft_adapter(adapters[1].lora_path, model.lora_target_shapes(), 8)
    qkv = model.layers[1].self_attn.qkv_proj.lora
    k = ad.modules["model.layers.1.self_attn.k_proj"]
    assert torch.equal(qkv.lora_a[slot, 1, :6], k.a)
    assert torch.equal(qkv.lora_b[slot, 64:96, :6], k.b)
    assert torch.count_nonzero(qkv.lora_a[slot, :, 6:]) == 0
    assert qkv.lora_scale[slot] == pytest.approx(8 / 6)


def test_lru_eviction_and_identical_reload(model, adapters):
    m = LoRAManager(model)  # max_loras = 2
    r1, r2, r3 = adapters
    s1, s2 = m.activate([r1, r2])
    before = _slot_buffers(model, s1)
    m.activate([r2])  # r1 is now the least recently used
    (s3,) = m.activate([r3])
    assert s3 == s1 and m.slot_of(1) is None and m.resident() == [2, 3]
    (s1_again,) = m.activate([r1])  # evicts r2, the LRU now
    assert s1_again == s2 and m.resident() == [3, 1]
    assert _same(_slot_buffers(model, s1_again), before)
    # r1 came back from the host cache: a copy, not a disk read.
    assert m.loads == 3 and m.stats.swaps == 4 and m.stats.host_hits == 1
    assert m.stats.slot_evictions == 2 and m.stats.host_misses == 3


def test_batch_adapters_are_never_evicted(model, adapters):
    m = LoRAManager(model)
    r1, r2, r3 = adapters
    m.activate([r1])
    m.activate([r2])
    # r1 is LRU, but this batch needs it: r2 must go.
    slots = m.activate([r3, r1])
    assert sorted(m.resident()) == [1, 3] and slots[1] == m.slot_of(1)


def test_too_many_adapters_in_one_batch(model, adapters):
    with pytest.raises(ValueError, match="the step uses 3 distinct adapters but only max_loras=2"):
        LoRAManager(model).activate(adapters)


def test_bad_adapter_evicts_nothing(model, adapters, tmp_path):
    m = LoRAManager(model)
    m.activate(adapters[:2])
    bad = LoRARequest("bad", 9, str(write_adapter(tmp_path / "bad", use_dora=True)))
    with pytest.raises(ValueError, match="DoRA"):
        m.activate([bad])
    assert m.resident() == [1, 2]


def test_remove_frees_and_clears(model, adapters):
    m = LoRAManager(model)
    slot = m.add(adapters[0])
    assert m.remove(1) and not m.remove(1)
    assert all(torch.count_nonzero(b[0]) == 0 for b in _slot_buffers(model, slot))
    assert m.add(adapters[1]) == slot


def test_adapter_changed_on_disk(model, adapters, tmp_path):
    m = LoRAManager(model, max_cpu_loras=2)
    r1, r2, r3 = adapters
    m.activate([r1])
    m.activate([r2, r3])  # evicts r1 from its slot and from the host cache
    assert m.host.cached() == [2, 3] and m.stats.host_evictions == 1
    write_adapter(tmp_path / "ad1", seed=99, r=4, alpha=8)  # same path, new weights
    with pytest.raises(ValueError, match="changed on disk"):
        m.activate([r1])
    assert m.resident() == [2, 3] and 1 not in m.host.cached()


def test_one_id_one_path(model, adapters):
    m = LoRAManager(model)
    m.add(adapters[0])
    with pytest.raises(ValueError, match="one id must name one adapter"):
        m.add(LoRARequest("other", 1, adapters[1].lora_path))


def test_one_step_cannot_give_an_id_two_paths(model, adapters):
    m = LoRAManager(model)
    with pytest.raises(ValueError, match="one id must name one adapter"):
        m.activate([adapters[0], LoRARequest("other", 1, adapters[1].lora_path)])
    assert m.loads == 0 and m.resident() == []


def test_a_failed_load_pins_nothing(model, adapters, tmp_path):
    """A mistyped path is an error that leaves the id free for the right one."""
    m = LoRAManager(model)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        m.add(LoRARequest("ad1", 1, str(tmp_path / "typo")))
    assert m.resident() == [] and m.loads == 0
    slot = m.add(adapters[0])  # same id, the right path
    assert m.slot_of(1) == slot and m.loads == 1
    with pytest.raises(ValueError, match="one id must name one adapter"):
        m.add(LoRARequest("ad1", 1, str(tmp_path / "typo")))  # now the id is taken


def test_fused_slices_need_one_scale(model, tmp_path):
    path = write_adapter(tmp_path / "a", alpha_pattern={"k_proj": 4})
    with pytest.raises(ValueError, match="need one scale"):
        LoRAManager(model).add(LoRARequest("a", 1, str(path)))


def test_lora_batch_groups_tokens(model):
    batch = LoRAManager(model).lora_batch(torch.tensor([1, -1, 0, 1], dtype=torch.int32))
    assert batch.groups.num_adapters == 2
    with pytest.raises(ValueError, match="outside"):
        LoRAManager(model).lora_batch(torch.tensor([2], dtype=torch.int32))


def test_model_without_slots(tmp_path):
    from tests.helpers.adapter_files import CONFIG

    from detlora.layers.backend import make_backend
    from detlora.models.llama import LlamaForCausalLM
    from detlora.models.spec import ModelSpec

    plain = LlamaForCausalLM(ModelSpec.from_config(CONFIG), backend=make_backend("cpu"))
    with pytest.raises(ValueError, match="without LoRA slots"):
        LoRAManager(plain)


def test_request_checks():
    with pytest.raises(ValueError, match="id \\(lora_int_id\\) must be a positive int"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        LoRARequest("", 1, "/x")
    with pytest.raises(ValueError, match="path must be a non-empty path"):
        LoRARequest("a", 1, "")
    assert tiny_model(1, 1).lora_config.max_loras == 1


def test_begin_step_and_slot_for(model, adapters):
    m = LoRAManager(model)
    r1, r2, r3 = adapters
    m.begin_step([r1, None, r2])
    s1, s2 = m.slot_for(r1), m.slot_for(r2)
    assert m.slot_for(None) == -1 and {s1, s2} == {0, 1}
    assert m.adapter_hash(r1) == m.adapter_hash(r1.id) != m.adapter_hash(r2)
    # r3 does not belong to the step: both slots are pinned by it.
    with pytest.raises(ValueError, match="hold adapters of the current step"):
        m.slot_for(r3)
    m.begin_step([r3, r2])  # now r1 is free to go
    assert m.slot_for(r3) == s1 and m.slot_for(r2) == s2 and m.slot_of(r1.id) is None


def test_adapter_hash_of_an_unknown_adapter(model, adapters):
    with pytest.raises(ValueError, match="never been loaded"):
        LoRAManager(model).adapter_hash(adapters[0])


def test_a_write_waits_only_for_launched_steps(model, adapters):
    """The slot writer marks a slot's last use once its step is launched (the next
    begin_step or prefetch), never while the step is being prepared; a slot the step being
    prepared reads cannot be written."""
    m = LoRAManager(model)
    w = m.writer
    r1, r2, r3 = adapters
    s1, s2 = m.activate([r1, r2])
    image, _ = m.host.get(r1)
    with pytest.raises(ValueError, match="read by the step being prepared"):
        w.write(s1, image)
    m.host.release(image)
    assert w.marks == 0 and not w._last_use  # nothing launched yet
    m.begin_step([r3, r2])  # the first step is launched now
    m.slot_for(r3)  # evicts r1: its write marks the launched step's slots first
    assert w.marks == 1 and w._last_use == {s2: 1}  # s1 was just rewritten
    m.slot_for(r2)
    m.prefetch([])  # launched: s1 (r3) and s2 wait for this step before any later write
    assert w._in_step == set() and w._used == {s1, s2}
