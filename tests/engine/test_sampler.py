"""The sampler alone: greedy ties, seeded draws independent of the batch, filters, logprobs."""

import torch

from detlora.config import SamplingParams
from detlora.engine.sampler import (
    Sampler,
    SampleRequest,
    _mix32,
    derive_seed,
    row_keys,
    uniform_noise,
)
from detlora.ops.reductions import argmax_ref
from detlora.ops.softmax import log_softmax_ref


def sampler() -> Sampler:
    return Sampler(argmax_ref, log_softmax_ref)


def test_greedy_ties_go_to_the_lowest_token_id():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    req = SampleRequest(SamplingParams(logprobs=0), seed=0, position=4)
    out = sampler()(logits, [req, req])
    assert [r.token_id for r in out] == [1, 0]
    lp = torch.log_softmax(logits, -1)
    assert out[0].logprobs == {1: lp[0, 1].item()}


def test_hash_matches_python_ints_and_never_overflows():
    x = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1], dtype=torch.int64)
    mixed = _mix32(x)
    assert mixed.tolist() == [_mix32(int(v)) for v in x.tolist()]
    assert int(mixed.min()) >= 0 and int(mixed.max()) < 2**32
    u = uniform_noise(torch.tensor([row_keys(2**64 - 1, 10**6)]), _mix32(torch.arange(1000)))
    assert float(u.min()) > 0 and float(u.max()) < 1


def test_seeded_draws_depend_on_seed_and_position_not_on_the_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    params = SamplingParams(temperature=1.0, seed=7, logprobs=2)
    reqs = [SampleRequest(params, seed=7 + i, position=10 + i) for i in range(6)]
    s = sampler()
    full = s(logits, reqs)
    for i in range(6):
        alone = s(logits[i : i + 1], [reqs[i]])[0]
        assert alone == full[i]
    rev = s(logits.flip(0), reqs[::-1])
    assert rev[::-1] == full
    # A different position (or seed) draws differently somewhere.
    moved = [SampleRequest(params, seed=7 + i, position=11 + i) for i in range(6)]
    assert [r.token_id for r in s(logits, moved)] != [r.token_id for r in full]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    logits = probs.log()[None].repeat(4000, 1)
    reqs = [SampleRequest(SamplingParams(temperature=1.0), seed=123, position=p)
            for p in range(4000)]
    tokens = torch.tensor([r.token_id for r in sampler()(logits, reqs)])
    freq = torch.bincount(tokens, minlength=4).double() / 4000
    # 4000 draws: the standard error of each frequency is below 0.008.
    assert torch.allclose(freq, probs.double(), atol=0.03), freq


def test_top_k_and_top_p_keep_only_the_best_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(300, 1)
    s = sampler()
    top_k = [SampleRequest(SamplingParams(temperature=2.0, top_k=2), seed=1, position=p)
             for p in range(300)]
    assert {r.token_id for r in s(logits, top_k)} == {0, 1}
    # softmax: [0.636, 0.234, 0.086, ...]; top_p 0.8 keeps the two whose mass reaches 0.8.
    top_p = [SampleRequest(SamplingParams(temperature=1.0, top_p=0.8), seed=2, position=p)
             for p in range(300)]
    assert {r.token_id for r in s(logits, top_p)} == {0, 1}
    tiny_p = [SampleRequest(SamplingParams(temperature=1.0, top_p=1e-9), seed=2, position=p)
              for p in range(50)]
    assert {r.token_id for r in s(logits[:50], tiny_p)} == {0}


def test_logprobs_are_of_the_processed_logits_and_list_the_top_n():
    logits = torch.tensor([[2.0, 1.0, 0.0, 1.0]])
    req = SampleRequest(SamplingParams(temperature=0.5, top_k=3, logprobs=2), seed=3,
                        position=0)
    out = sampler()(logits, [req])[0]
    kept = torch.tensor([4.0, 2.0, float("-inf"), 2.0])  # /0.5, token 2 dropped by top-k
    lp = torch.log_softmax(kept, -1)
    assert out.logprobs[out.token_id] == lp[out.token_id].item()
    # Top 2 by a stable sort: token 0, then token 1 (tied with 3, lower id first).
    assert next(iter(out.logprobs)) == out.token_id
    assert set(out.logprobs) == {out.token_id, 0, 1}
    assert all(v == lp[k].item() for k, v in out.logprobs.items())
    assert out.token_id != 2


def test_banned_tokens_are_never_chosen_and_default_seeds_differ():
    logits = torch.tensor([[0.0, 9.0, 1.0]])
    req = SampleRequest(SamplingParams(), seed=0, position=0, banned_token_ids=(1,))
    assert sampler()(logits, [req])[0].token_id == 2
    assert derive_seed(0, 0) != derive_seed(0, 1) and derive_seed(0, 1) == derive_seed(0, 1)
    assert 0 <= derive_seed(5, 9) < 2**64
