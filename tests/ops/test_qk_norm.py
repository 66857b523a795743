"""q|k head RMSNorm in place on the fused projection: the reference's values, the v heads
untouched, rows that do not depend on T (interpreter; bf16 and speed on the GPU)."""

from __future__ import annotations

import pytest
import torch

from detlora.ops.qk_norm import qk_rms_norm, qk_rms_norm_ref
from detlora.ops.rms_norm import rms_norm


def _case(t, hq, hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=g) * 3).to(dtype)
    wq = (1 + torch.randn(d, generator=g) * 0.2).to(dtype)
    wk = (1 + torch.randn(d, generator=g) * 0.2).to(dtype)
    return qkv, wq, wk


@pytest.mark.parametrize(("t", "hq", "hk", "d", "dtype"),
                         [(1, 16, 8, 128, torch.float16), (5, 4, 2, 64, torch.float32),
                          (3, 6, 2, 96, torch.float16)])
def test_matches_the_reference_and_leaves_v_alone(t, hq, hk, d, dtype):
    qkv, wq, wk = _case(t, hq, hk, d, dtype)
    want = qk_rms_norm_ref(qkv.clone(), wq, wk, 1e-6, hq, hk, d)
    got = qkv.clone()
    assert qk_rms_norm(got, wq, wk, 1e-6, hq, hk, d) is got
    v = slice((hq + hk) * d, None)
    assert torch.equal(got[:, v], qkv[:, v])
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
    # The same tiling as the rms_norm kernel on the heads as rows: its bits.
    q = rms_norm(qkv[:, :hq * d].reshape(t * hq, d), wq, 1e-6)
    assert torch.equal(got[:, :hq * d].reshape(t * hq, d), q)


def test_a_row_does_not_depend_on_the_number_of_tokens():
    qkv, wq, wk = _case(37, 16, 8, 128, torch.float16, seed=3)
    whole = qk_rms_norm(qkv.clone(), wq, wk, 1e-6, 16, 8, 128)
    for t in (1, 2, 17):
        part = qk_rms_norm(qkv[:t].clone(), wq, wk, 1e-6, 16, 8, 128)
        assert torch.equal(part, whole[:t]), t


def test_bad_shapes_are_named():
    qkv, wq, wk = _case(2, 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="make 512"):
        qk_rms_norm(qkv[:, :-64], wq, wk, 1e-6, 4, 2, 64)
    with pytest.raises(ValueError, match="weight"):
        qk_rms_norm(qkv, wq[:-1], wk, 1e-6, 4, 2, 64)
