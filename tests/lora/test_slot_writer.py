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
