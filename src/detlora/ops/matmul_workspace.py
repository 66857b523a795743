"""The batch-invariant matmul's workspace for its split-over-CTAs path."""

from __future__ import annotations

import torch

from detlora.ops.split_workspace import SplitWorkspace, per_device


class MatmulWorkspace(SplitWorkspace):
    """Scratch for chunk partials and per-tile counters of the split matmul path."""


_DEFAULT: dict[torch.device, MatmulWorkspace] = {}


def default_workspace(device: torch.device | str) -> MatmulWorkspace:
    """One shared workspace per device for callers that pass none."""
    return per_device(MatmulWorkspace, _DEFAULT, device)
