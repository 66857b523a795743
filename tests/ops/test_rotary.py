"""Rotary kernel in the interpreter: float64 oracle, poisoned and in-place outputs, strided
q/k views, row invariance, the Llama-3 cache against transformers, bad inputs."""

import pytest
import torch

from detlora.ops import rotary as ro

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# bf16 is looser: the interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest even).
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1.2e-2}
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # Llama-3.2
LLAMA31 = {**LLAMA3, "factor": 8.0}  # Llama-3.1


def _oracle(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_sin.double()[positions.long()].chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def _inputs(t, hq, hk, d, dtype, seed, max_pos=4096):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hk, d, generator=g).to(dtype)
    pos = torch.randint(0, max_pos, (t,), generator=g)
    return q, k, pos


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hk,d", [(1, 4, 1, 64), (3, 3, 3, 20), (17, 7, 2, 128),
                                       (130, 2, 1, 16)])
def test_matches_fp64(t, hq, hk, d, dtype):
    cos_sin = ro.rope_cos_sin_cache(d, 4096, 500000.0, LLAMA3 if d >= 64 else None)
    q, k, pos = _inputs(t, hq, hk, d, dtype, seed=t * hq + d)
    qo = torch.full_like(q, float("nan"))
    ko = torch.full_like(k, float("nan"))
    got_q, got_k = ro.rotary(q, k, pos.int(), cos_sin, out=(qo, ko))
    assert got_q is qo and got_k is ko
    assert not qo.isnan().any() and not ko.isnan().any()
    assert _rel(qo, _oracle(q, pos, cos_sin)) < TOL[dtype]
    assert _rel(ko, _oracle(k, pos, cos_sin)) < TOL[dtype]


def test_fused_qkv_views_and_in_place():
    t, hq, hk, d = 5, 4, 2, 32
    cos_sin = ro.rope_cos_sin_cache(d, 64, 10000.0)
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g, dtype=torch.float16)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
    pos = torch.randint(0, 64, (t,), generator=g)
    want_q, want_k = ro.rotary(q.contiguous(), k.contiguous(), pos, cos_sin)
    got_q, got_k = ro.rotary(q, k, pos, cos_sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    v_before = qkv[:, (hq + hk) * d:].clone()
    ro.rotary(q, k, pos, cos_sin, out=(q, k))
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (hq + hk) * d:], v_before)  # v untouched


def test_rows_do_not_depend_on_batch_size():
    cos_sin = ro.rope_cos_sin_cache(64, 4096, 500000.0, LLAMA3)
    q, k, pos = _inputs(130, 3, 1, 64, torch.bfloat16, seed=8)
    rows = [0, 2, 16, 129]
    alone = {i: ro.rotary(q[i:i + 1], k[i:i + 1], pos[i:i + 1], cos_sin) for i in rows}
    for t in (3, 17, 130):
        bq, bk = ro.rotary(q[:t], k[:t], pos[:t], cos_sin)
        for i in (i for i in rows if i < t):
            assert torch.equal(bq[i], alone[i][0][0]) and torch.equal(bk[i], alone[i][1][0])


