"""q|k head RMSNorm on the GPU, bf16: rows that do not depend on T, the values of rms_norm
on the heads, the v heads untouched, and a CUDA graph replay."""

import pytest
import torch

from detlora.ops.qk_norm import qk_rms_norm, qk_rms_norm_ref
from detlora.ops.rms_norm import rms_norm

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("hq", "hk", "d"), [(16, 8, 128), (32, 8, 128), (14, 2, 64)])
def test_rows_do_not_depend_on_t_and_match_rms_norm(hq, hk, d):
    g = torch.Generator(device="cuda").manual_seed(hq + d)
    qkv = (torch.randn(300, (hq + 2 * hk) * d, device="cuda", generator=g) * 3).bfloat16()
    wq = (1 + torch.randn(d, device="cuda", generator=g) * 0.2).bfloat16()
    wk = (1 + torch.randn(d, device="cuda", generator=g) * 0.2).bfloat16()
    whole = qk_rms_norm(qkv.clone(), wq, wk, 1e-6, hq, hk, d)
    for t in (1, 2, 7, 64, 257):
        assert torch.equal(qk_rms_norm(qkv[:t].clone(), wq, wk, 1e-6, hq, hk, d), whole[:t]), t
    ref = qk_rms_norm_ref(qkv.clone(), wq, wk, 1e-6, hq, hk, d)
    torch.testing.assert_close(whole.float(), ref.float(), rtol=1e-2, atol=1e-2)
    v = slice((hq + hk) * d, None)
    assert torch.equal(whole[:, v], qkv[:, v])
    # Informative: the rms_norm kernel on contiguous head rows gives the same bits.
    q = rms_norm(qkv[:, :hq * d].reshape(-1, d), wq, 1e-6)
    assert torch.equal(whole[:, :hq * d].reshape(-1, d), q)


def test_replays_in_a_cuda_graph():
    qkv = torch.randn(4, 32 * 128, device="cuda").bfloat16()
    w = torch.ones(128, device="cuda").bfloat16()
    work = qkv.clone()
    want = qk_rms_norm(qkv.clone(), w, w, 1e-6, 16, 8, 128)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        qk_rms_norm(work.clone(), w, w, 1e-6, 16, 8, 128)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qk_rms_norm(work, w, w, 1e-6, 16, 8, 128)
    work.copy_(qkv)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(work, want)
