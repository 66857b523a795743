"""Scratch and per-tile counters for the split-over-CTAs path of the batch-invariant matmul.

Allocated once and reused by every call, so a captured CUDA graph keeps valid pointers. The
kernel leaves every counter at zero when it returns (the last CTA of a tile resets it), so the
counters are zeroed once, at allocation, and never again.

One workspace serves one stream at a time: two matmuls running concurrently on different
streams must not share one (give each stream its own ``MatmulWorkspace``).
"""

from __future__ import annotations

import torch


class MatmulWorkspace:
    """Reusable FP32 scratch for chunk partials and int32 per-tile completion counters."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
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

    @property
    def scratch_capacity(self) -> int:
        return self._scratch.numel()

    @property
    def counter_capacity(self) -> int:
        return self._counters.numel()

    def _check_not_capturing(self, what: str, numel: int) -> None:
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                f"MatmulWorkspace {what} must grow to {numel} elements during CUDA-graph "
                "capture; run the op once before capturing (or call reserve()) so the buffer "
                "exists"
            )


def _grow(numel: int) -> int:
    # Round up so that slowly growing batches do not reallocate every step.
    return max(1024, 1 << (numel - 1).bit_length())


_DEFAULT: dict[torch.device, MatmulWorkspace] = {}


def default_workspace(device: torch.device | str) -> MatmulWorkspace:
    """One shared workspace per device for callers that pass none."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ws = _DEFAULT.get(device)
    if ws is None:
        ws = _DEFAULT[device] = MatmulWorkspace(device)
    return ws
