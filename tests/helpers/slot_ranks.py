"""Shrink outputs and B as LoRA slots hold them for a slot's rank, for the expand tests."""

from __future__ import annotations


def zero_past_ranks(h, b, ids, offsets, ranks, full=32):
    """h and B zero from each slot's rank up to the end of the rank steps the kernel reads
    for it (16, 32 or 64 ranks, as the rank asks, at most ``full``), garbage past them (and
    everywhere in a rank-0 slice): slots hold zeros there, and a kernel that read past its
    steps, or a rank-0 slice at all, would be wrong."""
    h, b = h.clone(), b.clone()
    for a in range(ranks.shape[0]):
        for s in range(ranks.shape[1]):
            r = int(ranks[a, s])
            if r == 0:
                continue
            step = min(min(max(16, 1 << (full - 1).bit_length()), 64),
                       max(16, 1 << (r - 1).bit_length()))
            end = -(-r // step) * step
            h[s, ids == a, r:end] = 0
            b[a, offsets[s]:offsets[s + 1], r:end] = 0
    return h, b
