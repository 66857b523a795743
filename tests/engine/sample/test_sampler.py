"""The sampler alone: greedy ties, seeded draws independent of the batch, filters, logprobs,
and the same bits as the previous all-torch sampler (references and interpreted kernels)."""

import random
import subprocess
import sys

import pytest
import torch

from detlora.config import SamplingParams
from detlora.engine.sample.sampler import (
    Sampler,
    SampleRequest,
    _mix32,
    derive_seed,
    row_keys,
    uniform_noise,
)
from detlora.ops import sampling as sp
from detlora.ops.reductions import argmax_ref
from detlora.ops.softmax import log_softmax_ref


def sampler(**kwargs) -> Sampler:
    return Sampler(argmax_ref, log_softmax_ref, **kwargs)


def test_greedy_ties_go_to_the_lowest_token_id():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    req = SampleRequest(SamplingParams(temperature=0.0, logprobs=0), seed=0, position=4)
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


def test_logprobs_are_of_the_processed_logits_on_request_and_list_the_top_n():
    logits = torch.tensor([[2.0, 1.0, 0.0, 1.0]])
    req = SampleRequest(SamplingParams(temperature=0.5, top_k=3, logprobs=2), seed=3,
                        position=0)
    out = sampler(logprobs_mode="processed_logprobs")(logits, [req])[0]
    kept = torch.tensor([4.0, 2.0, float("-inf"), 2.0])  # /0.5, token 2 dropped by top-k
    lp = torch.log_softmax(kept, -1)
    assert out.logprobs[out.token_id] == lp[out.token_id].item()
    # Top 2 by a stable sort: token 0, then token 1 (tied with 3, lower id first).
    assert next(iter(out.logprobs)) == out.token_id
    assert set(out.logprobs) == {out.token_id, 0, 1}
    assert all(v == lp[k].item() for k, v in out.logprobs.items())
    assert out.token_id != 2
    # The chosen token's rank counts the strictly better tokens (1 and 3 tie at rank 2);
    # the top ones carry their places.
    ranks = dict(zip(out.logprobs, out.ranks, strict=True))
    assert ranks[out.token_id] == {0: 1, 1: 2, 3: 2}[out.token_id]
    assert ranks[0] == 1 and ranks.get(1, 2) == 2
    processed_logits = sampler(logprobs_mode="processed_logits")(logits, [req])[0]
    assert processed_logits.token_id == out.token_id
    assert all(v == kept[k].item() for k, v in processed_logits.logprobs.items())


@pytest.mark.parametrize("top", [0, 2])
def test_logprobs_are_the_raw_models_by_default(top):
    # vLLM's default logprobs_mode: the model's distribution, before temperature, top-k,
    # bans and penalties, whatever drew the token.
    logits = torch.tensor([[2.0, 1.0, 0.0, 1.0], [0.5, 3.0, 1.0, -1.0]])
    lp = torch.log_softmax(logits, -1)
    reqs = [SampleRequest(SamplingParams(temperature=0.5, top_k=3, logprobs=top), seed=3,
                          position=0),
            SampleRequest(SamplingParams(temperature=0.0, logprobs=top, repetition_penalty=2.0),
                          seed=0, position=0, banned_token_ids=(1,))]
    for out, row, x in zip(sampler()(logits, reqs), lp, logits, strict=True):
        assert all(v == row[k].item() for k, v in out.logprobs.items())
        rank = 1 + int((x > x[out.token_id]).sum())
        assert out.ranks[0] == rank
        assert len(out.logprobs) >= top
    raw_logits = sampler(logprobs_mode="raw_logits")(logits, reqs)
    assert [r.token_id for r in raw_logits] == [r.token_id for r in sampler()(logits, reqs)]
    for out, x in zip(raw_logits, logits, strict=True):
        assert all(v == x[k].item() for k, v in out.logprobs.items())
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        sampler(logprobs_mode="raw")


def test_banned_tokens_are_never_chosen_and_default_seeds_differ():
    logits = torch.tensor([[0.0, 9.0, 1.0]])
    req = SampleRequest(SamplingParams(temperature=0.0), seed=0, position=0, banned_token_ids=(1,))
    assert sampler()(logits, [req])[0].token_id == 2
    assert derive_seed(0, 0) != derive_seed(0, 1) and derive_seed(0, 1) == derive_seed(0, 1)
    assert 0 <= derive_seed(5, 9) < 2**64


