"""The sampling kernels on the GPU: the same bits as their torch references (the hash, the
float64 Gumbel scores, the top-k / top-p filter), row independence, and the sampler's kernel path
giving the reference path's tokens and logprobs. chosen_logprob: the log-softmax kernel's
column bit for bit (16-bit inputs: that of their fp32 upcast), and the sampler reading bf16
logits (the LM head's dtype) with it giving the previous fp32 path's results."""

import pytest
import torch

from detlora.config import SamplingParams
from detlora.engine.sample.sampler import Sampler, SampleRequest
from detlora.engine.sample.token_filter import filter_logits
from detlora.ops import sampling as sp
from detlora.ops.reductions import argmax
from detlora.ops.softmax import chosen_logprob, log_softmax

pytestmark = pytest.mark.gpu

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
        params = (SamplingParams(temperature=0.0, max_tokens=4, logprobs=2) if k % 3 == 0 else
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


def _head_logits(t: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits as an LM head gives them (-inf runs in some rows) and, per row, an index: the
    last column, a -inf entry, the row's maximum, random ones."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(t, VOCAB, device=DEV, generator=g) * 3).to(dtype)
    x[0, 1000:90000] = float("-inf")
    index = torch.randint(0, VOCAB, (t,), device=DEV, generator=g)
    index[0] = VOCAB - 1
    if t > 1:
        x[1, ::2] = float("-inf")
        index[1] = 0  # a -inf entry: logprob -inf
    if t > 2:
        index[2] = x[2].float().argmax()
    return x, index


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t", [1, 3, 64])
def test_chosen_logprob_is_the_log_softmax_kernels_column(t, dtype):
    """The bits of ``log_softmax(x.float())[t, index[t]]`` (the kernel's full output): a 16-bit
    x gives those of its fp32 upcast (its statistics load keeps the fp32 register layout)."""
    x, index = _head_logits(t, dtype, seed=t)
    rows = torch.arange(t, device=DEV)
    want = log_softmax(x.float())[rows, index]
    got = chosen_logprob(x, index)
    assert torch.equal(got, want)
    assert torch.equal(chosen_logprob(x.float(), index), want)
    out = torch.full((t, 2), float("nan"), dtype=torch.float64, device=DEV)
    chosen_logprob(x, index, out=out[:, 1])  # float64, strided: what the greedy head writes
    assert torch.equal(out[:, 1], want.double())
    for i in sorted({0, t // 2, t - 1}):  # a row alone: its bits
        assert torch.equal(chosen_logprob(x[i:i + 1], index[i:i + 1]), got[i:i + 1])
    if t > 1:
        assert got[1] == float("-inf")
    ref = torch.log_softmax(x.double(), -1)[rows, index]
    finite = ref.isfinite()
    assert torch.equal(got.isfinite(), finite)
    assert float((got.double() - ref)[finite].abs().max()) < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chosen_logprob_matches_every_lane_of_the_log_softmax_kernel(dtype):
    """One row's columns all over its chunks and every thread of a chunk: the log-softmax
    kernel's S may differ by an ulp between the lanes of a warp (its merge starts with an
    FMA), and chosen_logprob must give each column the bits of the thread that holds it."""
    x, _ = _head_logits(3, dtype, seed=5)
    rows = x[2:3].expand(2048, VOCAB).contiguous()
    index = torch.arange(2048, device=DEV) * 61 + 5  # up to 124,913: 31 chunks, all lanes
    want = log_softmax(x[2:3].float())[0, index]
    assert torch.equal(chosen_logprob(rows, index), want)


def _fp32_head(x32: torch.Tensor) -> torch.Tensor:
    """The greedy head before chosen_logprob, from fp32 logits: argmax and a full log_softmax
    gathered; a row with a -inf (not finite) gets token 0 and flag 0."""
    finite = torch.isfinite(x32).all(dim=-1)
    tokens = torch.where(finite, argmax(x32), 0)
    return torch.stack([tokens.double(),
                        log_softmax(x32).gather(1, tokens[:, None])[:, 0].double(),
                        finite.double()], dim=1)


@pytest.mark.parametrize("t", [1, 3, 64])
def test_greedy_head_of_bf16_logits_is_the_fp32_heads_bits(t):
    """The head the decode graph computes, reading the bf16 LM-head output, against the previous
    one (argmax and a full log_softmax of the fp32 copy), eagerly and inside a CUDA graph."""
    x, _ = _head_logits(t, torch.bfloat16, seed=10 + t)
    x32 = x.float()
    old = _fp32_head(x32)
    s = Sampler(argmax, log_softmax, chosen_logprob=chosen_logprob,
                logits_dtype=torch.bfloat16, kernels=True)
    assert torch.equal(argmax(x), argmax(x32))
    assert old[:, 2].tolist() == [0.0] * min(t, 2) + [1.0] * (t - 2)  # the -inf rows
    assert torch.equal(s.greedy_head(x), old)
    static = x.clone()
    s.greedy_head(static)  # warm-up: compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        head = s.greedy_head(static)
    static.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(head, old)


def _decode_requests(n: int) -> list[SampleRequest]:
    """The engine benchmark's decode batch (half greedy, half temperature 0.8 / top-p 0.95,
    logprobs=0) with a few other rows: no logprobs, top-k, a banned token."""
    reqs = []
    for k in range(n):
        if k % 2 == 0:
            params = SamplingParams(temperature=0.0,
                                    max_tokens=4, logprobs=None if k % 8 == 6 else 0)
        else:
            params = SamplingParams(max_tokens=4, logprobs=None if k % 8 == 7 else 0,
                                    temperature=0.8, top_p=0.95,
                                    top_k=50 if k % 8 == 5 else 0, seed=k)
        banned = (7, 123) if k % 16 == 3 else ()
        reqs.append(SampleRequest(params, seed=1000 + k, position=100 + k,
                                  banned_token_ids=banned))
    return reqs


def _settled(results: list) -> list:
    """What a sampler result promises: everything for a finite row; the flag and the
    stand-in token for a row that held NaN or inf."""
    return [r if r.finite else (r.token_id, r.finite) for r in results]


@pytest.mark.parametrize("n", [1, 3, 64])
def test_sampler_on_bf16_logits_gives_the_fp32_paths_results(n):
    """The engine's sampler now (bf16 logits, chosen_logprob, the head from bf16) against the
    previous path (fp32 logits, the 16-bit ranks, logprobs gathered from a full log_softmax,
    the head from fp32): the same tokens and logprobs, with the head and without it. Rows
    with -inf runs are flagged not finite (their token a stand-in the engine drops, their
    logprobs meaningless): for them only the flag and the stand-in are compared."""
    x, _ = _head_logits(n, torch.bfloat16, seed=20 + n)
    x32 = x.float()
    reqs = _decode_requests(n)
    new = Sampler(argmax, log_softmax, chosen_logprob=chosen_logprob,
                  logits_dtype=torch.bfloat16, kernels=True)
    old = Sampler(argmax, log_softmax, logits_dtype=torch.bfloat16, kernels=True)
    old_head = _fp32_head(x32)
    want = old(x32, reqs, greedy=old_head)
    assert [r.finite for r in want] == [False] * min(n, 2) + [True] * (n - 2)
    assert _settled(old(x32, reqs)) == _settled(want)
    assert _settled(new(x, reqs, greedy=new.greedy_head(x))) == _settled(want)
    assert _settled(new(x, reqs)) == _settled(want)
    # A row with top logprobs: the full path.
    top = [SampleRequest(SamplingParams(temperature=0.0,
                                        max_tokens=4, logprobs=3), seed=5, position=9), *reqs[1:]]
    assert _settled(new(x, top, greedy=new.greedy_head(x))) == \
        _settled(old(x32, top, greedy=old_head))


def test_launching_adjusted_rows_queues_without_a_host_sync():
    """Penalties (with a pending token, as in a step launched ahead), allowed tokens, logit
    bias, min_p and banned tokens: ``launch`` only queues work. CUDA's sync debug mode turns
    any synchronizing call into an error (a Python scalar through ``__setitem__`` used to be
    one, which undid running ahead)."""
    from detlora.engine.sample.logit_adjust import row_adjust

    x, _, _ = _inputs(8, seed=5)
    fed = torch.randint(0, VOCAB, (8,), device=DEV)
    reqs = []
    for k in range(8):
        params = SamplingParams(max_tokens=9, logprobs=0, repetition_penalty=1.1,
                                frequency_penalty=0.2, presence_penalty=0.1,
                                logit_bias={5: 1.0} if k % 2 else None,
                                allowed_token_ids=list(range(100, 400)) if k == 3 else None,
                                min_p=0.1 if k % 2 else 0.0,
                                **(dict(temperature=0.8, seed=k) if k % 2 else
                                   dict(temperature=0.0)))
        adjust = row_adjust(params, [7, 8, 9], [11, 12, -1], pending_src=k)
        reqs.append(SampleRequest(params, seed=k, position=6, banned_token_ids=(1, 2),
                                  adjust=adjust))
    sampler = Sampler(argmax, log_softmax, chosen_logprob=chosen_logprob,
                      logits_dtype=torch.bfloat16, kernels=True)
    sampler.launch(x, reqs, fed=fed).result()  # warm: staging buffers, kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = sampler.launch(x, reqs, fed=fed)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(pending.result()) == 8


def test_penalties_on_the_gpu_are_the_cpu_references_bits():
    """The sorted-key penalties on the H200's vocabulary (repeated ids, ids seen only in the
    prompt, pending tokens in ``fed``, -inf entries from an allowed list) against the per-row
    CPU reference, bit for bit."""
    import random

    from detlora.engine.sample.logit_adjust import adjust_row_ref, apply_adjustments, row_adjust
    from detlora.engine.sample.sampler import _adjust_tensors, _pack_adjustments, _Upload

    rng = random.Random(7)
    n = 48
    x, _, _ = _inputs(n, seed=11)
    fed = torch.randint(0, VOCAB, (n,), device=DEV)
    fed_host = fed.tolist()
    rows, want = [], []
    for i in range(n):
        params = SamplingParams(temperature=0.0, repetition_penalty=rng.choice([1.0, 1.2, 0.8]),
                                frequency_penalty=rng.choice([0.0, 0.3, -0.2]),
                                presence_penalty=rng.choice([0.0, 0.5]),
                                allowed_token_ids=(list(range(0, VOCAB, 7))
                                                   if i % 5 == 0 else None))
        hot = [rng.randrange(VOCAB) for _ in range(6)]  # repeated often
        prompt = [rng.choice(hot) if rng.random() < 0.5 else rng.randrange(VOCAB)
                  for _ in range(rng.randrange(0, 300))]
        out = [rng.choice(hot) if rng.random() < 0.5 else rng.randrange(VOCAB)
               for _ in range(rng.randrange(0, 200))]
        pending = i % 3 == 0
        want.append(adjust_row_ref(x[i].cpu(), params, prompt,
                                   [*out, fed_host[i]] if pending else out))
        adjust = row_adjust(params, prompt, [*out, -1] if pending else out,
                            pending_src=i if pending else None)
        if adjust is not None:
            rows.append((i, adjust))
    up = _Upload()
    sections = _pack_adjustments(up, rows)
    got = x.clone()
    apply_adjustments(got, _adjust_tensors(torch.tensor(up.values, device=DEV), sections, fed))
    assert torch.equal(got.cpu(), torch.stack(want))
