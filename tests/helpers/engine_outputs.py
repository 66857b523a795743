"""Helpers shared by the engine tests: random prompts and bit-for-bit output comparison."""

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


def previous_filter(logits, temps, top_k, limit, log_softmax):
    """The sampler's filter before ``filter_logits`` (sort of x = logits / t, scatter back),
    all torch: the oracle its replacement must match where x and the logits rank alike."""
    x = logits.float() / temps[:, None]
    if top_k is None and limit is None:
        return x
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    rank_keep = None
    if top_k is not None:
        rank_keep = torch.arange(x.shape[1])[None, :] < top_k[:, None]
    if limit is not None:
        if rank_keep is not None:
            sorted_x = sorted_x.masked_fill(~rank_keep, float("-inf"))
        probs = torch.exp(log_softmax(sorted_x).float()).double()
        mass = torch.floor(probs * (1 << 40)).to(torch.int64)
        keep_p = (torch.cumsum(mass, -1) - mass) < limit[:, None]
        rank_keep = keep_p if rank_keep is None else rank_keep.logical_and_(keep_p)
        rank_keep[:, 0] = True
    kept = sorted_x.masked_fill(~rank_keep, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, kept)
