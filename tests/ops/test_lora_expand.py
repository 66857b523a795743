"""LoRA expand in Triton's interpreter: against the torch reference and a float64 oracle,
unequal slice widths, rows without adapter untouched, strided outputs, bad inputs."""

import pytest
import torch
from tests.helpers.slot_ranks import zero_past_ranks

from detlora.ops.adapter_groups import group_tokens
from detlora.ops.lora_configs import ExpandConfig
from detlora.ops.lora_expand import lora_expand, lora_expand_ref


def make(m, r, offsets, adapters, seed, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    s, n = len(offsets) - 1, offsets[-1]
    h = torch.randn(s, m, r, generator=g)
    b = (torch.randn(adapters, n, r, generator=g) / r**0.5).half()
    ids = torch.randint(-1, adapters, (m,), generator=g, dtype=torch.int32)
    ids[0] = 0
    y = torch.randn(m, n, generator=g).to(dtype)
    return y, h, b, ids


@pytest.mark.parametrize("m,r,offsets", [
    (1, 16, [0, 96, 128, 160]),   # GQA q/k/v: unequal widths
    (3, 1, [0, 40]),
    (17, 24, [0, 64, 100]),
    (130, 8, [0, 48, 96, 144]),
    (5, 64, [0, 200]),
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # the base output's dtype
def test_matches_reference_and_oracle(m, r, offsets, dtype):
    y, h, b, ids = make(m, r, offsets, 3, seed=m + r, dtype=dtype)
    got = lora_expand(y.clone(), h, b, ids, offsets)
    want = lora_expand_ref(y.clone(), h, b, ids, offsets)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    oracle = lora_expand_ref(y.double(), h.double(), b.double(), ids, offsets)
    assert float((got.double() - oracle).norm() / oracle.norm()) < 2e-3
    assert torch.equal(got[ids < 0], y[ids < 0])  # rows without adapter are untouched


def test_rows_are_independent_of_the_batch():
    y, h, b, ids = make(21, 16, [0, 64, 96, 128], 2, seed=9)
    batch = lora_expand(y.clone(), h, b, ids, [0, 64, 96, 128])
    for i in (0, 5, 20):
        alone = lora_expand(y[i:i + 1].clone(), h[:, i:i + 1].contiguous(), b, ids[i:i + 1],
                            [0, 64, 96, 128], config=ExpandConfig(16, 32, 16))
        assert torch.equal(batch[i], alone[0])


def test_strided_output_view_is_updated_in_place():
    y, h, b, ids = make(6, 8, [0, 32, 48], 2, seed=10)
    big = torch.randn(6, 80).half()
    view = big[:, 16:64]  # the LoRA columns of a wider base output
    view.copy_(y)
    before = big.clone()
    lora_expand(view, h, b, ids, [0, 32, 48])
    want = lora_expand_ref(y.clone(), h, b, ids, [0, 32, 48])
    torch.testing.assert_close(big[:, 16:64], want, rtol=2e-3, atol=2e-3)
    assert torch.equal(big[:, :16], before[:, :16]) and torch.equal(big[:, 64:], before[:, 64:])


def test_equal_widths_need_no_offsets():
    y, h, b, ids = make(4, 8, [0, 16, 32], 2, seed=11)
    got = lora_expand(y.clone(), h, b, group_tokens(ids, 2))
    torch.testing.assert_close(got, lora_expand_ref(y.clone(), h, b, ids), rtol=2e-3, atol=2e-3)


# Ranks per (slot, slice) for 3 slots of full rank 32 and 3 slices: partial ranks, an
# untargeted slice (0) and a slot with no targeted slice at all.
SLOT_RANKS = torch.tensor([[8, 0, 32], [17, 16, 3], [0, 0, 0]], dtype=torch.int32)


def test_slot_ranks_sum_each_slot_over_its_own_ranks():
    offsets = [0, 48, 64, 80]
    y, h, b, ids = make(13, 32, offsets, 3, seed=21)
    ids[:3] = torch.tensor([0, 1, 2], dtype=torch.int32)
    h, b = zero_past_ranks(h, b, ids, offsets, SLOT_RANKS)
    got = lora_expand(y.clone(), h, b, ids, offsets, slot_ranks=SLOT_RANKS)
    want = lora_expand_ref(y.clone(), h, b, ids, offsets, SLOT_RANKS)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    untouched = (ids < 0) | (ids == 2)
    assert torch.equal(got[untouched], y[untouched])  # no adapter, or no targeted slice
    assert torch.equal(got[ids == 0, 48:64], y[ids == 0, 48:64])  # slot 0's slice 1: rank 0
    for i in (0, 1, 5):  # a row's bits do not depend on the batch
        alone = lora_expand(y[i:i + 1].clone(), h[:, i:i + 1].contiguous(), b, ids[i:i + 1],
                            offsets, slot_ranks=SLOT_RANKS, config=ExpandConfig(16, 32, 32))
        assert torch.equal(got[i], alone[0])


def bad_cases():
    y, h, b, ids = make(4, 8, [0, 16, 32], 2, seed=12)
    return [
        ("slice_offsets must run from 0 to 32", dict(slice_offsets=[0, 16, 30])),
        ("slice_offsets must hold 3 ints", dict(slice_offsets=[0, 32])),
        ("strictly increasing", dict(slice_offsets=[0, 0, 32])),
        ("do not split evenly", dict(y=torch.randn(4, 33).half(), b=torch.randn(2, 33, 8).half(),
                                     slice_offsets=None)),
        ("lora_b rank 4 must match", dict(b=torch.randn(2, 32, 4).half())),
        ("y must have shape", dict(y=torch.randn(5, 32).half())),
        ("y must have dtype", dict(y=torch.randn(4, 32, dtype=torch.float64))),
        ("shrink_out must have dtype", dict(h=h.half())),
        ("1 to 3 slices", dict(h=torch.randn(4, 4, 8), slice_offsets=None)),
        ("adapter id 5", dict(ids=torch.tensor([0, 5, 1, 0], dtype=torch.int32))),
        ("is on meta", dict(b=b.to("meta"))),
        ("config must be an ExpandConfig", dict(config=(16, 16, 16))),
        ("slot_ranks must have dtype", dict(slot_ranks=torch.zeros(2, 2))),
        ("slot_ranks must have shape", dict(slot_ranks=torch.zeros(2, 3, dtype=torch.int32))),
    ], (y, h, b, ids)


@pytest.mark.parametrize("index", range(len(bad_cases()[0])))
def test_bad_input_raises_value_error_naming_it(index):
    cases, (y, h, b, ids) = bad_cases()
    message, override = cases[index]
    args = dict(y=y, h=h, b=b, ids=ids, slice_offsets=[0, 16, 32])
    args.update(override)
    kwargs = {k: args.pop(k) for k in ("config", "slot_ranks") if k in args}
    with pytest.raises(ValueError, match=message):
        lora_expand(args["y"], args["h"], args["b"], args["ids"], args["slice_offsets"], **kwargs)
