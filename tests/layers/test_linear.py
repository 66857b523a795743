"""Linear and MergedLinear with LoRA slots on the CPU reference path, against the formula
y = x W^T + b + scale * (x A^T) B^T, computed in float64."""

from __future__ import annotations

import pytest
import torch

from detlora.layers.backend import make_backend
from detlora.layers.linear import Linear, MergedLinear
from detlora.layers.lora_slots import LoRAConfig
from detlora.ops.adapter_groups import group_tokens

BACKEND = make_backend("cpu")
SIZES = (48, 16, 16)  # q/k/v widths of a GQA layer: unequal slices


def _merged(max_loras=3, max_rank=8, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = MergedLinear(40, SIZES, backend=BACKEND, bias=bias,
                         lora=LoRAConfig(max_loras, max_rank))
    for s, n in enumerate(SIZES):
        layer.load_weight(torch.randn(n, 40, generator=g), s)
        if bias:
            layer.load_bias(torch.randn(n, generator=g), s)
    return layer


def _adapter(rank, g, sizes=SIZES, skip=()):
    a = [None if s in skip else torch.randn(rank, 40, generator=g) for s in range(len(sizes))]
    b = [None if s in skip else torch.randn(n, rank, generator=g) for s, n in enumerate(sizes)]
    return a, b


def _expected(layer, x, adapters, slots):
    y = x.double() @ layer.weight.double().T + layer.bias.double()
    offsets = layer.local_offsets
    for m, slot in enumerate(slots):
        if slot < 0:
            continue
        a, b, scale = adapters[slot]
        for s in range(len(SIZES)):
            if a[s] is None:
                continue
            h = scale * (x[m].double() @ a[s].double().T)
            y[m, offsets[s]:offsets[s + 1]] += h @ b[s].double().T
    return y


def test_merged_linear_with_mixed_slots():
    g = torch.Generator().manual_seed(1)
    layer = _merged()
    adapters = {0: (*_adapter(8, g), 2.0), 1: (*_adapter(3, g, skip=(1,)), 0.5)}
    for slot, (a, b, scale) in adapters.items():
        layer.set_lora(slot, a, b, scale)
    slots = [0, -1, 1, 1, -1, 0, 2]  # slot 2 was never written: zero update
    x = torch.randn(len(slots), 40, generator=g)
    groups = group_tokens(torch.tensor(slots, dtype=torch.int32), 3)
    y = layer(x, groups)
    adapters[2] = ([None] * 3, [None] * 3, 0.0)
    want = _expected(layer, x, adapters, slots)
    assert float((y.double() - want).abs().max() / want.abs().max()) < 1e-5
    base = layer(x)  # no LoRA batch: the base projection alone
    rows = [m for m, s in enumerate(slots) if s in (-1, 2)]
    assert torch.equal(y[rows], base[rows])  # slot -1 rows get no update, bit for bit
    assert not torch.allclose(y[[0, 2]], base[[0, 2]])


def test_clear_slot_removes_the_update():
    g = torch.Generator().manual_seed(2)
    layer = _merged()
    layer.set_lora(1, *_adapter(4, g), 1.5)
    x = torch.randn(5, 40, generator=g)
    groups = group_tokens(torch.ones(5, dtype=torch.int32), 3)
    assert not torch.equal(layer(x, groups), layer(x))
    layer.clear_lora(1)
    assert torch.equal(layer(x, groups), layer(x))


def test_plain_linear_lora():
    g = torch.Generator().manual_seed(3)
    layer = Linear(40, 24, backend=BACKEND, lora=LoRAConfig(2, 4))
    w = torch.randn(24, 40, generator=g)
    a, b = torch.randn(4, 40, generator=g), torch.randn(24, 4, generator=g)
    layer.load_weight(w)
    layer.set_lora(1, [a], [b], 0.25)
    x = torch.randn(3, 40, generator=g)
    y = layer(x, group_tokens(torch.tensor([1, -1, 1], dtype=torch.int32), 2))
    want = x.double() @ w.double().T
    want[[0, 2]] += 0.25 * (x[[0, 2]].double() @ a.double().T) @ b.double().T
    assert float((y.double() - want).abs().max() / want.abs().max()) < 1e-5


def test_slot_buffers_are_zero_padded():
    g = torch.Generator().manual_seed(4)
    layer = _merged(max_rank=8)
    a, b = _adapter(3, g)
    layer.set_lora(0, a, b, 1.0)
    slots = layer.lora
    assert torch.equal(slots.lora_a[0, 0, :3], a[0])
    assert torch.count_nonzero(slots.lora_a[0, :, 3:]) == 0
    assert torch.count_nonzero(slots.lora_b[0, :, 3:]) == 0
    assert torch.equal(slots.lora_b[0, 48:64, :3], b[1])
    assert slots.lora_scale.dtype == torch.float32 and slots.lora_scale[0] == 1.0


def test_lora_buffers_are_not_weights():
    layer = _merged()
    assert set(layer.state_dict()) == {"weight", "bias"}


@pytest.mark.parametrize("bad,match", [
    (dict(slot=3), r"slot 3 is outside \[0, 2\]"),
    (dict(rank=9), "rank 9 exceeds max_lora_rank 8"),
    (dict(a_in=39), r"A must have shape \[r, 40\]"),
    (dict(b_out=15), r"slice 1: B must have shape \[16, 4\]"),
    (dict(half=True), "both be given or both be None"),
    (dict(slices=2), "expected 3 A and B tensors"),
])
def test_set_lora_refusals(bad, match):
    g = torch.Generator().manual_seed(5)
    layer = _merged()
    rank = bad.get("rank", 4)
    a, b = _adapter(rank, g)
    if "a_in" in bad:
        a[0] = torch.randn(rank, bad["a_in"])
    if "b_out" in bad:
        b[1] = torch.randn(bad["b_out"], rank)
    if bad.get("half"):
        b[2] = None
    if "slices" in bad:
        a, b = a[:2], b[:2]
    with pytest.raises(ValueError, match=match):
        layer.set_lora(bad.get("slot", 0), a, b, 1.0)


def test_load_weight_checks_shape_and_slice():
    layer = _merged()
    with pytest.raises(ValueError, match=r"weight must have shape \(16, 40\)"):
        layer.load_weight(torch.zeros(48, 40), 1)
    with pytest.raises(ValueError, match="slice_index 3"):
        layer.load_weight(torch.zeros(16, 40), 3)
    with pytest.raises(ValueError, match="no bias"):
        MergedLinear(40, SIZES, backend=BACKEND).load_bias(torch.zeros(48), 0)


def test_layer_without_slots_refuses_adapters():
    layer = Linear(8, 8, backend=BACKEND)
    with pytest.raises(ValueError, match="without LoRA slots"):
        layer.set_lora(0, [torch.zeros(1, 8)], [torch.zeros(8, 1)], 1.0)


IN_GEMM = make_backend("cpu", lora_reduction="in_gemm")


def test_in_gemm_layer_matches_the_formula_and_keeps_a_in_the_weight():
    """in_gemm: A rides as extra rows of the GEMM weight; weight and lora_a are views of it."""
    g = torch.Generator().manual_seed(1)
    layer = MergedLinear(40, SIZES, backend=IN_GEMM, bias=True, lora=LoRAConfig(3, 8))
    for s, n in enumerate(SIZES):
        layer.load_weight(torch.randn(n, 40, generator=g), s)
        layer.load_bias(torch.randn(n, generator=g), s)
    n = sum(SIZES)
    assert layer.gemm_weight.shape == (n + 3 * 3 * 8, 40)
    assert layer.weight.data_ptr() == layer.gemm_weight.data_ptr()
    assert layer.lora.lora_a.data_ptr() == layer.gemm_weight[n:].data_ptr()
    assert set(layer.state_dict()) == {"weight", "bias"}
    adapters = {0: (*_adapter(8, g), 2.0), 1: (*_adapter(3, g, skip=(1,)), 0.5)}
    for slot, (a, b, scale) in adapters.items():
        layer.set_lora(slot, a, b, scale)
    assert torch.equal(layer.gemm_weight[n:n + 8], adapters[0][0][0])  # slot 0, q's A
    assert float(layer.gemm_bias[n:].abs().max()) == 0.0
    slots = [0, -1, 1, 1, -1, 0, 2]
    x = torch.randn(len(slots), 40, generator=g)
    y = layer(x, group_tokens(torch.tensor(slots, dtype=torch.int32), 3))
    assert y.stride(0) == n + 3 * 3 * 8  # a view of the one GEMM's output
    adapters[2] = ([None] * 3, [None] * 3, 0.0)
    want = _expected(layer, x, adapters, slots)
    assert float((y.double() - want).abs().max() / want.abs().max()) < 1e-5
    layer.clear_lora(0)
    assert float(layer.gemm_weight[n:n + 3 * 8].abs().max()) == 0.0