@pytest.mark.parametrize("head_dim,scaling", [(128, LLAMA3), (64, LLAMA3), (128, LLAMA31)])
def test_llama3_cache_matches_transformers(head_dim, scaling):
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    if "llama3" not in getattr(rope_utils, "ROPE_INIT_FUNCTIONS", {}):
        pytest.skip("this transformers has no llama3 rope init function")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    theta = 500000.0
    # rope_theta / rope_scaling: the 4.x spelling, still read by 5.x.
    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                      max_position_embeddings=131072, rope_theta=theta,
                      rope_scaling=dict(scaling))
    hf_inv, attention_scaling = rope_utils.ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    assert attention_scaling == 1.0
    ours_inv = ro.rope_inv_freq(head_dim, theta, scaling)
    # Ours is fp64 math rounded once; transformers' fp32 pow is a few ulps off.
    assert torch.allclose(ours_inv, hf_inv.float(), rtol=1e-6, atol=0)

    max_pos = 8192
    cos_sin = ro.rope_cos_sin_cache(head_dim, max_pos, theta, scaling)
    pos = torch.arange(max_pos, dtype=torch.float32)
    hf_angle = torch.outer(pos, hf_inv.float())
    # The two caches differ only by the inverse frequencies' rounding: bound the angle gap.
    bound = pos[:, None] * (ours_inv - hf_inv.float()).abs()[None] + 4 * hf_angle.abs() * 2**-24
    assert ((cos_sin[:, : head_dim // 2] - hf_angle.cos()).abs() <= bound + 1e-6).all()
    assert ((cos_sin[:, head_dim // 2:] - hf_angle.sin()).abs() <= bound + 1e-6).all()

    # With the same cos/sin, the kernel computes transformers' rotate_half rotation.
    q, k, p = _inputs(6, 4, 2, head_dim, torch.float32, seed=head_dim, max_pos=max_pos)
    cos, sin = cos_sin[p].chunk(2, dim=-1)
    cos_full, sin_full = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      cos_full, sin_full)
    got_q, got_k = ro.rotary(q, k, p, cos_sin)
    assert torch.allclose(got_q, hf_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    assert torch.allclose(got_k, hf_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_bad_inputs_raise_value_error(monkeypatch):
    cos_sin = ro.rope_cos_sin_cache(16, 32, 10000.0)
    q, k, pos = _inputs(3, 2, 1, 16, torch.float16, seed=1, max_pos=32)
    cases = [
        (lambda: ro.rotary(q[0], k, pos, cos_sin), "q must have 3 dimensions"),
        (lambda: ro.rotary(q.double(), k, pos, cos_sin), "q must have dtype"),
        (lambda: ro.rotary(q, k.float(), pos, cos_sin), "k must have dtype"),
        (lambda: ro.rotary(q, k[:2], pos, cos_sin), r"k must have shape \(3, Hk >= 1, 16\)"),
        (lambda: ro.rotary(q, k[..., :8], pos, cos_sin), "k must"),
        (lambda: ro.rotary(q[..., :15], k[..., :15], pos, cos_sin), "head size must be even"),
        (lambda: ro.rotary(q.transpose(1, 2), k, pos, cos_sin),
         "q must be contiguous in its last dimension"),
        (lambda: ro.rotary(q, k, pos.float(), cos_sin), "positions must have dtype"),
        (lambda: ro.rotary(q, k, pos[:2], cos_sin), r"positions must have shape \(3,\)"),
        (lambda: ro.rotary(q, k, pos[:, None], cos_sin), "positions must have 1 dimensions"),
        (lambda: ro.rotary(q, k, pos, cos_sin.double()), "cos_sin must have dtype"),
        (lambda: ro.rotary(q, k, pos, cos_sin[:, :8]), r"cos_sin must have shape"),
        (lambda: ro.rotary(q, k, pos, cos_sin.to("meta")), "cos_sin is on meta"),
        (lambda: ro.rotary(q, k, torch.tensor([0, 32, 1]), cos_sin),
         r"positions must be in \[0, 32\)"),
        (lambda: ro.rotary(q, k, torch.tensor([0, -1, 1]), cos_sin),
         r"positions must be in \[0, 32\)"),
        (lambda: ro.rotary(q, k, pos, cos_sin, out=(q,)), "out must be a"),
        (lambda: ro.rotary(q, k, pos, cos_sin, out=(q, k[:, :, :8])), r"out\[1\] must have"),
        (lambda: ro.rotary(q, k, pos, cos_sin, out=(q.float(), k)), r"out\[0\] must have dtype"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="Triton kernels need CUDA tensors"):
        ro.rotary(q, k, pos, cos_sin)
