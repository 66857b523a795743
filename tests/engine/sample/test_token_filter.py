"""filter_logits (temperature, top-k, top-p in token order, no scatter): the bits of the
sampler's previous ``_filter`` (sort of x, then scatter) on fp32 and bf16 logits, its kernel
path (interpreted Triton) equal to its torch reference, rows independent of the batch, and bad
inputs."""

import pytest
import torch
from tests.helpers.engine_outputs import previous_filter

from detlora.engine.sample.token_filter import filter_logits, filter_logits_ref

NO_LIMIT = 1 << 62
INF = float("inf")


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x, -1)


def oracle(logits, temps, top_k, limit):
    """The sampler's previous filter, on fp32 logits."""
    return previous_filter(logits.float(), temps, top_k, limit, log_softmax)


def run(logits, temps, top_k, limit, kernels):
    if kernels is None:
        return filter_logits_ref(logits, temps, top_k, limit, log_softmax=log_softmax)
    return filter_logits(logits, temps, top_k, limit, log_softmax=log_softmax, kernels=kernels)


def _logits(n: int, vocab: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Random rows with the awkward cases: ties (across a likely cut), -inf, a row all -inf,
    -0.0 next to +0.0, a peaked row."""
    g = torch.Generator().manual_seed(seed)
    # On a 2^-16 grid: distinct values stay >= 16 ulps apart, so no two collide after the
    # division (the old filter sorted x, the new one sorts the logits).
    x = torch.round(torch.randn(n, vocab, generator=g) * 3 * 2**16) / 2**16
    if n > 1:
        x[1] = torch.round(x[1] * 2) / 2  # many ties: values on a grid of 0.5
    if n > 2:
        x[2, : vocab // 2] = -INF
    if n > 3:
        x[3] = -INF
    if n > 4:
        x[4, ::3] = 0.0
        x[4, 1::3] = -0.0
    if n > 5:
        x[5, 7] = 40.0  # one token holds (almost) all the mass
    return x.to(dtype)


def _params(n: int, vocab: int, case: str):
    """(temps, top_k, limit) for a row mix: temperatures != 1, top_k = 1, top_p = 1."""
    temps = torch.tensor([0.7, 1.0, 1.3, 2.0, 0.35, 1.1, 0.9, 3.0])[:n].repeat(n)[:n]
    ks = torch.tensor([50, 1, vocab, 3, 17, vocab, 600, 2])[:n].repeat(n)[:n]
    ps = [0.9, 0.5, 1.0, 0.99, 0.3, 0.95, 1e-9, 0.75]
    limit = torch.tensor([int(p * 2**40) if p < 1 else NO_LIMIT for p in ps] * n)[:n]
    if case == "top_k":
        return temps, ks, None
    if case == "top_p":
        return temps, None, limit
    if case == "top_p_one":  # every row's top_p = 1: nothing dropped
        return temps, None, torch.full((n,), NO_LIMIT)
    if case == "both":
        return temps, ks, limit
    return temps, None, None  # temperature alone


def _ranks_alike(logits: torch.Tensor, temps: torch.Tensor) -> bool:
    """The raw logits and x = logits / t sort alike (the oracle sorts x)."""
    x = logits.float() / temps[:, None]
    by_logits = torch.sort(logits, dim=-1, descending=True, stable=True).indices
    by_x = torch.sort(x, dim=-1, descending=True, stable=True).indices
    return torch.equal(by_logits, by_x)


CASES = ["top_k", "top_p", "top_p_one", "both", "temperature"]


@pytest.mark.parametrize("kernels", [None, False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("vocab", [1000, 5003])
def test_fp32_logits_give_the_previous_filters_bits(kernels, case, vocab):
    logits = _logits(8, vocab, seed=vocab + len(case))
    temps, top_k, limit = _params(8, vocab, case)
    assert _ranks_alike(logits, temps)
    before = logits.clone()
    got = run(logits, temps, top_k, limit, kernels)
    assert got.dtype == torch.float32 and got.shape == (8, vocab)
    assert torch.equal(got, oracle(logits, temps, top_k, limit))
    assert torch.equal(logits, before)  # inputs untouched


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("case", ["top_k", "top_p", "both"])
def test_bf16_logits_give_the_previous_filters_bits_on_their_fp32_values(kernels, case):
    vocab = 5003
    logits = _logits(8, vocab, seed=11, dtype=torch.bfloat16)  # many exact ties
    temps, top_k, limit = _params(8, vocab, case)
    # Distinct bf16 values stay distinct in fp32 after dividing: the orders agree.
    assert _ranks_alike(logits, temps)
    got = run(logits, temps, top_k, limit, kernels)
    assert torch.equal(got, oracle(logits, temps, top_k, limit))


def test_the_order_is_that_of_the_raw_logits():
    # 1.5 and 1.5 + 2^-23 collide after / 2.5 (both round to the same fp32): x ties, the
    # logits do not. The old filter (sorting x) breaks the tie by token id; the new one ranks
    # token 1 (the larger logit) first. Top-k = 1 keeps one of them.
    logits = torch.tensor([[1.5, 1.5 + 2**-23, -5.0]])
    temps = torch.tensor([2.5])
    x = logits / temps[:, None]
    assert x[0, 0] == x[0, 1]
    top_k = torch.tensor([1])
    for kernels in (False, True):
        got = run(logits, temps, top_k, None, kernels)
        assert torch.equal(got, torch.tensor([[-INF, x[0, 1].item(), -INF]]))
    assert oracle(logits, temps, top_k, None)[0, 0] == x[0, 0]  # the old pick: token 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["top_k", "top_p", "both", "temperature"])
def test_kernels_give_the_reference_bits(dtype, case):
    vocab = 5003
    logits = _logits(8, vocab, seed=3, dtype=dtype)
    temps, top_k, limit = _params(8, vocab, case)
    ref = run(logits, temps, top_k, limit, False)
    assert torch.equal(run(logits, temps, top_k, limit, True), ref)
    assert torch.equal(filter_logits_ref(logits, temps, top_k, limit, log_softmax=log_softmax),
                       ref)


def test_kernels_with_small_chunks_and_strided_inputs(monkeypatch):
    """Many kept_ranks chunks (cuts inside and on chunk edges); rows and temperatures strided
    as the sampler passes them (rows of a larger batch, fp32 bits in int64 slots)."""
    from detlora.ops import sampling as sp

    monkeypatch.setattr(sp, "_COUNT_CHUNK", 64)
    monkeypatch.setattr(sp, "_FILTER_BLOCK", 128)
    vocab = 1000
    big = _logits(8, vocab + 24, seed=5)
    logits = big[:, :vocab]  # row stride 1024
    slots = torch.zeros(8, dtype=torch.int64)
    slots.view(torch.float32)[::2] = torch.tensor([0.7, 1.0, 1.3, 2.0, 0.35, 1.1, 0.9, 3.0])
    temps = slots.view(torch.float32)[::2]  # stride 2
    _, top_k, limit = _params(8, vocab, "both")
    top_k[0], top_k[6] = 64, 129  # on and just past a chunk edge
    assert temps.stride(0) == 2 and logits.stride(0) == vocab + 24
    for tk in (top_k, None):
        ref = run(logits, temps, tk, limit, False)
        assert torch.equal(run(logits, temps, tk, limit, True), ref)
        assert torch.equal(ref, oracle(logits, temps, tk, limit))


@pytest.mark.parametrize("kernels", [False, True])
def test_rows_do_not_depend_on_the_batch(kernels):
    vocab = 1000
    logits = _logits(6, vocab, seed=9, dtype=torch.bfloat16)
    temps, top_k, limit = _params(6, vocab, "both")
    full = run(logits, temps, top_k, limit, kernels)
    for i in range(6):
        one = slice(i, i + 1)
        assert torch.equal(run(logits[one], temps[one], top_k[one], limit[one], kernels),
                           full[one])
    flip = run(logits.flip(0), temps.flip(0), top_k.flip(0), limit.flip(0), kernels)
    assert torch.equal(flip.flip(0), full)


@pytest.mark.parametrize("kernels", [False, True])
def test_kept_tokens_and_edges(kernels):
    logits = torch.tensor([[2.0, 3.0, 3.0, 1.0, 3.0, -INF],
                           [0.0, -0.0, 0.0, 5.0, -0.0, -1.0],
                           [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    temps = torch.tensor([0.5, 1.0, 2.0])
    x = logits / temps[:, None]

    def kept(top_k, limit):
        got = run(logits, temps, top_k, limit, kernels)
        assert torch.equal(got, oracle(logits, temps, top_k, limit))
        assert bool(((got == x) | (got == -INF)).all())  # x, or dropped
        return [[j for j in range(6) if got[i, j] > -INF] for i in range(3)]

    # Ties at the cut: lower ids first; -0.0 ties with +0.0.
    assert kept(torch.tensor([2, 3, 4]), None) == [[1, 2], [0, 1, 3], [0, 1, 2, 3]]
    assert kept(torch.tensor([1, 1, 1]), None) == [[1], [3], [0]]
    every = [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]  # token 5 of row 0 is -inf
    assert kept(torch.tensor([6, 6, 6]), None) == every
    # top_p = 0 keeps the best token alone; top_p = 1 keeps all (even past a total > 1).
    assert kept(None, torch.zeros(3, dtype=torch.int64)) == [[1], [3], [0]]
    assert kept(None, torch.full((3,), NO_LIMIT)) == every
    # Uniform row: every token holds m = floor(p * 2^40), p = fp32(1/6) (a hair below 1/6):
    # top_p = 0.5 keeps the ranks starting at 0, m, 2m and 3m (< 2^39); a limit of 3m stops
    # before rank 3, one of 3m + 1 keeps it.
    m = int(torch.floor(torch.exp(log_softmax(torch.zeros(6)))[0].double() * 2**40))
    assert 3 * m < 2**39 < 4 * m
    assert kept(None, torch.full((3,), 2**39))[2] == [0, 1, 2, 3]
    assert kept(None, torch.full((3,), 3 * m))[2] == [0, 1, 2]
    assert kept(None, torch.full((3,), 3 * m + 1))[2] == [0, 1, 2, 3]
    # Top-k comes first: two tokens left hold 2^39 each, so rank 1 needs a limit > 2^39.
    assert kept(torch.tensor([6, 6, 2]), torch.full((3,), 2**39))[2] == [0]
    assert kept(torch.tensor([6, 6, 2]), torch.full((3,), 2**39 + 1))[2] == [0, 1]


@pytest.mark.parametrize("kernels", [False, True])
def test_empty_batch_and_one_token(kernels):
    empty = torch.zeros(0, 7)
    none = torch.zeros(0, dtype=torch.int64)
    got = run(empty, torch.zeros(0), none, none, kernels)
    assert got.shape == (0, 7) and got.dtype == torch.float32
    one = torch.tensor([[1.5], [-INF]])
    got = run(one, torch.tensor([0.5, 1.0]), torch.tensor([1, 1]),
              torch.tensor([0, NO_LIMIT]), kernels)
    assert torch.equal(got, torch.tensor([[3.0], [-INF]]))


def test_bad_inputs_raise_value_error():
    logits = torch.randn(3, 16)
    temps = torch.ones(3)
    k = torch.full((3,), 4)
    lim = torch.full((3,), NO_LIMIT)
    cases = [
        (lambda: run(None, temps, k, lim, True), "logits must be a torch.Tensor"),
        (lambda: run(logits[0], temps, k, lim, False), "logits must have 2 dimensions"),
        (lambda: run(logits.double(), temps, k, lim, True), "logits must have dtype"),
        (lambda: run(logits[:, :0], temps, k, lim, False), "logits must have at least one"),
        (lambda: run(logits.t(), temps.repeat(6)[:16], None, None, True),
         "logits must be contiguous in its last"),
        (lambda: run(logits, temps.double(), k, lim, True), "temps must have dtype"),
        (lambda: run(logits, temps[:2], k, lim, False), r"temps must have shape \(3,\)"),
        (lambda: run(logits, temps, k.int(), lim, True), "top_k must have dtype"),
        (lambda: run(logits, temps, k[:, None], lim, True), "top_k must have 1 dimensions"),
        (lambda: run(logits, temps, k, lim[:1], False), r"limit must have shape \(3,\)"),
        (lambda: run(logits, temps, k, lim.float(), True), "limit must have dtype"),
        (lambda: run(logits, temps, k, lim.to("meta"), False), "limit is on meta"),
        (lambda: run(logits, temps, k.to("meta"), lim, True), "top_k is on meta"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
