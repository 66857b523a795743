"""Programmatic dependent launch (ops/pdl.py) on the GPU: a decode-like chain of kernels that
each read what the one before wrote gives, launched with PDL eagerly and captured into a CUDA
graph replayed on new inputs, the bits of plain launches. A kernel that read before its
``griddepcontrol.wait`` would read stale activations here and differ. Norms follow norms (PDL
after PDL) and GEMMs (PDL after a plain launch), and GEMMs follow norms (plain after PDL)."""

from __future__ import annotations

import pytest
import torch

from detlora.ops import matmul as mm
from detlora.ops import rms_norm as rn
from detlora.ops.pdl import pdl_launch, pdl_launches

pytestmark = pytest.mark.gpu

HIDDEN, WIDE, NARROW, LAYERS = 1024, 3072, 512, 6


def _weights():
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*size, std):
        return (torch.randn(*size, generator=g, device="cuda") * std).to(torch.bfloat16)

    return [dict(norm=1 + rnd(HIDDEN, std=0.1), up=rnd(WIDE, HIDDEN, std=0.03),
                 down=rnd(HIDDEN, WIDE, std=0.02), side=rnd(NARROW, HIDDEN, std=0.03),
                 back=rnd(HIDDEN, NARROW, std=0.04)) for _ in range(LAYERS)]


def _chain(x: torch.Tensor, layers) -> torch.Tensor:
    """Per layer: norm -> norm -> wide GEMM -> GEMM back -> add+norm -> narrow GEMM (split K
    over CTAs, counters) -> GEMM back; every kernel reads its predecessor."""
    residual = x.clone()
    h = rn.rms_norm(x, layers[0]["norm"], 1e-5)
    for w in layers:
        h = rn.rms_norm(h, w["norm"], 1e-5)
        h = mm.linear(mm.linear(h, w["up"]), w["down"])
        h, residual = rn.fused_add_rms_norm(h, residual, w["norm"], 1e-5)
        h = mm.linear(mm.linear(h, w["side"]), w["back"])
    return h + residual


@pytest.mark.parametrize("m", [1, 7, 64])
def test_pdl_chain_gives_the_bits_of_plain_launches(monkeypatch, m):
    probe = torch.empty(1, device="cuda")
    assert not pdl_launch(probe)  # plain launches outside pdl_launches
    layers = _weights()
    x = torch.randn(m, HIDDEN, device="cuda").to(torch.bfloat16)
    monkeypatch.setenv("DETLORA_PDL", "0")
    plain = _chain(x, layers)
    monkeypatch.setenv("DETLORA_PDL", "1")
    static_x = x.clone()
    with pdl_launches():
        assert pdl_launch(probe) == (torch.cuda.get_device_capability()[0] >= 9)
        eager = _chain(static_x, layers)  # also compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(static_x, layers)
    assert not pdl_launch(probe)
    assert torch.equal(eager, plain)
    for k in range(5):
        # New inputs each replay: a stale read would show as a difference.
        static_x.copy_(x if k % 2 == 0 else x.flip(0))
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setenv("DETLORA_PDL", "0")
        want = plain if k % 2 == 0 else _chain(x.flip(0), layers)
        monkeypatch.setenv("DETLORA_PDL", "1")
        assert torch.equal(out, want), k
