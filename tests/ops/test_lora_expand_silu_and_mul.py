"""LoRA expand fused with SwiGLU, in Triton's interpreter: the same bits as the expand kernel
followed by the silu_and_mul kernel (reduced shrink output and in_gemm's adapter-strided
partials), close to the reference and a float64 oracle, ``y`` left unchanged, rows
independent of the batch, bad inputs."""

import pytest
import torch
from tests.helpers.slot_ranks import zero_past_ranks

from detlora.ops.adapter_groups import group_tokens
from detlora.ops.lora_configs import ExpandConfig
from detlora.ops.lora_expand import lora_expand
from detlora.ops.lora_expand_silu_and_mul import (
    lora_expand_silu_and_mul,
    lora_expand_silu_and_mul_ref,
)
from detlora.ops.lora_partials import ShrinkPartials
from detlora.ops.silu_and_mul import silu_and_mul


def make(m, inter, r, adapters, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, m, r, generator=g)
    # fp16 B: the interpreter multiplies bf16 dot operands as raw bits (the GPU tests take bf16)
    b = (torch.randn(adapters, 2 * inter, r, generator=g) / r**0.5).half()
    ids = torch.randint(-1, adapters, (m,), generator=g, dtype=torch.int32)
    ids[0] = 0
    y = (2 * torch.randn(m, 2 * inter, generator=g)).to(dtype)
    return y, h, b, ids


def in_gemm_layout(y, h, adapters, seed):
    """y_cat = [y | x A^T of every slot] as in_gemm's GEMM writes it, and its partials."""
    m, n = y.shape
    r = h.shape[2]
    g = torch.Generator().manual_seed(seed)
    cols = torch.randn(m, adapters * 2 * r, generator=g).to(y.dtype)
    y_cat = torch.cat([y, cols], dim=1)
    scale = torch.rand(adapters, generator=g) + 0.5
    partials = ShrinkPartials(y_cat[:, n:].unsqueeze(0), 2, r, tail_group=1, scale=scale,
                              adapter_stride=2 * r)
    return y_cat, partials


@pytest.mark.parametrize("m,inter,r", [(1, 64, 16), (5, 96, 8), (33, 40, 16), (70, 128, 24)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_same_bits_as_expand_then_silu_and_mul(m, inter, r, dtype):
    y, h, b, ids = make(m, inter, r, 3, seed=m + inter + r, dtype=dtype)
    before = y.clone()
    got = lora_expand_silu_and_mul(y, h, b, ids)
    assert torch.equal(y, before)  # the base output is read, never written
    want = silu_and_mul(lora_expand(y.clone(), h, b, ids))
    assert got.dtype == dtype and torch.equal(got, want)
    # bf16: four roundings, which the interpreter truncates (docs/design.md), so a looser bound.
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-2
    for ref in (lora_expand_silu_and_mul_ref(y, h, b, ids).double(),
                lora_expand_silu_and_mul_ref(y.double(), h.double(), b.double(), ids)):
        assert float((got.double() - ref).norm() / ref.norm()) < tol


@pytest.mark.parametrize("m", [1, 9, 64])
def test_in_gemm_partials_give_the_unfused_bits(m):
    y, h, b, ids = make(m, 64, 16, 2, seed=m)
    y_cat, partials = in_gemm_layout(y, h, 2, seed=m + 1)
    view = y_cat[:, :128]  # strided: the row stride is y_cat's
    before = y_cat.clone()
    got = lora_expand_silu_and_mul(view, partials, b, group_tokens(ids, 2))
    assert torch.equal(y_cat, before)
    want = silu_and_mul(lora_expand(view.clone(), partials, b, ids))
    assert torch.equal(got, want)


def test_slot_ranks_give_the_unfused_bits():
    """Gate and up over each slot's own ranks (0: untargeted): the bits of the expand with
    the same ranks, then silu_and_mul, and near the reference with those ranks."""
    ranks = torch.tensor([[8, 0], [16, 5], [0, 0]], dtype=torch.int32)
    y, h, b, ids = make(11, 40, 16, 3, seed=5)
    ids[:3] = torch.tensor([0, 1, 2], dtype=torch.int32)
    h, b = zero_past_ranks(h, b, ids, [0, 40, 80], ranks, full=16)
    got = lora_expand_silu_and_mul(y, h, b, ids, slot_ranks=ranks)
    assert torch.equal(got, silu_and_mul(lora_expand(y.clone(), h, b, ids, slot_ranks=ranks)))
    ref = lora_expand_silu_and_mul_ref(y, h, b, ids, None, ranks).double()
    assert float((got.double() - ref).norm() / ref.norm()) < 3e-2


def test_rows_without_adapter_are_plain_silu_and_mul():
    y, h, b, _ = make(6, 32, 8, 2, seed=3)
    ids = torch.full((6,), -1, dtype=torch.int32)
    assert torch.equal(lora_expand_silu_and_mul(y, h, b, ids), silu_and_mul(y))


def test_rows_are_independent_of_the_batch():
    y, h, b, ids = make(37, 64, 16, 3, seed=7)
    batch = lora_expand_silu_and_mul(y, h, b, ids)
    for i in (0, 11, 36):
        alone = lora_expand_silu_and_mul(y[i:i + 1], h[:, i:i + 1].contiguous(), b,
                                         ids[i:i + 1], config=ExpandConfig(16, 32, 16))
        assert torch.equal(batch[i], alone[0])


def test_out_is_written_and_returned():
    y, h, b, ids = make(4, 32, 8, 2, seed=4)
    out = torch.empty(4, 32, dtype=y.dtype)
    assert lora_expand_silu_and_mul(y, h, b, ids, out=out) is out
    assert torch.equal(out, silu_and_mul(lora_expand(y.clone(), h, b, ids)))


def bad_cases():
    y, h, b, ids = make(4, 16, 8, 2, seed=12)
    return [
        ("two slices of equal width", dict(h=torch.randn(1, 4, 8), offsets=None)),
        ("two slices of equal width", dict(offsets=[0, 12, 32])),
        ("out must have shape", dict(out=torch.empty(4, 32, dtype=y.dtype))),
        ("out must have dtype", dict(out=torch.empty(4, 16, dtype=torch.float16))),
        ("y must have shape", dict(y=torch.randn(5, 32).to(y.dtype))),
        ("lora_b rank 4 must match", dict(b=torch.randn(2, 32, 4).to(b.dtype))),
        ("adapter id 5", dict(ids=torch.tensor([0, 5, 1, 0], dtype=torch.int32))),
        ("config must be an ExpandConfig", dict(config=(16, 16, 16))),
    ], (y, h, b, ids)


@pytest.mark.parametrize("index", range(len(bad_cases()[0])))
def test_bad_input_raises_value_error_naming_it(index):
    cases, (y, h, b, ids) = bad_cases()
    message, override = cases[index]
    args = dict(y=y, h=h, b=b, ids=ids, offsets=[0, 16, 32], out=None, config=None)
    args.update(override)
    with pytest.raises(ValueError, match=message):
        lora_expand_silu_and_mul(args["y"], args["h"], args["b"], args["ids"], args["offsets"],
                                 out=args["out"], config=args["config"])
