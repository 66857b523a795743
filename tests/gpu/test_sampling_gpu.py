"""The sampling kernels on the GPU: the same bits as their torch references (the hash, the
float64 Gumbel scores, the top-k / top-p filter), row independence, and the sampler's kernel path
giving the reference path's tokens and logprobs."""

import pytest
import torch

from detlora.config import SamplingParams
from detlora.engine.sampler import Sampler, SampleRequest
from detlora.engine.token_filter import filter_logits
from detlora.ops import sampling as sp
from detlora.ops.reductions import argmax
from detlora.ops.softmax import log_softmax

DEV = "cuda"
VOCAB = 128256


def _inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(n, VOCAB, device=DEV, generator=g) * 3).to(torch.bfloat16).float()
    keys = torch.randint(0, 2**32, (n, 2), device=DEV, generator=g, dtype=torch.int64)
    return x, keys, sp.token_hash(VOCAB, DEV)


def test_gumbel_scores_are_the_references_bits():
    x, keys, th = _inputs(4)
    assert torch.equal(sp.gumbel_scores(x, keys, th), x.double() + sp.gumbel_noise(keys, th))


def test_gumbel_argmax_matches_the_reference_and_rows_are_independent():
    x, keys, th = _inputs(64, seed=1)
    x[3, 100:2000] = float("-inf")
    got = sp.gumbel_argmax(x, keys, th)
    assert torch.equal(got, sp.gumbel_argmax_ref(x, keys, th))
    for i in (0, 3, 17, 63):
        assert torch.equal(sp.gumbel_argmax(x[i:i + 1], keys[i:i + 1], th), got[i:i + 1])


def test_sampler_kernel_path_gives_the_reference_path_results():
    x, _, _ = _inputs(48, seed=3)
    reqs = []
    for k in range(48):
        params = (SamplingParams(max_tokens=4, logprobs=2) if k % 3 == 0 else
                  SamplingParams(max_tokens=4, logprobs=0, temperature=0.8, top_p=0.95,
                                 top_k=50 if k % 3 == 1 else 0, seed=k))
        reqs.append(SampleRequest(params, seed=1000 + k, position=100 + k))
    fast = Sampler(argmax, log_softmax, kernels=True)(x, reqs)
    ref = Sampler(argmax, log_softmax, kernels=False)(x, reqs)
    assert fast == ref


@pytest.mark.parametrize("n", [1, 7, 32])
def test_filter_logits_kernel_path_gives_the_reference_bits(n):
    """bf16 logits (a 16-bit sort, many ties, +-0): the kernels give the torch reference's bits
    (tests/engine/test_token_filter.py compares the reference with the previous filter)."""
    g = torch.Generator(device=DEV).manual_seed(10 + n)
    logits = (torch.randn(n, VOCAB, device=DEV, generator=g) * 3).to(torch.bfloat16)
    logits[n // 2, 1000:90000] = float("-inf")
    logits[n - 1, ::2] = 0.0
    logits[n - 1, 1::2] = -0.0
    temps = (torch.rand(n, device=DEV, generator=g) * 1.5 + 0.3)
    temps[0] = 1.0
    top_k = torch.tensor([50, 1, VOCAB, 5000, 2, VOCAB, 300, 40] * 4, device=DEV)[:n]
    fractions = [0.9, 0.5, 1.0, 0.99, 0.0, 0.95, 0.8, 1e-9] * 4
    limit = torch.tensor([int(p * 2**40) if p < 1 else 1 << 62 for p in fractions[:n]],
                         device=DEV)
    for tk, lim in ((top_k, limit), (top_k, None), (None, limit), (None, None)):
        fast = filter_logits(logits, temps, tk, lim, log_softmax=log_softmax, kernels=True)
        ref = filter_logits(logits, temps, tk, lim, log_softmax=log_softmax, kernels=False)
        assert torch.equal(fast, ref)
