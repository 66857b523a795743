"""Identical-input replay metrics (the paper's section 5.2).

Run one op many times on the same inputs and compare every execution with the first:
how many comparisons differ at all, what fraction of elements differ, and by how much.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class ReplayStats:
    comparisons: int  # executions 1..n compared with execution 0
    differing: int  # comparisons with at least one differing element
    differing_element_fraction: float  # over all compared elements
    mean_abs_diff: float  # over all compared elements
    max_abs_diff: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def replay(op: Callable[[], torch.Tensor], executions: int, chunk: int = 64) -> ReplayStats:
    """Run ``op`` ``executions`` times; compare each output with the first, bit for bit.

    Outputs are compared in chunks on the op's device so that a thousand large outputs need
    not be held at once.
    """
    if executions < 2:
        raise ValueError(f"executions must be >= 2, got {executions}")
    first = op().clone()
    differing = 0
    diff_elems = 0
    abs_sum = 0.0
    abs_max = 0.0
    done = 1
    while done < executions:
        n = min(chunk, executions - done)
        outs = torch.stack([op().clone() for _ in range(n)])
        diff = outs != first.unsqueeze(0)
        per_run = diff.flatten(1).any(dim=1)
        differing += int(per_run.sum())
        diff_elems += int(diff.sum())
        delta = (outs.double() - first.double().unsqueeze(0)).abs()
        abs_sum += float(delta.sum())
        abs_max = max(abs_max, float(delta.max()))
        done += n
    comparisons = executions - 1
    total = comparisons * first.numel()
    return ReplayStats(
        comparisons=comparisons,
        differing=differing,
        differing_element_fraction=diff_elems / total,
        mean_abs_diff=abs_sum / total,
        max_abs_diff=abs_max,
    )