def _previous_sampler(logits, requests):
    """The sampler before the sampling ops, all torch: (token, logprobs) per row."""
    logits = logits.float()
    banned = [(i, t) for i, r in enumerate(requests) for t in r.banned_token_ids]
    if banned:
        logits = logits.clone()
        rows, cols = zip(*banned, strict=True)
        logits[list(rows), list(cols)] = float("-inf")
    n, vocab = logits.shape
    tokens = torch.empty(n, dtype=torch.int64)
    processed = logits
    greedy = [i for i, r in enumerate(requests) if r.params.greedy]
    sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
    if greedy:
        tokens[greedy] = argmax_ref(logits[greedy])
    if sampled:
        reqs = [requests[i] for i in sampled]
        x = logits[sampled] / torch.tensor([r.params.temperature for r in reqs])[:, None]
        top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in reqs]
        top_p = [r.params.top_p for r in reqs]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            order = torch.sort(x, dim=-1, descending=True, stable=True).indices
            rank_keep = torch.arange(vocab)[None, :] < torch.tensor(top_k)[:, None]
            if any(p < 1.0 for p in top_p):
                sorted_x = x.gather(1, order).masked_fill(~rank_keep, float("-inf"))
                mass = torch.floor(torch.exp(log_softmax_ref(sorted_x)).double() * 2**40).long()
                limit = torch.tensor([int(p * 2**40) if p < 1.0 else 1 << 62 for p in top_p])
                rank_keep &= (torch.cumsum(mass, -1) - mass) < limit[:, None]
                rank_keep[:, 0] = True
            keep = torch.zeros_like(rank_keep).scatter(1, order, rank_keep)
            x = x.masked_fill(~keep, float("-inf"))
        keys = torch.tensor([row_keys(r.seed, r.position) for r in reqs])
        noise = sp.gumbel_noise(keys, sp.token_hash(vocab))
        tokens[sampled] = torch.argmax(x.double() + noise, dim=-1)
        processed = logits.clone()
        processed[sampled] = x
    out = []
    for i, r in enumerate(requests):
        k = r.params.logprobs
        if k is None:
            out.append((tokens[i].item(), None))
            continue
        lp = log_softmax_ref(processed[i : i + 1])[0]
        entry = {tokens[i].item(): lp[tokens[i]].item()}
        vals, ids = torch.sort(lp, descending=True, stable=True)
        for tid, val in zip(ids[:k].tolist(), vals[:k].tolist(), strict=True):
            entry.setdefault(tid, val)
        out.append((tokens[i].item(), entry))
    return out


def _random_batch(rng, vocab, n):
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(rng.randrange(1000)))
    if rng.random() < 0.3:
        logits = (logits * 2).round()  # many exact ties
    reqs = []
    for _ in range(n):
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.0, 0.8, 1.0, 1.7]),
            top_k=rng.choice([-1, 0, 1, 5, vocab, vocab + 3]),
            top_p=rng.choice([1.0, 1.0, 0.95, 0.5, 1e-9]),
            logprobs=rng.choice([None, 0, 1, 3]),
        )
        banned = tuple(rng.sample(range(vocab), rng.choice([0, 0, 1, 3])))
        reqs.append(SampleRequest(params, seed=rng.getrandbits(64),
                                  position=rng.randrange(10**6), banned_token_ids=banned))
    return logits, reqs


def _as_tuples(results):
    return [(r.token_id, r.logprobs, list(r.logprobs or ())) for r in results]


def test_same_tokens_and_logprobs_as_the_previous_sampler():
    # The previous sampler reported processed logprobs.
    rng = random.Random(0)
    s = sampler(logprobs_mode="processed_logprobs")
    for _ in range(60):
        logits, reqs = _random_batch(rng, rng.choice([7, 50, 300]), rng.choice([1, 2, 5, 9]))
        if rng.random() < 0.2:
            logits = logits.bfloat16()
        before = logits.clone()
        want = [(t, lp, list(lp or ())) for t, lp in _previous_sampler(logits, reqs)]
        assert _as_tuples(s(logits, reqs)) == want
        assert torch.equal(logits, before)  # banned tokens are masked on a copy


