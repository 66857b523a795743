"""Scratch and completion counters for the ordered and tree LoRA shrinks.

Allocated once and reused by every call, so a captured CUDA graph keeps valid pointers. The
ordered kernel leaves every counter at zero when it returns (the last CTA of a tile resets it),
so the counters are zeroed once, at allocation, and never again.
"""

from __future__ import annotations

import torch

# Largest LoRA rank the kernels are built and tested for.
MAX_LORA_RANK = 128


class LoRAWorkspace:
    """Reusable FP32 scratch for Split-K partials and int32 per-tile counters."""

    def __init__(self, device: torch.device | str, max_rank: int = MAX_LORA_RANK) -> None:
        if not isinstance(max_rank, int) or not 1 <= max_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_rank must be an int in [1, {MAX_LORA_RANK}], got {max_rank!r}")
        self.device = torch.device(device)
        self.max_rank = max_rank
        self._scratch = torch.empty(0, dtype=torch.float32, device=self.device)
        self._counters = torch.zeros(0, dtype=torch.int32, device=self.device)

    def scratch(self, numel: int) -> torch.Tensor:
        """A flat FP32 buffer of at least ``numel`` elements (contents undefined)."""
        if self._scratch.numel() < numel:
            self._check_not_capturing("scratch", numel)
            self._scratch = torch.empty(_grow(numel), dtype=torch.float32, device=self.device)
        return self._scratch[:numel]

    def counters(self, numel: int) -> torch.Tensor:
        """A flat int32 buffer of at least ``numel`` zeros (kept at zero by the kernel)."""
        if self._counters.numel() < numel:
            self._check_not_capturing("counters", numel)
            self._counters = torch.zeros(_grow(numel), dtype=torch.int32, device=self.device)
        return self._counters[:numel]

    def reserve(self, scratch_numel: int, counter_numel: int) -> None:
        """Grow both buffers ahead of a CUDA-graph capture."""
        self.scratch(scratch_numel)
        self.counters(counter_numel)

    def _check_not_capturing(self, what: str, numel: int) -> None:
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                f"LoRAWorkspace {what} must grow to {numel} elements during CUDA-graph capture; "
                "run the op once before capturing (or call reserve()) so the buffer exists"
            )


def _grow(numel: int) -> int:
    # Round up so that slowly growing batches do not reallocate every step.
    return max(1024, 1 << (numel - 1).bit_length())


_DEFAULT: dict[torch.device, LoRAWorkspace] = {}


def default_workspace(device: torch.device) -> LoRAWorkspace:
    """One shared workspace per device for callers that pass none."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ws = _DEFAULT.get(device)
    if ws is None:
        ws = _DEFAULT[device] = LoRAWorkspace(device)
    return ws
