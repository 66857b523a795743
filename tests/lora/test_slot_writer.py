"""SlotWriter's CUDA fill (copy_pieces tables, run here in the interpreter) leaves a slot
bit-equal to the torch fill of the CPU path, for adapters of several ranks and targets, over a
slot that held something else (NaN) before."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.adapter_files import tiny_model, write_adapter

from detlora.lora.manager import LoRAManager
from detlora.lora.request import LoRARequest


def _slot(model, slot):
    return [t[slot].clone() for lin, _ in model.lora_linears()
            for t in (lin.lora.lora_a, lin.lora.lora_b, lin.lora.lora_scale, lin.lora.lora_rank)]


@pytest.mark.parametrize("r", [2, 8])
def test_table_fill_equals_the_torch_fill(tmp_path, r):
    model = tiny_model(max_loras=5)
    req = LoRARequest("x", 1, str(write_adapter(tmp_path / "x", seed=r, r=r, alpha=16)))
    m = LoRAManager(model)
    w = m.writer
    image, _ = m.host.get(req)
    src = image.block.data
    w._fill(0, image, src)  # the CPU path: torch copies
    want = _slot(model, 0)
    ranks = torch.stack([lin.lora.lora_rank[0].max() for lin, _ in model.lora_linears()])
    assert set(ranks.tolist()) == {r}  # every linear's slices have the adapter's rank
    for lin, _ in model.lora_linears():
        for t in (lin.lora.lora_a, lin.lora.lora_b, lin.lora.lora_scale):
            t[1:].fill_(float("nan"))
        lin.lora.lora_rank[1:].fill_(-7)
    others = [[t.clone() for t in _slot(model, s)] for s in range(3, m.max_loras)]
    for slot in (1, 2):  # one table per layout serves every slot
        zero, _ = w._slot_views(slot)
        torch._foreach_zero_(zero)
        w._copy_by_table(slot, image, src)
        w._copy_by_table(slot, image, src)  # the cached tables give the same
        got = _slot(model, slot)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert len(w._tables) == 1 and w._scale_table is not None
    for s, before in zip(range(3, m.max_loras), others, strict=True):  # untouched
        assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in
                   zip(_slot(model, s), before, strict=True))
    m.host.release(image)


def test_slot_ranks_per_slice_on_both_paths(tmp_path):
    """Each slice's rank as the adapter gives it (rank_pattern; 0 where it has no module), the
    same from the CPU path's torch fill, the table fill and ``set_slot``; a write over a
    slot that held a higher-rank adapter leaves none of its ranks behind."""
    model = tiny_model(max_loras=3)
    ranks = {"q_proj": 4, "v_proj": 2, "down_proj": 8}
    small = LoRARequest("s", 1, str(write_adapter(
        tmp_path / "s", seed=3, r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"],
        layers=(0,), ranks=ranks, rank_pattern={"v_proj": 2, "down_proj": 8},
        alpha_pattern={"v_proj": 4, "down_proj": 16})))
    full = LoRARequest("f", 2, str(write_adapter(tmp_path / "f", seed=4, r=8, alpha=16)))
    m = LoRAManager(model)
    want = {}
    for (lin, names) in model.lora_linears():
        want[id(lin)] = [ranks.get(n.rsplit(".", 1)[-1], 0) if ".layers.0." in f".{n}" else 0
                         for n in names]
    assert any(any(v) for v in want.values()) and any(not any(v) for v in want.values())
    big, _ = m.host.get(full)
    image, _ = m.host.get(small)
    w = m.writer
    for slot, fill in ((0, "torch"), (1, "table")):
        w._fill(slot, big, big.block.data)  # a rank-8, all-targets adapter first
        if fill == "torch":
            w._fill(slot, image, image.block.data)
        else:
            zero, _ = w._slot_views(slot)
            torch._foreach_zero_(zero)
            w._copy_by_table(slot, image, image.block.data)
        for lin, _ in model.lora_linears():
            assert lin.lora.lora_rank[slot].tolist() == want[id(lin)], (fill, lin)
    ref = tiny_model(max_loras=1)  # set_slot's ranks, through the TP workers' path
    from detlora.lora.peft_loader import load_peft_adapter
    adapter = load_peft_adapter(small.path, ref.lora_target_shapes(), 8)
    for (lin, names), (mine, _) in zip(ref.lora_linears(), model.lora_linears(), strict=True):
        mods = [adapter.modules.get(n) for n in names]
        present = [x for x in mods if x is not None]
        lin.set_lora(0, [x and x.a for x in mods], [x and x.b for x in mods],
                     present[0].scale if present else 0.0)
        assert lin.lora.lora_rank[0].tolist() == mine.lora.lora_rank[0].tolist()
    m.host.release(big)
    m.host.release(image)
