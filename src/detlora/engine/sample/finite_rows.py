"""Which logits rows are entirely finite: the sampler's guard against NaN and inf.

A NaN or inf in a row (a broken model or adapter, an overflowing ``lora_alpha``) has no
meaningful token: argmax over NaN gives ``vocab_size`` on the torch reference, the Gumbel-max
an arbitrary id. The sampler computes this flag on the device with the step's other work, reads
it back with the tokens (no extra host sync), and replaces a flagged row's token with
``SAFE_TOKEN`` so that nothing outside ``[0, vocab)`` reaches an embedding, even in a step
launched before the host has seen the flag.
"""

from __future__ import annotations

import torch

SAFE_TOKEN = 0  # what a flagged row feeds forward (its result is dropped by the engine)


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """bool [N]: whether every value of each row of ``logits`` [N, V] is finite. One pass:
    ``aminmax`` propagates NaN, and a row is finite exactly when its min and max are."""
    lo, hi = torch.aminmax(logits, dim=-1)
    return torch.isfinite(lo) & torch.isfinite(hi)


def safe_tokens(tokens: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """``tokens`` with every row not ``finite`` replaced by ``SAFE_TOKEN``."""
    return torch.where(finite, tokens, SAFE_TOKEN)
