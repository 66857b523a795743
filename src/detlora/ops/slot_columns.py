"""Where adapter slots' columns sit in an ``in_gemm`` linear's output, and which the rows use.

Kept apart from the matmul kernel so that layers and the CPU ops name it without loading
Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

from detlora.ops.adapter_groups import AdapterGroups


@dataclass(frozen=True)
class SlotColumns:
    """Which output columns of a linear belong to adapter slots (the ``in_gemm`` shrink): slot
    s owns ``[first + s * width, first + (s + 1) * width)``, and ``groups`` says which slots
    the rows use. ``linear`` then sums every column in the K order of the base columns alone
    (``k_split(first, K)``), so no bit depends on the number of slots or on where a slot sits,
    and may leave the columns of slots no row uses unwritten (their tiles are skipped: the
    cost follows the adapters in the batch, not the slots). ``linear_ref`` and vendor GEMMs
    ignore it and compute every column."""

    first: int
    width: int
    groups: AdapterGroups


__all__ = ["SlotColumns"]
