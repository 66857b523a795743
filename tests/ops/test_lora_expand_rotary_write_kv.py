"""q|k|v LoRA expand fused with rotary and the KV page write, in Triton's interpreter: the
same bits (q, k pages, v pages) as the expand kernel followed by rotary_write_kv, for the
reduced shrink output and in_gemm's adapter-strided partials, mixed adapters and rows without
one, padding slots; close to the torch reference; ``y`` left unchanged; bad inputs."""

import itertools

import pytest
import torch
from tests.helpers.slot_ranks import zero_past_ranks

from detlora.ops.adapter_groups import group_tokens
from detlora.ops.lora_configs import ExpandConfig
from detlora.ops.lora_expand import lora_expand
from detlora.ops.lora_expand_rotary_write_kv import (
    lora_expand_rotary_write_kv,
    lora_expand_rotary_write_kv_ref,
)
from detlora.ops.lora_partials import ShrinkPartials
from detlora.ops.rotary import rope_cos_sin_cache
from detlora.ops.rotary_write_kv import rotary_write_kv

PAGE = 4


def make(m, hq, hk, d, r, adapters, seed, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    n = (hq + 2 * hk) * d
    offsets = [0, hq * d, (hq + hk) * d, n]
    h = torch.randn(3, m, r, generator=g)
    # fp16 B: the interpreter multiplies bf16 dot operands as raw bits (the GPU tests take bf16)
    b = (torch.randn(adapters, n, r, generator=g) / r**0.5).half()
    ids = torch.randint(-1, adapters, (m,), generator=g, dtype=torch.int32)
    ids[0] = 0
    y = (2 * torch.randn(m, n, generator=g)).to(dtype)
    pos = torch.randint(0, 256, (m,), generator=g)
    pages = m // PAGE + 4
    slots = torch.randperm(pages * PAGE, generator=g)[:m]
    slots[1::4] = -1
    cache = torch.randn(2, pages, PAGE, hk, d, generator=g).to(dtype)
    return y, h, b, ids, offsets, pos, slots, cache


def unfused(y, h, b, ids, offsets, pos, cos_sin, cache, slots, d, slot_ranks=None):
    y2 = lora_expand(y.clone(), h, b, ids, offsets, slot_ranks=slot_ranks)
    m = y.shape[0]
    q, k, v = (y2[:, lo:hi].view(m, -1, d) for lo, hi in itertools.pairwise(offsets))
    kc, vc = cache[0].clone(), cache[1].clone()
    return rotary_write_kv(q, k, v, pos, cos_sin, kc, vc, slots), kc, vc


@pytest.mark.parametrize("m,hq,hk,d,r", [(1, 4, 2, 32, 16), (7, 3, 1, 16, 8),
                                         (21, 4, 4, 20, 16), (40, 2, 1, 64, 24)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_same_bits_as_expand_then_rotary_write_kv(m, hq, hk, d, r, dtype):
    y, h, b, ids, offsets, pos, slots, cache = make(m, hq, hk, d, r, 3, seed=m + d, dtype=dtype)
    cos_sin = rope_cos_sin_cache(d, 256, 10000.0)
    before = y.clone()
    kc, vc = cache[0].clone(), cache[1].clone()
    got_q = lora_expand_rotary_write_kv(y, h, b, ids, offsets, pos, cos_sin, kc, vc, slots)
    assert torch.equal(y, before)  # the base output is read, never written
    want_q, want_kc, want_vc = unfused(y, h, b, ids, offsets, pos, cos_sin, cache, slots, d)
    assert got_q.dtype == dtype and torch.equal(got_q, want_q)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    # Against the torch reference: the interpreter truncates bf16 roundings (docs/design.md).
    kr, vr = cache[0].clone(), cache[1].clone()
    ref_q = lora_expand_rotary_write_kv_ref(y, h, b, ids, offsets, pos, cos_sin, kr, vr, slots)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-2
    for got, ref in ((got_q, ref_q), (kc, kr), (vc, vr)):
        assert float((got.double() - ref.double()).norm() / ref.double().norm()) < tol


@pytest.mark.parametrize("m", [1, 9, 64])
def test_in_gemm_partials_give_the_unfused_bits(m):
    hq, hk, d, r, adapters = 4, 2, 16, 16, 2
    y, _, b, ids, offsets, pos, slots, cache = make(m, hq, hk, d, r, adapters, seed=m)
    n = y.shape[1]
    g = torch.Generator().manual_seed(m + 1)
    y_cat = torch.cat([y, torch.randn(m, adapters * 3 * r, generator=g).to(y.dtype)], dim=1)
    partials = ShrinkPartials(y_cat[:, n:].unsqueeze(0), 3, r, tail_group=1,
                              scale=torch.rand(adapters, generator=g) + 0.5,
                              adapter_stride=3 * r)
    view = y_cat[:, :n]  # strided: the row stride is y_cat's
    cos_sin = rope_cos_sin_cache(d, 256, 10000.0)
    kc, vc = cache[0].clone(), cache[1].clone()
    got_q = lora_expand_rotary_write_kv(view, partials, b, group_tokens(ids, adapters), offsets,
                                        pos, cos_sin, kc, vc, slots)
    want_q, want_kc, want_vc = unfused(view, partials, b, ids, offsets, pos, cos_sin, cache,
                                       slots, d)
    assert torch.equal(got_q, want_q) and torch.equal(kc, want_kc) and torch.equal(vc, want_vc)


def test_slot_ranks_give_the_unfused_bits():
    """q, k and v over each slot's own ranks (0: untargeted, as q|v adapters leave k): the
    bits of the expand with the same ranks, then rotary_write_kv."""
    d = 16
    y, h, b, ids, offsets, pos, slots, cache = make(10, 4, 2, d, 16, 3, seed=3)
    ids[:3] = torch.tensor([0, 1, 2], dtype=torch.int32)
    ranks = torch.tensor([[8, 0, 8], [16, 3, 0], [0, 0, 0]], dtype=torch.int32)
    h, b = zero_past_ranks(h, b, ids, offsets, ranks, full=16)
    cos_sin = rope_cos_sin_cache(d, 256, 10000.0)
    kc, vc = cache[0].clone(), cache[1].clone()
    got_q = lora_expand_rotary_write_kv(y, h, b, ids, offsets, pos, cos_sin, kc, vc, slots,
                                        slot_ranks=ranks)
    want_q, want_kc, want_vc = unfused(y, h, b, ids, offsets, pos, cos_sin, cache, slots, d,
                                       slot_ranks=ranks)
    assert torch.equal(got_q, want_q) and torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    full_q, _, _ = unfused(y, h, b, ids, offsets, pos, cos_sin, cache, slots, d)
    assert not torch.equal(got_q, full_q)  # the garbage of rank-0 slices was not read


def test_rows_are_independent_of_the_batch():
    hq, hk, d = 2, 1, 16
    y, h, b, ids, offsets, pos, slots, cache = make(30, hq, hk, d, 16, 3, seed=7)
    cos_sin = rope_cos_sin_cache(d, 256, 10000.0)
    batch = lora_expand_rotary_write_kv(y, h, b, ids, offsets, pos, cos_sin, cache[0].clone(),
                                        cache[1].clone(), slots)
    for i in (0, 13, 29):
        alone = lora_expand_rotary_write_kv(
            y[i:i + 1], h[:, i:i + 1].contiguous(), b, ids[i:i + 1], offsets, pos[i:i + 1],
            cos_sin, cache[0].clone(), cache[1].clone(), slots[i:i + 1],
            config=ExpandConfig(16, 32, 16))
        assert torch.equal(batch[i], alone[0])


def bad_cases():
    y, h, b, ids, offsets, pos, slots, cache = make(4, 2, 1, 16, 8, 2, seed=12)
    return [
        ("three slices", dict(h=h[:2], offsets=[0, 32, 64])),
        ("must be \\(Hq, Hk, Hk\\) heads", dict(offsets=[0, 32, 56, 64])),
        ("must be \\(Hq, Hk, Hk\\) heads", dict(cache=cache[..., :12])),
        ("positions must be in", dict(pos=pos + 256)),
        ("positions is on meta", dict(pos=pos.to("meta"))),
        ("slot_mapping must have shape", dict(slots=slots[:3])),
        ("y must have shape", dict(y=torch.randn(5, 64).half())),
        ("lora_b rank 4 must match", dict(b=torch.randn(2, 64, 4).half())),
    ], (y, h, b, ids, offsets, pos, slots, cache)


@pytest.mark.parametrize("index", range(len(bad_cases()[0])))
def test_bad_input_raises_value_error_naming_it(index):
    cases, base = bad_cases()
    message, override = cases[index]
    args = dict(zip(("y", "h", "b", "ids", "offsets", "pos", "slots", "cache"), base,
                    strict=True))
    args.update(override)
    cos_sin = rope_cos_sin_cache(16, 256, 10000.0)
    with pytest.raises(ValueError, match=message):
        lora_expand_rotary_write_kv(args["y"], args["h"], args["b"], args["ids"],
                                    args["offsets"], args["pos"], cos_sin,
                                    args["cache"][0], args["cache"][1], args["slots"])
