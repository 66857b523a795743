"""A LoRA shrink left unreduced: its Split-K partials, summed later by the expand.

Semantics:
    partials: [P, M, S * R] fp32, unscaled. Partial p of row m holds K chunk p of the shrink
    (or K group p, when one CTA summed a group): ``x[m, chunk p] @ A[a, :, :, chunk p]^T``,
    column s * R + r for slice s and rank r. The expand rebuilds the shrink output as

        h = zeros(S, M, R); group = zeros(M, S * R); total = zeros(M, S * R)
        for p in range(P):
            group = group + partials[p]
            if (p + 1) % tail_group == 0 or p == P - 1:
                total = total + group
                group = zeros(M, S * R)
        h[:, m] = (scale[a] * total[m]).view(S, R)      # rows whose adapter a >= 0; else 0

    (``reduce_partials_ref`` below.) That is the order in which the ordered shrink's last CTA
    sums the same partials, so deferring the sum changes no bit. What it saves is the shrink's
    tail: no per-tile counter, no GPU-scope acquire/release, no last CTA that reloads every
    partial while the base GEMM waits for SMs. The expand, which reads the shrink output
    anyway, loads P small tiles instead of one.

    With ``adapter_stride`` > 0 the partials hold every adapter slot side by side, slot a at
    columns ``a * adapter_stride + s * R + r``: that is the ``in_gemm`` shrink, where the base
    GEMM wrote x A^T for all slots (P = 1, model dtype, any row stride) next to x W^T.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShrinkPartials:
    """What a deferred shrink returns; ``lora_expand`` takes it in place of [S, M, R]."""

    partials: torch.Tensor  # [P, M, C] unscaled, unit last stride; C = S * R (or L * S * R)
    slices: int
    rank: int
    tail_group: int  # partials per group of the tree (1: a flat ordered sum)
    scale: torch.Tensor  # [L] fp32, one per adapter slot
    adapter_stride: int = 0  # columns between adapter slots (0: one set of S * R columns)

    @property
    def num_parts(self) -> int:
        return self.partials.shape[0]

    @property
    def num_rows(self) -> int:
        return self.partials.shape[1]


def reduce_partials_ref(sp: ShrinkPartials, token_adapter: torch.Tensor) -> torch.Tensor:
    """Torch reference: the fp32 [S, M, R] shrink output the partials stand for."""
    m, n = sp.num_rows, sp.slices * sp.rank
    ids = token_adapter.to(torch.int64)
    has = ids >= 0
    cols = ids.clamp(min=0)[:, None] * sp.adapter_stride + torch.arange(n, device=ids.device)
    parts = sp.partials.gather(2, cols.expand(sp.num_parts, m, n)).float()
    total = torch.zeros(m, n, dtype=torch.float32, device=sp.partials.device)
    group = torch.zeros_like(total)
    for p in range(sp.num_parts):
        group = group + parts[p]
        if (p + 1) % sp.tail_group == 0 or p == sp.num_parts - 1:
            total = total + group
            group = torch.zeros_like(total)
    scale = sp.scale[ids.clamp(min=0)]
    h = torch.where(has[:, None], scale[:, None] * total, torch.zeros_like(total))
    return h.view(m, sp.slices, sp.rank).permute(1, 0, 2).contiguous()


__all__ = ["ShrinkPartials", "reduce_partials_ref"]