def test_kernels_give_the_same_results_as_the_references():
    # Sampling ops through the interpreted Triton kernels (the CUDA path) vs their references.
    rng = random.Random(1)
    for mode in ("raw_logprobs", "processed_logprobs"):
        kernels = sampler(kernels=True, logprobs_mode=mode)
        refs = sampler(kernels=False, logprobs_mode=mode)
        for _ in range(6):
            logits, reqs = _random_batch(rng, rng.choice([7, 300, 1100]), rng.choice([1, 3]))
            assert _as_tuples(kernels(logits, reqs)) == _as_tuples(refs(logits, reqs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_logits_exact_in_the_heads_dtype_rank_alike_there(dtype):
    # The engine's LM head computes in the model's dtype and returns fp32: ranking those
    # logits in that dtype (16-bit keys) gives the same tokens and logprobs, kernels or not.
    rng = random.Random(2)
    for kernels in (False, True):
        plain, ranked = sampler(kernels=kernels), sampler(kernels=kernels, logits_dtype=dtype)
        for _ in range(6):
            logits, reqs = _random_batch(rng, rng.choice([7, 300]), rng.choice([1, 3, 6]))
            logits = logits.to(dtype).float()
            assert _as_tuples(ranked(logits, reqs)) == _as_tuples(plain(logits, reqs))


def test_logits_dtype_must_be_a_float_dtype():
    with pytest.raises(ValueError, match="logits_dtype must be float32, bfloat16 or float16"):
        sampler(logits_dtype=torch.int32)


def test_importing_the_engine_does_not_load_triton():
    # TRITON_INTERPRET must be settable after `import detlora...`: kernels load on first use.
    code = "import sys, detlora.engine.llm_engine; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_greedy_head_answers_all_greedy_batches_with_the_same_results():
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 300, generator=g) * 4).to(torch.bfloat16).float()
    logits[2, :3] = logits[2].max()  # a tie: the lowest id must win through the head too
    s = sampler()
    head = s.greedy_head(logits)
    assert head.shape == (6, 3) and head.dtype == torch.float64
    assert head[:, 2].tolist() == [1.0] * 6  # every row finite
    for logprobs in (None, 0):
        reqs = [SampleRequest(SamplingParams(temperature=0.0,
                                             logprobs=logprobs), seed=k, position=9)
                for k in range(6)]
        assert s(logits, reqs, greedy=head) == s(logits, reqs)
    # Rows the head cannot answer (sampled, banned tokens, top logprobs): the full path runs.
    mixed = [SampleRequest(SamplingParams(temperature=0.0, logprobs=0), seed=0, position=9),
             SampleRequest(SamplingParams(temperature=0.7, seed=3), seed=3, position=9),
             SampleRequest(SamplingParams(temperature=0.0, logprobs=2), seed=0, position=9),
             SampleRequest(SamplingParams(temperature=0.0), seed=0, position=9,
                           banned_token_ids=(1, 2)),
             SampleRequest(SamplingParams(temperature=0.0), seed=0, position=9),
             SampleRequest(SamplingParams(temperature=0.0), seed=0, position=9)]
    assert s(logits, mixed, greedy=head) == s(logits, mixed)
    # Greedy rows beside sampled ones (top-p, banned tokens, with and without logprobs): the
    # head answers the greedy rows, the sampled rows are computed; the same results.
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=1, logprobs=0)
    beside = [SampleRequest(SamplingParams(temperature=0.0, logprobs=0), seed=0, position=9),
              SampleRequest(sampled, seed=3, position=9),
              SampleRequest(SamplingParams(temperature=0.0), seed=0, position=9),
              SampleRequest(sampled, seed=4, position=9, banned_token_ids=(5,)),
              SampleRequest(SamplingParams(temperature=1.2, seed=2), seed=2, position=9),
              SampleRequest(SamplingParams(temperature=0.0, logprobs=0), seed=0, position=9)]
    for reqs in (beside, [beside[k] for k in (1, 0, 2, 4, 5, 3)], beside[:1] + beside[2:3]):
        rows = len(reqs)
        want = s(logits[:rows], reqs)
        assert s(logits[:rows], reqs, greedy=head[:rows]) == want
        assert any(r.logprobs for r in want)
    with pytest.raises(ValueError, match=r"greedy must be \[6, 3\]"):
        s(logits, [SampleRequest(SamplingParams(temperature=0.0), seed=0, position=1)] * 6,
          greedy=head[:3])


def _old_greedy_head(argmax, log_softmax, logits):
    """The greedy head before chosen_logprob: fp32 logits, a full log_softmax, one column."""
    x = logits.float()
    tokens = argmax(x).to(torch.int64)
    chosen = log_softmax(x).float().gather(1, tokens[:, None])[:, 0]
    finite = torch.isfinite(x).all(dim=-1)
    return torch.stack([tokens.double(), chosen.double(), finite.double()], dim=1)


