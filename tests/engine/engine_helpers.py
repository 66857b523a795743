"""Helpers shared by the engine tests (imported as a plain module: tests/ has no packages)."""

from __future__ import annotations

import torch

VOCAB = 128  # the tiny checkpoints' vocabulary (conftest.py)


def random_prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(2, VOCAB, (k,), generator=g).tolist() for k in lens]


def same_outputs(a, b) -> bool:
    """Token ids and logprobs equal to the bit (floats compared with ==)."""
    x, y = a.outputs[0], b.outputs[0]
    return x.token_ids == y.token_ids and x.logprobs == y.logprobs


def sort_scatter_filter(logits, temps, top_k, limit, log_softmax):
    """Temperature, top-k and top-p by sorting x = logits / t and scattering back, all torch
    (the sampler's first filter, with the top-p probabilities of a log_softmax in token
    order, as ``filter_logits`` takes them): the oracle it must match where x and the logits
    rank alike."""
    x = logits.float() / temps[:, None]
    if top_k is None and limit is None:
        return x
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    rank_keep = None
    if top_k is not None:
        rank_keep = torch.arange(x.shape[1])[None, :] < top_k[:, None]
    if limit is not None:
        x_k = x
        if rank_keep is not None:
            token_keep = torch.empty_like(rank_keep).scatter_(1, order, rank_keep)
            x_k = x.masked_fill(~token_keep, float("-inf"))
        probs = torch.exp(log_softmax(x_k).float()).gather(1, order).double()
        mass = torch.floor(probs * (1 << 40)).to(torch.int64)
        keep_p = (torch.cumsum(mass, -1) - mass) < limit[:, None]
        rank_keep = keep_p if rank_keep is None else rank_keep.logical_and_(keep_p)
        rank_keep[:, 0] = True
    kept = sorted_x.masked_fill(~rank_keep, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, kept)
