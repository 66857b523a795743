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
