"""Deferred LoRA shrink (partials summed by the expand) in Triton's interpreter: the same bits
as the reduced shrink followed by the expand, the reference reduction equal to the kernel's,
and every bad input named.

fp16 only: the interpreter computes bf16 tl.dot wrongly (docs/design.md); bf16 is GPU-tested.
"""

import pytest
import torch

from detlora.ops.adapter_groups import group_tokens
from detlora.ops.lora_configs import ShrinkConfig
from detlora.ops.lora_expand import lora_expand, lora_expand_ref
from detlora.ops.lora_partials import ShrinkPartials, reduce_partials_ref
from detlora.ops.lora_shrink import lora_shrink, partials_shape


def make(m, h, r, offsets, adapters, seed):
    g = torch.Generator().manual_seed(seed)
    s = len(offsets) - 1
    x = torch.randn(m, h, generator=g).half()
    a = (torch.randn(adapters, s, r, h, generator=g) / h**0.5).half()
    b = (torch.randn(adapters, offsets[-1], r, generator=g) / r**0.5).half()
    ids = torch.randint(-1, adapters, (m,), generator=g, dtype=torch.int32)
    ids[0] = adapters - 1
    scale = torch.rand(adapters, generator=g) + 0.5
    y = torch.randn(m, offsets[-1], generator=g).half()
    return x, a, b, ids, scale, y


# (M, H, r, slice offsets, adapters): split counts 1..many, odd M and H, GQA-like widths.
CASES = [
    (1, 3072, 16, (0, 96, 128, 160), 1),
    (5, 520, 8, (0, 40), 2),
    (17, 1000, 16, (0, 64, 96), 3),
    (70, 768, 4, (0, 48, 64, 80), 2),
    (130, 384, 16, (0, 32), 4),
]


@pytest.mark.parametrize("reduction", ["ordered", "ordered_bi", "unsplit"])
@pytest.mark.parametrize("m,h,r,offsets,adapters", CASES)
def test_deferred_equals_reduced_then_expanded(reduction, m, h, r, offsets, adapters):
    x, a, b, ids, scale, y = make(m, h, r, offsets, adapters, seed=m + h + r)
    groups = group_tokens(ids, adapters)
    h_out = lora_shrink(x, a, groups, scale, reduction=reduction)
    want = lora_expand(y.clone(), h_out, b, groups, offsets)

    sp = lora_shrink(x, a, groups, scale, reduction=reduction, defer=True)
    assert isinstance(sp, ShrinkPartials)
    assert tuple(sp.partials.shape) == partials_shape(reduction, m, h, len(offsets) - 1, r)
    # The reference sum of the kernel's partials is the reduced shrink, bit for bit.
    assert torch.equal(reduce_partials_ref(sp, ids), h_out)
    got = lora_expand(y.clone(), sp, b, groups, offsets)
    assert torch.equal(got, want)
    ref = lora_expand_ref(y.clone(), sp, b, ids, offsets)
    assert torch.equal(ref, lora_expand_ref(y.clone(), h_out, b, ids, offsets))


def test_tree_groups_are_summed_like_the_last_cta():
    """ordered_bi at decode size: one partial per 256-element chunk, groups of three."""
    x, a, _, ids, scale, _ = make(8, 2000, 16, (0, 64), 2, seed=5)
    groups = group_tokens(ids, 2)
    sp = lora_shrink(x, a, groups, scale, reduction="ordered_bi", defer=True)
    assert sp.num_parts == 8 and sp.tail_group == 3
    h_out = lora_shrink(x, a, groups, scale, reduction="ordered_bi")
    assert torch.equal(reduce_partials_ref(sp, ids), h_out)


def test_given_buffer_is_filled_and_returned():
    x, a, _, ids, scale, _ = make(9, 640, 8, (0, 32), 2, seed=3)
    cfg = ShrinkConfig(split_k=3, block_m=16, block_n=16, block_k=64)
    shape = partials_shape("ordered", 9, 640, 1, 8, config=cfg)
    buf = torch.empty(shape)
    sp = lora_shrink(x, a, ids, scale, reduction="ordered", defer=True, out=buf, config=cfg)
    assert sp.partials is buf and sp.num_parts == 3


@pytest.mark.parametrize("index", range(6))
def test_bad_input_raises_value_error_naming_it(index):
    x, a, b, ids, scale, y = make(4, 256, 8, (0, 32), 2, seed=1)
    groups = group_tokens(ids, 2)
    sp = lora_shrink(x, a, groups, scale, reduction="ordered", defer=True)
    cases = [
        (lambda: lora_shrink(x, a, groups, scale, reduction="atomic", defer=True), "defer"),
        (lambda: lora_shrink(x, a, groups, scale, reduction="tree", defer=True), "defer"),
        (lambda: lora_shrink(x, a, groups, scale, reduction="ordered", defer=True,
                             out=torch.empty(1, 4, 9)), "out"),
        (lambda: lora_expand(y, ShrinkPartials(sp.partials, 1, 4, 1, sp.scale), b, groups),
         "columns"),
        (lambda: lora_expand(y, ShrinkPartials(sp.partials, 1, 8, 0, sp.scale), b, groups),
         "tail_group"),
        (lambda: lora_expand(y, ShrinkPartials(sp.partials, 1, 8, 1, sp.scale[:1]), b, groups),
         "scale"),
    ]
    fn, word = cases[index]
    with pytest.raises(ValueError, match=word):
        fn()


@pytest.mark.parametrize("m,offsets,adapters", [(1, (0, 96, 128, 160), 1), (9, (0, 40), 3),
                                                (33, (0, 64, 96), 2)])
def test_in_gemm_columns_expand_like_the_reduced_shrink(m, offsets, adapters):
    """in_gemm: x A^T of every slot sits after x W^T in one output (model dtype, strided)."""
    g = torch.Generator().manual_seed(m)
    s, r, n = len(offsets) - 1, 8, offsets[-1]
    y_cat = torch.randn(m, n + adapters * s * r, generator=g).half()
    b = (torch.randn(adapters, n, r, generator=g) / r**0.5).half()
    ids = torch.randint(-1, adapters, (m,), generator=g, dtype=torch.int32)
    scale = torch.rand(adapters, generator=g) + 0.5
    sp = ShrinkPartials(y_cat[:, n:].unsqueeze(0), s, r, 1, scale, adapter_stride=s * r)
    h = reduce_partials_ref(sp, ids)
    for row, a in enumerate(ids.tolist()):  # the slot's columns, scaled; zero without adapter
        want = (scale[a] * y_cat[row, n + a * s * r: n + (a + 1) * s * r].float()
                if a >= 0 else torch.zeros(s * r))
        assert torch.equal(h[:, row].reshape(-1), want)
    groups = group_tokens(ids, adapters)
    got = lora_expand(y_cat[:, :n].clone(), sp, b, groups, offsets)
    assert torch.equal(got, lora_expand(y_cat[:, :n].clone(), h, b, groups, offsets))
    view = y_cat.clone()
    lora_expand(view[:, :n], sp, b, groups, offsets)  # in place through the strided view
    assert torch.equal(view[:, :n], got) and torch.equal(view[:, n:], y_cat[:, n:])


def test_in_gemm_has_no_shrink_kernel():
    x, a, _, ids, scale, _ = make(4, 256, 8, (0, 32), 2, seed=1)
    with pytest.raises(ValueError, match="in_gemm"):
        lora_shrink(x, a, ids, scale, reduction="in_gemm")
