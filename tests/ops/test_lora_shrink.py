"""LoRA shrink in Triton's interpreter: every reduction against a float64 oracle, bitwise
repeatability, the ordered_bi tree computed the same way on every path, and every bad input.

fp16 only: the interpreter computes bf16 tl.dot wrongly (docs/design.md); bf16 is GPU-tested.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detlora.ops.adapter_groups import group_tokens
from detlora.ops.lora_configs import (
    BI_BLOCK_K,
    BI_GROUP_CHUNKS,
    CTA_COVERS,
    ShrinkConfig,
    ordered_bi_split,
)
from detlora.ops.lora_shrink import lora_shrink, lora_shrink_ref
from detlora.ops.lora_workspace import LoRAWorkspace

REDUCTIONS = ("atomic", "unsplit", "ordered", "ordered_bi", "tree")
DETERMINISTIC = ("unsplit", "ordered", "ordered_bi", "tree")


def make(m, h, r, s, adapters, seed, none_rows=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g).half()
    a = (torch.randn(adapters, s, r, h, generator=g) / h**0.5).half()
    low = -1 if none_rows else 0
    ids = torch.randint(low, adapters, (m,), generator=g, dtype=torch.int32)
    ids[0] = adapters - 1  # at least one row with an adapter
    scale = torch.rand(adapters, generator=g) + 0.5
    return x, a, ids, scale


def rel_err(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


# (M, H, r, slices, adapters): odd M, H not a multiple of BLOCK_K, ranks 1..64.
SHAPES = [
    (1, 3072, 16, 3, 1),
    (3, 200, 1, 1, 2),
    (17, 1000, 8, 3, 3),
    (17, 640, 24, 2, 2),
    (130, 384, 16, 1, 4),
    (5, 520, 64, 1, 2),
]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("m,h,r,s,adapters", SHAPES)
def test_matches_float64_oracle(reduction, m, h, r, s, adapters):
    x, a, ids, scale = make(m, h, r, s, adapters, seed=m * h + r)
    out = torch.full((s, m, r), float("nan"))  # poisoned: every element must be written
    lora_shrink(x, a, ids, scale, reduction=reduction, out=out)
    ref = lora_shrink_ref(x, a, ids, scale, compute_dtype=torch.float64)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-5
    assert torch.all(out[:, ids < 0] == 0)


@pytest.mark.parametrize("reduction", DETERMINISTIC)
def test_repeated_runs_are_bit_identical(reduction):
    x, a, ids, scale = make(17, 1000, 8, 2, 2, seed=3)
    groups = group_tokens(ids, 2)
    first = lora_shrink(x, a, groups, scale, reduction=reduction)
    for _ in range(2):
        assert torch.equal(lora_shrink(x, a, groups, scale, reduction=reduction), first)


@pytest.mark.parametrize("h", [1000, 1280])
def test_ordered_bi_tree_is_the_same_on_every_path(h):
    """Chunk per CTA, group per CTA, or all of K in one CTA, for any tile: the same bits."""
    x, a, ids, scale = make(19, h, 8, 2, 3, seed=h)
    outs = []
    for covers in CTA_COVERS:
        for bm, bn in ((16, 16), (32, 64)):
            cfg = ShrinkConfig(ordered_bi_split(h), bm, bn, BI_BLOCK_K, 4, 3, BI_GROUP_CHUNKS,
                               covers)
            outs.append(lora_shrink(x, a, ids, scale, reduction="ordered_bi", config=cfg))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    for i in (0, 7, 18):
        alone = lora_shrink(x[i:i + 1], a, ids[i:i + 1], scale, reduction="ordered_bi")
        assert torch.equal(outs[0][:, i], alone[:, 0])


def test_ordered_counters_reset_themselves():
    x, a, ids, scale = make(33, 1000, 8, 2, 2, seed=4)
    ws = LoRAWorkspace("cpu")
    first = lora_shrink(x, a, ids, scale, reduction="ordered", workspace=ws)
    assert ws._counters.numel() > 0 and int(ws._counters.abs().sum()) == 0
    assert torch.equal(lora_shrink(x, a, ids, scale, reduction="ordered", workspace=ws), first)


def test_rows_without_adapter_are_zero_and_others_untouched_by_them():
    x, a, ids, scale = make(9, 300, 8, 2, 2, seed=5)
    ids = torch.tensor([-1, 0, -1, 1, 1, -1, 0, -1, -1], dtype=torch.int32)
    for red in REDUCTIONS:
        out = lora_shrink(x, a, ids, scale, reduction=red)
        assert torch.all(out[:, ids < 0] == 0)
        alone = lora_shrink(x[1:2], a, ids[1:2], scale, reduction="unsplit")
        assert rel_err(out[:, 1:2], alone.double()) < 1e-6


@settings(max_examples=20, deadline=None)
@given(
    m=st.integers(1, 40),
    h=st.integers(16, 700),
    r=st.integers(1, 40),
    s=st.integers(1, 3),
    adapters=st.integers(1, 3),
    reduction=st.sampled_from(REDUCTIONS),
    seed=st.integers(0, 2**16),
)
def test_property_any_shape_matches_oracle(m, h, r, s, adapters, reduction, seed):
    x, a, ids, scale = make(m, h, r, s, adapters, seed)
    out = torch.full((s, m, r), float("nan"))
    lora_shrink(x, a, ids, scale, reduction=reduction, out=out)
    ref = lora_shrink_ref(x, a, ids, scale, compute_dtype=torch.float64)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-5


def test_scale_may_be_a_float():
    x, a, ids, _ = make(4, 200, 8, 1, 2, seed=6)
    got = lora_shrink(x, a, ids, 0.75, reduction="ordered")
    ref = lora_shrink_ref(x, a, ids, torch.full((2,), 0.75), compute_dtype=torch.float64)
    assert rel_err(got, ref) < 1e-5


# ----------------------------------------------------------------------------- bad input


def bad_cases():
    x, a, ids, scale = make(4, 64, 8, 2, 2, seed=7)
    return [
        ("x must have 2 dimensions", dict(x=x[None])),
        ("x must have dtype", dict(x=x.float())),
        ("lora_a must have 4 dimensions", dict(lora_a=a[0])),
        ("lora_a dtype", dict(lora_a=a.to(torch.bfloat16))),
        ("hidden size 64 must match", dict(x=torch.randn(4, 32).half())),
        ("1 to 3 slices", dict(lora_a=torch.randn(2, 4, 8, 64).half())),
        ("rank 8 is outside", dict(workspace=LoRAWorkspace("cpu", max_rank=4))),
        ("adapter id 2, outside", dict(groups=torch.tensor([0, 1, 2, 0], dtype=torch.int32))),
        ("adapter id -2", dict(groups=torch.tensor([0, -2, 1, 0], dtype=torch.int32))),
        ("groups cover 3 rows", dict(groups=ids[:3])),
        ("out must have shape", dict(out=torch.empty(2, 4, 9))),
        ("out must have dtype", dict(out=torch.empty(2, 4, 8, dtype=torch.float16))),
        ("x must be contiguous in its last dimension", dict(x=torch.randn(4, 128).half()[:, ::2])),
        ("scale must have shape", dict(scale=torch.rand(3))),
        ("scale must have dtype", dict(scale=torch.rand(2, dtype=torch.float64))),
        ("reduction must be one of", dict(reduction="sorted")),
        ("config.block_m must be a power of two", dict(config=ShrinkConfig(2, 24, 16, 32))),
        ("config.cta_covers must be one of", dict(config=ShrinkConfig(2, 16, 16, 32,
                                                                      cta_covers="row"))),
        ("atomic sums one chunk per CTA", dict(reduction="atomic",
                                               config=ShrinkConfig(2, 16, 16, 32,
                                                                   group_chunks=2))),
        ("is on meta but x is on cpu", dict(scale=torch.rand(2, device="meta"))),
        ("groups must be AdapterGroups", dict(groups=[0, 1, 0, 1])),
        ("x must have at least one row", dict(x=torch.randn(0, 64).half(),
                                              groups=group_tokens(ids, 2))),
    ], (x, a, ids, scale)


@pytest.mark.parametrize("index", range(len(bad_cases()[0])))
def test_bad_input_raises_value_error_naming_it(index):
    cases, (x, a, ids, scale) = bad_cases()
    message, override = cases[index]
    kwargs = dict(x=x, lora_a=a, groups=ids, scale=scale, reduction="ordered")
    kwargs.update(override)
    with pytest.raises(ValueError, match=message):
        lora_shrink(kwargs.pop("x"), kwargs.pop("lora_a"), kwargs.pop("groups"),
                    kwargs.pop("scale"), **kwargs)
