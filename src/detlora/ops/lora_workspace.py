"""The LoRA shrink's workspace: split scratch and counters, plus the rank it was sized for."""

from __future__ import annotations

import torch

from detlora.ops.split_workspace import SplitWorkspace, per_device

# Largest LoRA rank the kernels are built and tested for.
MAX_LORA_RANK = 128


class LoRAWorkspace(SplitWorkspace):
    """Scratch and counters for the ordered and tree shrinks; ``max_rank`` bounds the rank."""

    def __init__(self, device: torch.device | str, max_rank: int = MAX_LORA_RANK) -> None:
        if not isinstance(max_rank, int) or not 1 <= max_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_rank must be an int in [1, {MAX_LORA_RANK}], got {max_rank!r}")
        super().__init__(device)
        self.max_rank = max_rank


_DEFAULT: dict[torch.device, LoRAWorkspace] = {}


def default_workspace(device: torch.device | str) -> LoRAWorkspace:
    """One shared workspace per device for callers that pass none."""
    return per_device(LoRAWorkspace, _DEFAULT, device)