def _decode_batch(rng, vocab, n):
    """bf16 logits (runs of the lowest finite bf16 value in some rows: -inf would mark the
    row as not finite) and a decode step's requests: greedy rows beside sampled ones
    (temperature, top-p, top-k), logprobs 0 or None, some sampled rows with banned tokens:
    the batches the greedy head answers."""
    g = torch.Generator().manual_seed(rng.randrange(1000))
    logits = (torch.randn(n, vocab, generator=g) * 3).to(torch.bfloat16)
    for i in range(n):
        if rng.random() < 0.3:
            start = rng.randrange(vocab)
            logits[i, start : start + vocab // 3] = torch.finfo(torch.bfloat16).min
    reqs = []
    for k in range(n):
        lp = rng.choice([0, 0, None])
        if rng.random() < 0.5:
            params = SamplingParams(temperature=0.0, logprobs=lp)
            banned = ()
        else:
            params = SamplingParams(temperature=rng.choice([0.8, 1.3]),
                                    top_p=rng.choice([0.95, 1.0]), top_k=rng.choice([0, 40]),
                                    logprobs=lp, seed=k)
            banned = tuple(rng.sample(range(vocab), rng.choice([0, 0, 2])))
        reqs.append(SampleRequest(params, seed=rng.getrandbits(64), position=rng.randrange(10**6),
                                  banned_token_ids=banned))
    return logits, reqs


@pytest.mark.parametrize("kernels", [False, True])
def test_model_dtype_logits_and_chosen_logprob_give_the_previous_results(kernels):
    """The engine's path (bf16 logits as the LM head gives them, chosen_logprob, the greedy
    head read from bf16) against the previous one (fp32 logits, a full log_softmax gathered,
    the head from fp32): the same head bits, tokens and logprobs, with and without the head;
    the torch references (CPU) and the interpreted kernels (the CUDA path)."""
    if kernels:
        from detlora.ops.reductions import argmax
        from detlora.ops.softmax import chosen_logprob, log_softmax
    else:
        from detlora.ops.softmax import chosen_logprob_ref as chosen_logprob

        argmax, log_softmax = argmax_ref, log_softmax_ref
    rng = random.Random(8)
    cases = ((300, 6), (5000, 5), (300, 1), (5000, 2)) * (1 if kernels else 3)
    for k, (vocab, n) in enumerate(cases):
        # The previous sampler reported processed logprobs; raw ones must agree as well.
        mode = "processed_logprobs" if k % 2 == 0 else "raw_logprobs"
        new = Sampler(argmax, log_softmax, chosen_logprob=chosen_logprob, kernels=kernels,
                      logits_dtype=torch.bfloat16, logprobs_mode=mode)
        old = Sampler(argmax, log_softmax, kernels=kernels, logits_dtype=torch.bfloat16,
                      logprobs_mode=mode)
        logits, reqs = _decode_batch(rng, vocab, n)
        before = logits.clone()
        x = logits.float()  # what compute_logits returned before
        head_old = _old_greedy_head(argmax, log_softmax, x)
        head_new = new.greedy_head(logits)
        assert torch.equal(head_new, head_old)
        want = _as_tuples(old(x, reqs, greedy=head_old))
        if not kernels and mode == "processed_logprobs":
            assert want == [(t, lp, list(lp or ())) for t, lp in _previous_sampler(x, reqs)]
        assert _as_tuples(old(x, reqs)) == want
        assert _as_tuples(new(logits, reqs, greedy=head_new)) == want
        assert _as_tuples(new(logits, reqs)) == want
        assert torch.equal(logits, before)


def test_head_path_reads_every_mix_of_wanted_rows():
    """The greedy head's read: sampled rows' values put among the head's, whichever rows want
    a logprob (all, none, only greedy ones, only sampled ones, and a sampled row's spare slot)."""
    g = torch.Generator().manual_seed(9)
    logits = (torch.randn(5, 300, generator=g) * 3).to(torch.bfloat16)
    s = sampler(logits_dtype=torch.bfloat16)
    head = s.greedy_head(logits)
    for wants in [(0, 0, 0, 0, 0), (None,) * 5, (0, None, 0, None, None), (None, 0, None, 0, 0),
                  (0, 0, None, None, 0), (None, None, 0, 0, None)]:
        reqs = [SampleRequest(SamplingParams(temperature=0.0, logprobs=w) if k % 2 == 0 else
                              SamplingParams(temperature=0.9, top_p=0.9, logprobs=w, seed=k),
                              seed=k, position=3)
                for k, w in enumerate(wants)]
        want = s(logits, reqs)
        assert s(logits, reqs, greedy=head) == want
        assert [r.logprobs is not None for r in want] == [w is not None for w in wants]
