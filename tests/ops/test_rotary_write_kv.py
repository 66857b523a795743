"""Fused rotary + KV write in the interpreter: the same bits as the rotary and write_kv
kernels one after the other (strided qkv views, padding slots, a cache dtype other than
k's), its torch reference, and bad inputs (a slot past the cache among them: CPU tensors are
checked on the host)."""

import pytest
import torch

from detlora.ops import paged_attention as pa
from detlora.ops import rotary as ro
from detlora.ops.rotary_write_kv import rotary_write_kv, rotary_write_kv_ref


def _case(t, hq, hk, d, dtype, seed, num_blocks=6, page=4, cache_dtype=None):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    pos = torch.randint(0, 512, (t,), generator=g)
    slots = torch.randperm(num_blocks * page, generator=g)[:t]
    slots[::3] = -1  # padding rows
    cache = torch.randn(2, num_blocks, page, hk, d, generator=g).to(cache_dtype or dtype)
    return q, k, v, pos, slots, cache


def _unfused(q, k, v, pos, cos_sin, cache, slots):
    kc, vc = cache[0].clone(), cache[1].clone()
    q_out, k_out = ro.rotary(q, k, pos, cos_sin)
    pa.write_kv(k_out, v, kc, vc, slots)
    return q_out, kc, vc


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,hq,hk,d", [(1, 4, 1, 64), (5, 3, 3, 20), (9, 8, 2, 32),
                                       (4, 2, 4, 16)])
def test_same_bits_as_rotary_then_write_kv(t, hq, hk, d, dtype):
    cos_sin = ro.rope_cos_sin_cache(d, 512, 10000.0)
    q, k, v, pos, slots, cache = _case(t, hq, hk, d, dtype, seed=t * 31 + d)
    want_q, want_kc, want_vc = _unfused(q, k, v, pos, cos_sin, cache, slots)
    kc, vc = cache[0].clone(), cache[1].clone()
    got_q = rotary_write_kv(q, k, v, pos, cos_sin, kc, vc, slots)
    assert torch.equal(got_q, want_q)
    assert torch.equal(kc, want_kc)
    assert torch.equal(vc, want_vc)
    assert got_q.is_contiguous()


def test_cache_dtype_other_than_k():
    d = 32
    cos_sin = ro.rope_cos_sin_cache(d, 512, 10000.0)
    q, k, v, pos, slots, cache = _case(6, 4, 2, d, torch.float32, seed=3,
                                       cache_dtype=torch.float16)
    want_q, want_kc, want_vc = _unfused(q, k, v, pos, cos_sin, cache, slots)
    kc, vc = cache[0].clone(), cache[1].clone()
    got_q = rotary_write_kv(q, k, v, pos, cos_sin, kc, vc, slots)
    assert torch.equal(got_q, want_q) and torch.equal(kc, want_kc) and torch.equal(vc, want_vc)


def test_reference_matches_the_reference_ops():
    d = 16
    cos_sin = ro.rope_cos_sin_cache(d, 512, 10000.0)
    q, k, v, pos, slots, cache = _case(7, 2, 1, d, torch.float32, seed=5)
    kc, vc = cache[0].clone(), cache[1].clone()
    want_q, k_rot = ro.rotary_ref(q, k, pos, cos_sin)
    pa.write_kv_ref(k_rot, v, kc, vc, slots)
    kc2, vc2 = cache[0].clone(), cache[1].clone()
    got_q = rotary_write_kv_ref(q, k, v, pos, cos_sin, kc2, vc2, slots)
    assert torch.equal(got_q, want_q) and torch.equal(kc2, kc) and torch.equal(vc2, vc)


def test_bad_inputs():
    d = 16
    cos_sin = ro.rope_cos_sin_cache(d, 64, 10000.0)
    q, k, v, pos, slots, cache = _case(4, 2, 1, d, torch.float16, seed=6)
    kc, vc = cache[0], cache[1]
    with pytest.raises(ValueError, match="positions must be in"):
        rotary_write_kv(q, k, v, pos + 64, cos_sin, kc, vc, slots)
    with pytest.raises(ValueError, match="v"):
        rotary_write_kv(q, k, v[:3], pos % 64, cos_sin, kc, vc, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_write_kv(q, k, v, pos % 64, cos_sin, kc, vc, slots[:3])
    with pytest.raises(ValueError, match="v_cache must have shape"):
        rotary_write_kv(q, k, v, pos % 64, cos_sin, kc[..., :8], vc, slots)
    with pytest.raises(ValueError, match=r"k must have shape \(4, 1, 8\)"):
        rotary_write_kv(q, k, v, pos % 64, cos_sin, kc[..., :8], vc[..., :8], slots)
    with pytest.raises(ValueError, match="slot_mapping holds slot 99"):
        rotary_write_kv(q, k, v, pos % 64, cos_sin, kc, vc, torch.tensor([0, 1, 99, -1]))
    with pytest.raises(ValueError, match="q head size must be even"):
        rotary_write_kv(q[..., :15], k[..., :15], v[..., :15], pos % 64, cos_sin, kc, vc,
                        slots)
